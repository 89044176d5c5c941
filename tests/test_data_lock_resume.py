"""Data read as written, the run lock taken before the output folder is read, options checked in one sentence,
resumes that do not redo work, and checkpoints checked by name and size and flushed to disk (shared code, through
grpo.py's and ppo.py's copies). Each case is compared with what was written: the rows a .jsonl of the same values
gives, the bytes of a log, the sentence a user reads."""

import bz2
import gzip
import json
import lzma
import os
import re
import runpy
import subprocess
import sys

import pytest
import tyro
from helpers import ROOT, set_up, tiny_llama_config
from test_robustness import (  # noqa: F401 (small_held_out_set: its autouse fixture, which sets the tiny runs' data)
    cli,
    failing_reward,
    finished,
    launch,
    script_command,
    small_held_out_set,
)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import grpo
import ppo

POLICY = os.path.join(ROOT, "assets", "tiny-sft")

# ---------------------------------------------------------------- data read as written

# Answers as a spreadsheet holds them: integers beside a decimal, and the words pandas would read as missing.
CELLS = ["119", "3.5", "N/A", "NA", "null", "None", "nan", "#N/A", "", "007", "1,234"]


# A prompt with each format's own hard character: a .csv's comma (in a quoted cell), a .tsv's quotes (it has no quoting)
PROMPTS = {"csv": "{i}, what is it?", "tsv": '{i} "what" is it?'}


def table(kind):
    """A header and a row per answer in CELLS, as text: a .csv's cells quoted, a .tsv's as they are."""
    lines = []
    for i, cell in enumerate(CELLS):
        prompt = PROMPTS[kind].format(i=i)
        if kind == "csv":
            lines.append(f'"{prompt}","{cell}"')
        else:
            lines.append(f"{prompt}\t{cell}")
    header = {"csv": "prompt,answer", "tsv": "prompt\tanswer"}[kind]
    return "\n".join([header, *lines]) + "\n"


def test_csv_and_tsv_cells_are_read_as_text_as_the_jsonl_reader_sees_them(tmp_path):
    """Every cell as text, compressed or not: "119" stays "119" beside a "3.5" (not "119.0"), and "N/A", "nan", ""
    stay strings (not None). Before, datasets' csv reader turned them into floats and nulls, and .tsv was not read."""
    args = grpo.Args(eval_every=0)
    compressions = {"": bytes, ".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}
    for kind in ("csv", "tsv"):
        expected = [{"prompt": PROMPTS[kind].format(i=i), "answer": cell} for i, cell in enumerate(CELLS)]
        jsonl = tmp_path / f"{kind}.jsonl"
        jsonl.write_text("".join(json.dumps(row) + "\n" for row in expected))
        assert grpo.read_rows(str(jsonl), "train", args) == expected  # the .jsonl reader: the reference
        for suffix, compress in compressions.items():
            path = tmp_path / f"rows.{kind}{suffix}"
            path.write_bytes(compress(table(kind).encode()))
            assert grpo.read_rows(str(path), "train", args) == expected, path.name


def test_a_tsv_is_a_row_a_line_and_its_quotes_are_text(tmp_path):
    """40 lines of prompts holding quotes, some opened and never closed: 40 rows, each line split at its tabs (before,
    csv quoting let a cell that opens a quote swallow the lines up to the next quote: 21 rows)."""
    lines = ["prompt\tanswer"]
    for i in range(40):
        quotes = ['say "hi" to {i}', '"{i}" in quotes', '"{i} opens a quote', "it's {i}''"][i % 4]
        lines.append(f"{quotes.format(i=i)}\t{i}")
    path = tmp_path / "train.tsv"
    path.write_text("\n".join(lines) + "\n")
    expected = [dict(zip(["prompt", "answer"], line.split("\t"))) for line in lines[1:]]
    assert grpo.read_rows(str(path), "train", grpo.Args()) == expected
    path.write_text("prompt\tanswer\n1\t+1=\t2\n")  # a tab in a prompt is a separator
    with pytest.raises(SystemExit, match=r"line 2 of '.*train.tsv' has 3 cells and its header 2; fix that line \(a "):
        grpo.read_rows(str(path), "train", grpo.Args())


def test_json_lines_are_split_at_newlines_alone(tmp_path):
    """Strings holding a raw U+2028, U+2029 or U+0085 (json.dumps(ensure_ascii=False) writes them so) are read
    back as written (before, str.splitlines split there and the line was refused as invalid JSON)."""
    rows = [{"prompt": f"line{sep}break", "answer": "1"} for sep in ("\u2028", "\u2029", "\x85")]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    assert grpo.read_rows(str(path), "train", grpo.Args()) == rows


def test_a_csv_cell_longer_than_the_csv_modules_default_limit_is_read(tmp_path):
    """A grader's test cases in the answer column: a cell of 1,000,000 characters (the csv module refuses past
    131,072 by default, and the line was refused as bad)."""
    answer = "assert f(1) == 2\n" * 62_500
    path = tmp_path / "train.csv"
    path.write_text(f'prompt,answer\nwrite f,"{answer}"\n')
    assert grpo.read_rows(str(path), "train", grpo.Args()) == [{"prompt": "write f", "answer": answer}]


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)])
def test_a_compressed_file_cut_short_is_one_sentence(suffix, compress, tmp_path):
    """Half of a compressed file (a copy cut short): one sentence, for .bz2 too (before, bz2's ValueError was a
    traceback)."""
    whole = compress(b'{"prompt": "1+1=", "answer": "2"}\n' * 1000)
    path = tmp_path / f"train.jsonl{suffix}"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SystemExit, match=f"dataset file '.*train.jsonl{suffix}' is not a whole {suffix} file \\("):
        grpo.read_rows(str(path), "train", grpo.Args())


def test_a_fifo_is_said_to_be_no_regular_file(tmp_path):
    """A named pipe given as --dataset exists: it is said to be no regular file (before, it "did not exist")."""
    path = tmp_path / "train.jsonl"
    os.mkfifo(path)
    with pytest.raises(SystemExit, match=f"^dataset file '{re.escape(str(path))}' is not a regular file; pass a file"):
        grpo.read_rows(str(path), "train", grpo.Args())


def test_a_csv_row_of_other_width_is_named(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("prompt,answer\n1+1=,2\n2+2=,4,extra\n")
    with pytest.raises(SystemExit, match=r"line 3 of '.*rows.csv' has 3 cells and its header 2; fix that line"):
        grpo.read_rows(str(path), "train", grpo.Args())


def test_a_data_path_is_a_path_never_a_pattern(tmp_path):
    """'train[1].csv' is that file, not train1.csv beside it (a glob's [1]); 'data[v2].csv' alone is read too."""
    (tmp_path / "train[1].csv").write_text("prompt,answer\nbrackets,1\n")
    (tmp_path / "train1.csv").write_text("prompt,answer\nno brackets,2\n")
    (tmp_path / "data[v2].csv").write_text("prompt,answer\nalone,3\n")
    args = grpo.Args()
    assert grpo.read_rows(str(tmp_path / "train[1].csv"), "train", args) == [{"prompt": "brackets", "answer": "1"}]
    assert grpo.read_rows(str(tmp_path / "data[v2].csv"), "train", args) == [{"prompt": "alone", "answer": "3"}]


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_a_file_rewritten_in_place_is_read_again(kind, tmp_path):
    """The same name, size and modification time (a file from an archive), other rows: the new rows are read, none
    from a cache (before, datasets' cache gave the old rows back)."""
    import datasets

    path = tmp_path / f"train.{kind}"
    stamp = None
    for answer in ("one", "two"):  # the same size
        rows = [{"prompt": "1+0=", "answer": answer}]
        if kind == "csv":
            path.write_text(f"prompt,answer\n1+0=,{answer}\n")
        else:
            datasets.Dataset.from_list(rows).to_parquet(str(path))
        if stamp is None:
            stamp = os.stat(path).st_mtime_ns
        os.utime(path, ns=(stamp, stamp))
        assert grpo.read_rows(str(path), "train", grpo.Args()) == rows


def test_zstd_is_said_and_every_compression_the_docs_list_is_read(tmp_path):
    """docs/models-and-gpus.md lists the compressions a data file may have: each reads from a fresh install (the
    standard library's), and a .zst file is answered in one sentence (zstd would need a package)."""
    docs = open(os.path.join(ROOT, "docs", "models-and-gpus.md")).read()
    compressions = re.search(r"compressed too\s+\(([^)]*)\)", docs.split("## Data")[1])[1]  # (`.gz`, ...: why)
    listed = re.findall(r"`(\.\w+)`", compressions)
    assert listed == [".gz", ".bz2", ".xz"]
    compress = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}
    for suffix in listed:
        path = tmp_path / f"train.jsonl{suffix}"
        path.write_bytes(compress[suffix](b'{"prompt": "1+1=", "answer": "2"}\n'))
        assert grpo.read_rows(str(path), "train", grpo.Args()) == [{"prompt": "1+1=", "answer": "2"}]
    (tmp_path / "train.jsonl.zst").write_bytes(b"(\xb5/\xfd")
    with pytest.raises(SystemExit, match="is compressed with zstd, .*; decompress it \\(zstd -d\\)"):
        grpo.read_rows(str(tmp_path / "train.jsonl.zst"), "train", grpo.Args())


@pytest.mark.parametrize("answer", [["119"], {"value": "119"}])
def test_a_built_in_rule_refuses_an_answer_that_is_not_text_or_a_number(answer, tmp_path):
    """A list (a parquet column of lists), a dict: the row is named before any model loads (before, ["119"] was
    compared as the text "['119']" and the run exited 0 with accuracy 0)."""
    import datasets

    rows = [{"prompt": "100+19=", "answer": "119"}, {"prompt": "1+1=", "answer": answer}]
    tokenizer = AutoTokenizer.from_pretrained(POLICY, padding_side="left")
    args = grpo.Args(eval_every=0, reward_fn=("arithmetic",))
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    paths = [path]
    if isinstance(answer, list):  # as parquet holds it
        paths.append(tmp_path / "train.parquet")
        datasets.Dataset.from_list([{**row, "answer": ["119"]} for row in rows]).to_parquet(str(paths[1]))
    for path in paths:
        with pytest.raises(
            SystemExit,
            match=f"row [12] of '{re.escape(str(path))}' has a (list|dict) as its 'answer' .*; the built-in rules "
            "compare text or a number: store the answer as one.",
        ):
            grpo.load_prompts(str(path), "train", args, tokenizer)


# ---------------------------------------------------------------- the lock, taken first

HOLD = """import os, sys, time
f = open(sys.argv[1], "a+")
os.lockf(f.fileno(), os.F_TLOCK, 0)
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_resume_while_a_run_holds_the_folder_is_refused_before_reading_it(tmp_path):
    """The lock is taken before any checkpoint is read: --resume auto beside a running run is refused with "in use by
    another run" (before, it read the checkpoints that the run's rotation was deleting)."""
    out = tmp_path / "run"
    (out / "checkpoint-3").mkdir(parents=True)  # damaged (no manifest): reading it would say so
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out / "run.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        args = grpo.Args(output_dir=str(out), resume="auto", eval_every=0)
        with pytest.raises(SystemExit) as stopped:
            set_up(grpo, args)
    finally:
        holder.kill()
        holder.wait()
    assert stopped.value.code.startswith(f"--output_dir '{out}' is in use by another run (")


def test_a_run_lock_that_is_a_folder_or_cannot_be_written_is_one_sentence_before_any_model(tmp_path):
    out = tmp_path / "run"
    (out / "run.lock").mkdir(parents=True)
    with pytest.raises(SystemExit, match="its run.lock cannot be opened for writing \\(Is a directory\\); remove it"):
        set_up(grpo, grpo.Args(output_dir=str(out), eval_every=0))
    if os.geteuid() != 0:  # root writes any file
        (out / "run.lock").rmdir()
        (out / "run.lock").write_text("")
        (out / "run.lock").chmod(0o444)
        with pytest.raises(SystemExit, match="its run.lock cannot be opened for writing \\(Permission denied\\)"):
            set_up(grpo, grpo.Args(output_dir=str(out), eval_every=0))


def test_a_run_lock_that_is_a_link_is_refused_and_what_it_names_left_whole(tmp_path):
    """run.lock a symbolic link to a file of the user's, or to none: refused in one sentence, the file left as it
    was and none created (before, the link was followed and the file it names emptied)."""
    (tmp_path / "notes.txt").write_text("a week of notes")
    for target in ("notes.txt", "nothing-here"):
        out = tmp_path / f"run-{target}"
        out.mkdir()
        (out / "run.lock").symlink_to(tmp_path / target)
        with pytest.raises(SystemExit, match="its run.lock cannot be opened for writing \\(it is a symbolic link, "):
            grpo.take_lock(str(out))
    assert (tmp_path / "notes.txt").read_text() == "a week of notes"
    assert not (tmp_path / "nothing-here").exists()


def test_a_run_lock_holding_bytes_that_are_not_text_is_taken_over_and_said(tmp_path, capsys):
    (tmp_path / "run.lock").write_bytes(b"\xff\xfe\x00garbage")
    lock = grpo.take_lock(str(tmp_path))
    assert "garbage has ended; this run takes the folder over" in capsys.readouterr().out
    assert (tmp_path / "run.lock").read_text() == f"process {os.getpid()} on {os.uname().nodename}"
    lock.close()


# ---------------------------------------------------------------- options, in one sentence


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -float("inf"), 1e39])
def test_reward_weights_must_be_finite_and_within_float32(weight):
    args = grpo.Args(reward_fn=("arithmetic", "gsm8k"), reward_weights=(1.0, weight))
    with pytest.raises(SystemExit, match=r"--reward_weights must each be finite and within \+-3.4e\+38 \(got "):
        grpo.validate(args)


@pytest.mark.parametrize("spec", ["None", "none"])
def test_reward_fn_none_is_refused_as_no_rules_name(spec):
    with pytest.raises(SystemExit, match=f"unknown --reward_fn '{spec}'; choose one of"):
        set_up(grpo, grpo.Args(reward_fn=(spec,), eval_every=0))


def test_a_reward_tokenizer_with_ids_past_the_embeddings_is_refused_before_its_model_loads(tmp_path):
    """A word-level tokenizer of 300 words with ids from 1000 up, beside a model of 784 embeddings: 303 tokens fit in
    784, but the ids do not (before, the check counted tokens and the first score raised IndexError)."""
    words = {f"word{i}": 1000 + i for i in range(300)} | {"<pad>": 1300, "<unk>": 1301, "</s>": 1302}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    assert len(tokenizer) <= 784 < max(tokenizer.get_vocab().values())
    rm = tmp_path / "rm"
    tokenizer.save_pretrained(rm)
    config = tiny_llama_config(vocab_size=784, num_hidden_layers=1)
    config.architectures = ["LlamaForSequenceClassification"]
    config.save_pretrained(rm)  # no weights: the check must come before they load
    args = ppo.Args(reward_model_path=(str(rm),))
    policy_tokenizer = AutoTokenizer.from_pretrained(POLICY, padding_side="left")
    with pytest.raises(SystemExit, match="ids past the model's 784 embeddings \\(its largest is 1302\\)"):
        ppo.load_reward_models(args, policy_tokenizer, "cpu")


# ---------------------------------------------------------------- resume and logs


def saved_by_hand(folder, iteration, args):
    """A checkpoint folder of the given name holding a state of the given iteration, completed as a save completes."""
    tmp = folder.parent / (folder.name + ".tmp")
    tmp.mkdir()
    (folder.parent / "metrics.jsonl").touch()  # the run's log, which the checkpoint copies
    grpo.complete_checkpoint(str(tmp), str(folder), args, grpo.new_state() | {"iteration": iteration})


def test_a_state_of_another_iteration_than_its_name_is_refused(tmp_path):
    """checkpoint-3 whose state.json says iteration 1 (a folder renamed, or a state copied in): refused before it
    loads (it would log iterations 2 and 3 twice)."""
    args = grpo.Args(output_dir=str(tmp_path))
    saved_by_hand(tmp_path / "checkpoint-2", 2, args)
    saved_by_hand(tmp_path / "checkpoint-3", 1, args)
    assert grpo.checkpoint_problem(str(tmp_path / "checkpoint-2")) is None
    assert grpo.checkpoint_problem(str(tmp_path / "checkpoint-3")) == "its name says iteration 3, its state.json 1"


def test_a_completed_save_is_flushed_to_disk_and_leaves_no_tmp(tmp_path, monkeypatch):
    """Each JSON file, the checkpoint's folder and the folder it is renamed in are fsync'd (the shards dcp.save
    flushes itself): a crash of the machine after the save cannot undo it; no .tmp folder is left."""
    flushed = []

    def fsync(fd):
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "fsync", fsync)
    saved_by_hand(tmp_path / "checkpoint-2", 2, grpo.Args(output_dir=str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "metrics.jsonl"]
    tmp = str(tmp_path / "checkpoint-2.tmp")
    assert sorted(flushed) == sorted(
        [f"{tmp}/args.json", f"{tmp}/state.json", f"{tmp}/metrics.jsonl", f"{tmp}/manifest.json", tmp, str(tmp_path)]
    )
    assert sorted(os.listdir(tmp_path / "checkpoint-2")) == [
        "args.json",
        "manifest.json",
        "metrics.jsonl",
        "state.json",
    ]


def test_ctrl_c_while_starting_is_one_line(monkeypatch, capsys):
    """Ctrl-C before the run's own handler is set (while the models load): one line and exit status 130, no
    KeyboardInterrupt traceback."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tyro, "cli", interrupted)
    monkeypatch.setattr(sys, "argv", ["grpo.py"])
    code = None
    try:
        runpy.run_path(os.path.join(ROOT, "grpo.py"), run_name="__main__")
    except KeyboardInterrupt:  # what python prints as a traceback
        pytest.fail("Ctrl-C while starting ended in a KeyboardInterrupt traceback")
    except SystemExit as e:
        code = e.code
    assert code == 130
    assert capsys.readouterr().err == "stopped by Ctrl-C while starting: nothing was saved\n"
