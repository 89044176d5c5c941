"""Data read as written (rlhf_runtime/data.py, the same code for every script: tested once here, with ppo.py's or
grpo.py's Args where a task's options matter): .jsonl, .csv, .tsv, .parquet, compressed or not, a hub dataset with its
configuration; each case compared with what was written (the rows a .jsonl of the same
values gives); bad data named by its row in one sentence before any model loads, leaving nothing behind; the held-out
set found beside the training file."""

import bz2
import gzip
import json
import lzma
import os
import re
import warnings

import pytest
import torch
from helpers import ROOT, args_for, make_args, run_main, tiny_run, without_timing
from transformers import AutoTokenizer

import grpo
import ppo
from rlhf_runtime.data import held_out_dataset, load_prompts, load_task, read_rows
from rlhf_runtime.rewards import answer_of
from rlhf_runtime.settings import RunSettings

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
    compressions = {"": bytes, ".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}
    for kind in ("csv", "tsv"):
        expected = [{"prompt": PROMPTS[kind].format(i=i), "answer": cell} for i, cell in enumerate(CELLS)]
        jsonl = tmp_path / f"{kind}.jsonl"
        jsonl.write_text("".join(json.dumps(row) + "\n" for row in expected))
        assert read_rows(str(jsonl), "train") == expected  # the .jsonl reader: the reference
        for suffix, compress in compressions.items():
            path = tmp_path / f"rows.{kind}{suffix}"
            path.write_bytes(compress(table(kind).encode()))
            assert read_rows(str(path), "train") == expected, path.name


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
    assert read_rows(str(path), "train") == expected
    path.write_text("prompt\tanswer\n1\t+1=\t2\n")  # a tab in a prompt is a separator
    with pytest.raises(SystemExit, match=r"line 2 of '.*train.tsv' has 3 cells and its header 2; fix that line \(a "):
        read_rows(str(path), "train")


def test_json_lines_are_split_at_newlines_alone(tmp_path):
    """Strings holding a raw U+2028, U+2029 or U+0085 (json.dumps(ensure_ascii=False) writes them so) are read
    back as written (before, str.splitlines split there and the line was refused as invalid JSON)."""
    rows = [{"prompt": f"line{sep}break", "answer": "1"} for sep in ("\u2028", "\u2029", "\x85")]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    assert read_rows(str(path), "train") == rows


def test_a_csv_cell_longer_than_the_csv_modules_default_limit_is_read(tmp_path):
    """A grader's test cases in the answer column: a cell of 1,000,000 characters (the csv module refuses past
    131,072 by default, and the line was refused as bad)."""
    answer = "assert f(1) == 2\n" * 62_500
    path = tmp_path / "train.csv"
    path.write_text(f'prompt,answer\nwrite f,"{answer}"\n')
    assert read_rows(str(path), "train") == [{"prompt": "write f", "answer": answer}]


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)])
def test_a_compressed_file_cut_short_is_one_sentence(suffix, compress, tmp_path):
    """Half of a compressed file (a copy cut short): one sentence, for .bz2 too (before, bz2's ValueError was a
    traceback)."""
    whole = compress(b'{"prompt": "1+1=", "answer": "2"}\n' * 1000)
    path = tmp_path / f"train.jsonl{suffix}"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SystemExit, match=f"dataset file '.*train.jsonl{suffix}' is not a whole {suffix} file \\("):
        read_rows(str(path), "train")


def test_a_fifo_is_said_to_be_no_regular_file(tmp_path):
    """A named pipe given as --dataset exists: it is said to be no regular file (before, it "did not exist")."""
    path = tmp_path / "train.jsonl"
    os.mkfifo(path)
    with pytest.raises(SystemExit, match=f"^dataset file '{re.escape(str(path))}' is not a regular file; pass a file"):
        read_rows(str(path), "train")


def test_a_csv_row_of_other_width_is_named(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("prompt,answer\n1+1=,2\n2+2=,4,extra\n")
    with pytest.raises(SystemExit, match=r"line 3 of '.*rows.csv' has 3 cells and its header 2; fix that line"):
        read_rows(str(path), "train")


def test_a_data_path_is_a_path_never_a_pattern(tmp_path):
    """'train[1].csv' is that file, not train1.csv beside it (a glob's [1]); 'data[v2].csv' alone is read too."""
    (tmp_path / "train[1].csv").write_text("prompt,answer\nbrackets,1\n")
    (tmp_path / "train1.csv").write_text("prompt,answer\nno brackets,2\n")
    (tmp_path / "data[v2].csv").write_text("prompt,answer\nalone,3\n")
    assert read_rows(str(tmp_path / "train[1].csv"), "train") == [{"prompt": "brackets", "answer": "1"}]
    assert read_rows(str(tmp_path / "data[v2].csv"), "train") == [{"prompt": "alone", "answer": "3"}]


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
        assert read_rows(str(path), "train") == rows


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
        assert read_rows(str(path), "train") == [{"prompt": "1+1=", "answer": "2"}]
    (tmp_path / "train.jsonl.zst").write_bytes(b"(\xb5/\xfd")
    with pytest.raises(SystemExit, match="is compressed with zstd, .*; decompress it \\(zstd -d\\)"):
        read_rows(str(tmp_path / "train.jsonl.zst"), "train")


def test_local_data_in_every_format_reads_as_the_jsonl(tmp_path):
    """The same rows as .csv, .parquet, a gzipped .jsonl and an upper-case .JSONL: each gives the .jsonl's prompts
    and answers (before, every one of them went to the hub loader: "Couldn't find any data file"); a folder named
    like a data file is said to be a folder, and a file whose contents do not parse is named."""
    import datasets

    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(open(os.path.join(ROOT, "assets", "arithmetic", "train.jsonl")).readlines()[:12]))
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "train.csv"), index=False)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    (tmp_path / "train.jsonl.gz").write_bytes(gzip.compress(jsonl.read_bytes()))
    (tmp_path / "TRAIN.JSONL").write_bytes(jsonl.read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"), padding_side="left")
    args = make_args(grpo, eval_every=0)
    prompts, expected = load_prompts(str(jsonl), "train", args.run, tokenizer, args.reward_fn)
    for name in ("train.csv", "train.parquet", "train.jsonl.gz", "TRAIN.JSONL"):
        got, got_rows = load_prompts(str(tmp_path / name), "train", args.run, tokenizer, args.reward_fn)
        assert got == prompts, name
        assert [(r["prompt"], str(r["answer"])) for r in got_rows] == [(r["prompt"], r["answer"]) for r in expected]
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(SystemExit, match="dataset file '.*folder.jsonl' is a folder; pass a file of"):
        load_prompts(str(tmp_path / "folder.jsonl"), "train", args.run, tokenizer, args.reward_fn)
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(SystemExit, match="dataset file '.*bad.parquet' could not be loaded .*; check its contents"):
        load_prompts(str(tmp_path / "bad.parquet"), "train", args.run, tokenizer, args.reward_fn)


def test_hub_dataset_configuration_is_passed_to_load_dataset(monkeypatch):
    """Hub datasets with several configurations (openai/gsm8k: main, socratic) need --dataset_config; no hub here, so
    the loader is replaced by one that, like the hub's, refuses to guess a missing configuration."""
    import datasets

    def load_dataset(path, name=None, split=None):
        if name is None:
            raise ValueError("Config name is missing.")
        return [{"question": f"{path}/{name}/{split}", "answer": "#### 1"}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    run = RunSettings()
    with pytest.raises(SystemExit, match="--dataset_config"):
        read_rows("openai/gsm8k", "train", run.prompt_field, run.dataset_config)
    run.dataset_config = "main"
    rows = read_rows("openai/gsm8k", "train", run.prompt_field, run.dataset_config)
    assert rows == [{"question": "openai/gsm8k/main/train", "answer": "#### 1"}]


# ---------------------------------------------------------------- bad data, in one sentence before any model loads


def test_bad_datasets(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(POLICY)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "wrong.jsonl").write_text(json.dumps({"text": "the food was"}) + "\n")
    (tmp_path / "long.jsonl").write_text(
        json.dumps({"prompt": "the food was " * 20}) + "\n" + json.dumps({"prompt": "the plot was"}) + "\n"
    )
    with pytest.raises(SystemExit, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"), "train", RunSettings(), tokenizer)
    with pytest.raises(SystemExit, match="empty"):
        load_prompts(str(tmp_path / "empty.jsonl"), "train", RunSettings(), tokenizer)
    with pytest.raises(SystemExit, match="no 'prompt' column"):
        load_prompts(str(tmp_path / "wrong.jsonl"), "train", RunSettings(), tokenizer)
    with pytest.raises(SystemExit, match="longer than --max_prompt_length 16"):
        load_prompts(str(tmp_path / "long.jsonl"), "train", RunSettings(max_prompt_length=16), tokenizer)
    with pytest.warns(UserWarning, match="cut to their last 16 tokens"):
        prompts, _ = load_prompts(
            str(tmp_path / "long.jsonl"), "train", RunSettings(max_prompt_length=16, truncate_prompts=True), tokenizer
        )
    full = tokenizer("the food was " * 20, add_special_tokens=False)["input_ids"]
    assert prompts[0] == full[-16:]
    assert prompts[1] == tokenizer("the plot was", add_special_tokens=False)["input_ids"]
    with pytest.raises(SystemExit, match="needs an answer column"):
        load_prompts(
            str(tmp_path / "long.jsonl"),
            "train",
            RunSettings(max_prompt_length=200),
            tokenizer,
            ("arithmetic",),
        )
    (tmp_path / "broken.jsonl").write_text(
        json.dumps({"prompt": "the food was"}) + "\n\n" + '{"prompt": "the plot was"' + "\n"
    )
    with pytest.raises(SystemExit, match="line 3 of '.*broken.jsonl' is not valid JSON"):
        load_prompts(str(tmp_path / "broken.jsonl"), "train", RunSettings(), tokenizer)
    (tmp_path / "number.jsonl").write_text(json.dumps({"prompt": 12}) + "\n")
    with pytest.raises(SystemExit, match="row 1 of .* has a int as its prompt"):
        load_prompts(str(tmp_path / "number.jsonl"), "train", RunSettings(), tokenizer)
    # HF_HUB_OFFLINE=1 (conftest): a hub dataset cannot be fetched, and the error says so instead of a traceback
    with pytest.raises(
        SystemExit, match="hub dataset 'someone/reviews' could not be loaded .*; check its name, the split 'train'"
    ):
        load_prompts("someone/reviews", "train", RunSettings(), tokenizer)


def test_bad_datasets_name_the_row_and_leave_nothing_behind(tmp_path):
    cases = {
        "latin1.jsonl": (b'{"prompt": "fine"}\n{"prompt": "caf\xe9 was"}\n', "line 2 of .* is not UTF-8 text"),
        "blank.jsonl": (b'{"prompt": "fine"}\n{"prompt": "   \\t "}\n', "row 2 of .* has an empty prompt"),
        "empty.jsonl": (b'{"prompt": "fine"}\n{"prompt": ""}\n', "row 2 of .* has an empty prompt"),
        "long.jsonl": (
            b'{"prompt": "the"}\n' + b'{"prompt": "' + b"the movie was good " * 40 + b'"}\n',
            "1 prompts of .* are longer than --max_prompt_length 64 \\(the first is row 2",
        ),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        out = tmp_path / f"run_{name}"
        args = make_args(ppo, dataset=str(tmp_path / name), output_dir=str(out), eval_every=0)
        ppo.validate(args)
        with pytest.raises(SystemExit, match=message):
            load_task(args, torch.device("cpu"))
        assert not out.exists(), f"{name}: the output folder was left behind"


@pytest.mark.parametrize("answer", [["119"], {"value": "119"}])
def test_a_built_in_rule_refuses_an_answer_that_is_not_text_or_a_number(answer, tmp_path):
    """A list (a parquet column of lists), a dict: the row is named before any model loads (before, ["119"] was
    compared as the text "['119']" and the run exited 0 with accuracy 0)."""
    import datasets

    rows = [{"prompt": "100+19=", "answer": "119"}, {"prompt": "1+1=", "answer": answer}]
    tokenizer = AutoTokenizer.from_pretrained(POLICY, padding_side="left")
    args = make_args(grpo, eval_every=0, reward_fn=("arithmetic",))
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
            load_prompts(str(path), "train", args.run, tokenizer, args.reward_fn)


def test_a_null_answer_for_a_built_in_rule_is_refused(tmp_path):
    """ "answer": null would be scored against the text 'None'; the row is named before any model loads."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": null}\n')
    args = make_args(grpo, dataset=str(data), output_dir=str(tmp_path / "run"), eval_every=0)
    grpo.validate(args)
    with pytest.raises(
        SystemExit,
        match="--reward_fn arithmetic needs an answer column, but row 2 of .* has no \\(or a null\\) 'answer'",
    ):
        load_task(args, torch.device("cpu"))
    assert not (tmp_path / "run").exists()


def test_a_rule_reward_needs_answers(tmp_path):
    # grpo.py alone: the check is rlhf_runtime's load_prompts, one code for every script (it was run through grpo.py's
    # and rloo.py's copies when each script held its own); one script's Args exercise all of it.
    args = args_for("grpo.py", tmp_path, reward_fn=("arithmetic",))
    tokenizer = AutoTokenizer.from_pretrained(args.run.model_name_or_path)
    reviews = os.path.join(ROOT, "assets", "reviews", "train.jsonl")
    with pytest.raises(
        SystemExit, match="--reward_fn arithmetic needs an answer column, but row 1 of .*reviews/train.jsonl"
    ):
        load_prompts(reviews, "train", args.run, tokenizer, args.reward_fn)


# ---------------------------------------------------------------- columns as named, prompts as messages


def test_an_answer_column_named_with_a_dot_is_read_as_named_and_else_as_a_nested_path(tmp_path):
    """A csv of verl's data, or datasets' flatten() of it, names a column reward_model.ground_truth: before, the
    built-in rule refused it in a sentence that listed it among the row's columns. A column of that name wins over
    the nested path; without one, the path is read."""
    data = tmp_path / "train.csv"
    data.write_text("prompt,reward_model.ground_truth\n1+1=,2\n2+2=,4\n")
    run = RunSettings(answer_field="reward_model.ground_truth")
    tokenizer = AutoTokenizer.from_pretrained(POLICY, padding_side="left")
    _, rows = load_prompts(str(data), "train", run, tokenizer, ("arithmetic",))
    assert [answer_of(row, run.answer_field) for row in rows] == ["2", "4"]
    nested = {"prompt": "1+1=", "reward_model": {"style": "rule", "ground_truth": "2"}}
    assert answer_of(nested, run.answer_field) == "2"
    assert answer_of({**nested, "reward_model.ground_truth": "3"}, run.answer_field) == "3"
    assert answer_of(nested, "reward_model.missing") is None


def test_every_row_holds_every_column_of_the_data_as_datasets_reads_it(tmp_path):
    """A .jsonl whose later row has a column the first lacks: every row holds it, None where absent, as datasets
    reads the file (TRL's functions get each column for every row; before, the first row's columns alone)."""
    import datasets

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "level": 3, "answer": "4"}\n')
    tokenizer = AutoTokenizer.from_pretrained(POLICY, padding_side="left")
    _, rows = load_prompts(str(data), "train", RunSettings(), tokenizer)
    assert rows == [{"prompt": "1+1=", "answer": "2", "level": None}, {"prompt": "2+2=", "answer": "4", "level": 3}]
    assert rows == list(datasets.load_dataset("json", data_files=str(data), split="train"))


@pytest.mark.parametrize(
    "prompt, chat_template, fix",
    [
        ([{"role": "user", "content": "1+1="}], False, "store the prompts as text"),
        ([{"role": "user", "content": "1+1="}], True, "store the prompts as text"),
        ("1+1=", True, "drop --chat_template"),
    ],
)
def test_a_tokenizer_without_a_chat_template_is_refused_with_the_fix_that_applies(prompt, chat_template, fix, tmp_path):
    """Before, a user whose data held messages was told to drop a --chat_template they never passed."""
    tokenizer = AutoTokenizer.from_pretrained(POLICY, padding_side="left")
    tokenizer.chat_template = None  # a model saved without one
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": prompt, "answer": "2"}) + "\n")
    run = RunSettings(chat_template=chat_template)
    with pytest.raises(SystemExit) as refused:
        load_prompts(str(data), "train", run, tokenizer)
    assert str(refused.value) == (
        f"row 1 of '{data}' needs a chat template, but the tokenizer of '{run.model_name_or_path}' has none; save "
        f"one with it (tokenizer_config.json's chat_template), or {fix}."
    )


def test_prompts_as_messages_train_the_embedded_policy_as_the_same_prompts_as_text(tmp_path):
    """TRL's and verl's data hold each prompt as a user's message: the embedded policy's chat template renders it as
    the plain prompt it was trained on, so grpo.py's run is bitwise the run on the text (before: refused, the
    tokenizer had no chat template)."""
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "assets", "arithmetic", "train.jsonl"))][:64]
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat = tmp_path / "chat.jsonl"
    as_messages = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    chat.write_text("".join(json.dumps(r) + "\n" for r in as_messages))
    common = tiny_run("grpo.py", total_episodes=16, eval_every=0)  # two iterations
    on_text, _ = run_main("grpo.py", tmp_path / "text", f"--dataset={text}", *common)
    on_messages, _ = run_main("grpo.py", tmp_path / "chat", f"--dataset={chat}", *common)
    assert len(on_messages) == 2
    assert without_timing(on_messages) == without_timing(on_text)


# ---------------------------------------------------------------- the held-out set


def held_out_of(**values):
    """The path of the held-out set load_task reads (None: none) for ppo.py's Args of these options: held_out_dataset
    of its --dataset, --eval_dataset and --eval_every (10 by default)."""
    args = make_args(ppo, **values)
    return held_out_dataset(args.dataset, args.run.eval_dataset, args.run.eval_every)


def test_held_out_dataset_defaults_to_the_test_split_beside_the_training_file(tmp_path):
    arithmetic = os.path.join(ROOT, "assets", "arithmetic")
    assert held_out_of(dataset=os.path.join(arithmetic, "train.jsonl")) == os.path.join(arithmetic, "test.jsonl")
    assert held_out_of(dataset=os.path.join(arithmetic, "train.jsonl"), eval_dataset="x.jsonl") == "x.jsonl"
    assert held_out_of(dataset=os.path.join(arithmetic, "train.jsonl"), eval_every=0) is None
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "the food was"}) + "\n")
    # no train/test layout: no evaluation
    assert held_out_of(dataset=str(tmp_path / "prompts.jsonl")) is None
    assert held_out_of(dataset="someone/reviews") is None


def test_eval_every_without_a_held_out_set_is_said(tmp_path):
    data = tmp_path / "prompts.jsonl"  # no test.jsonl beside it, and no --eval_dataset
    data.write_text('{"prompt": "1+1=", "answer": 2}\n')
    with pytest.warns(
        UserWarning, match="--eval_every 5: no held-out set \\(pass --eval_dataset\\); nothing is evaluated"
    ):
        held_out = load_task(make_args(grpo, dataset=str(data), eval_every=5), torch.device("cpu"))[3]
    assert held_out == ([], [])


# Every format read_rows reads, compressed or not: a training file's test file beside it is of its own format.
FORMATS = ["json", "jsonl", "csv", "tsv", "parquet", "jsonl.gz", "csv.bz2", "tsv.xz", "parquet.gz", "JSONL"]


def test_the_test_file_beside_a_training_file_of_any_format_is_the_held_out_set(tmp_path):
    for extension in FORMATS:
        folder = tmp_path / extension.replace(".", "_")
        folder.mkdir()
        train = folder / f"train.{extension}"
        train.write_text("")
        assert held_out_of(dataset=str(train)) is None  # nothing beside it
        (folder / "test.jsonl.gz").write_text("")  # of another format: not the training file's test split
        if extension != "jsonl.gz":
            assert held_out_of(dataset=str(train)) is None
        (folder / f"test.{extension}").write_text("")
        assert held_out_of(dataset=str(train)) == str(folder / f"test.{extension}")
        assert held_out_of(dataset=str(train), eval_every=0) is None
    (tmp_path / "prompts.csv").write_text("")
    (tmp_path / "test.csv").write_text("")
    assert held_out_of(dataset=str(tmp_path / "prompts.csv")) is None  # no train/test layout


def test_eval_every_warns_where_no_test_file_stands_beside_a_csv_and_evaluates_where_one_does(tmp_path):
    (tmp_path / "train.csv").write_text("prompt,answer\n1+1=,2\n")
    args = make_args(grpo, dataset=str(tmp_path / "train.csv"), eval_every=5)
    with pytest.warns(UserWarning, match="--eval_every 5: no held-out set \\(pass --eval_dataset\\)"):
        assert load_task(args, torch.device("cpu"))[3] == ([], [])
    (tmp_path / "test.csv").write_text("prompt,answer\n2+2=,4\n")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        held_out = load_task(args, torch.device("cpu"))[3]
    assert held_out[1] == [{"prompt": "2+2=", "answer": "4"}]
    assert not [w for w in warned if "held-out" in str(w.message)]
