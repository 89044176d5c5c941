"""Runs as people make them: two runs into one folder, a stop before the first optimiser step, reward code that uses
process pools, calls sys.exit, changes its inputs, hangs or returns the wrong thing, a checkpoint moved elsewhere and
linked back. Each case is
compared with what must happen: one run refused in one sentence, the same run bitwise, the same metrics as the
function called in-process."""
import gzip
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoTokenizer

import grpo
from helpers import ROOT, run_script
from test_robustness import (ENV, assert_bitwise_equal, cli, failing_reward, final_state, launch, read_rows, wait_for,
                             without_timing)


# ---------------------------------------------------------------- one run per folder

def test_a_second_run_into_a_busy_folder_is_refused_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    first = launch("grpo.py", out, cli("grpo.py", total_episodes=160))
    wait_for(lambda: os.path.exists(out / "metrics.jsonl") and os.path.getsize(out / "metrics.jsonl") > 0, first)
    first.send_signal(signal.SIGSTOP)  # still running, frozen while the second tries: the folder cannot change
    before = {name: (out / name).read_bytes() for name in os.listdir(out) if os.path.isfile(out / name)}
    second = subprocess.run([sys.executable, os.path.join(ROOT, "grpo.py"), "--output_dir", str(out),
                             *cli("grpo.py", total_episodes=160, learning_rate=1e-3)], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=240)
    holder = f"process {first.pid} on {os.uname().nodename}"
    assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert second.stderr.strip().endswith(f"--output_dir '{out}' is in use by another run ({holder}, its "
                                          f"{out}/run.lock); wait for it to end, or pass another --output_dir.")
    assert {name: (out / name).read_bytes() for name in os.listdir(out) if os.path.isfile(out / name)} == before
    first.send_signal(signal.SIGCONT)
    first.communicate(timeout=240)
    assert first.returncode == 0 and len(read_rows(out)) == 20  # the first run went on, alone


def test_a_lock_left_by_a_process_that_ended_is_taken_over_and_said(tmp_path):
    """A run killed with -9 holds no lock any more (the system let it go), and its file still names it."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.lock").write_text(f"process 4194999 on {os.uname().nodename}")
    rows, printed = run_script("grpo.py", out, *cli("grpo.py", total_episodes=16))
    assert f"process 4194999 on {os.uname().nodename} has ended; this run takes the folder over" in printed
    assert len(rows) == 2


# ---------------------------------------------------------------- exact resume from a stop before the first step

ARITHMETIC = ["--dataset", os.path.join(ROOT, "assets", "arithmetic", "train.jsonl"), "--reward_fn", "arithmetic",
              "--reward_model_path", "--eval_every", "0", "--save_every", "3"]


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "rloo.py"])
def test_a_reward_failing_in_iteration_1_resumes_bitwise(script, tmp_path):
    """The reward (a grading service standing in for the arithmetic rule) fails in iteration 1, before any optimiser
    step: checkpoint-0 is what the run leaves. Resumed with the service back, the run is the one whose reward never
    failed, to its Adam states."""
    args = [*cli(script), *ARITHMETIC]
    full, _ = run_script(script, tmp_path / "full", *args)
    out = tmp_path / "run"
    proc = launch(script, out, args, prelude=failing_reward(tmp_path, 1, rank=0))
    printed = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1 and "stopped after iteration 0; to go on:" in printed, printed[-3000:]
    command = printed.split("to go on:\n")[1].splitlines()[0].strip()
    assert command.endswith(f"--resume {out / 'checkpoint-0'}")
    result = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=ROOT, env=ENV, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch.distributed is disabled" not in result.stderr  # a plain run's checkpoint is one process's, as meant
    assert without_timing(read_rows(out)) == without_timing(full)
    assert_bitwise_equal(final_state(out), final_state(tmp_path / "full"))


# ---------------------------------------------------------------- reward code as people write it

POOLS = """
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

from grading import grade  # a module beside this file


def one(pair):
    return grade(*pair)


def in_process(responses, answers):
    return [one(pair) for pair in zip(responses, answers)]


def with_a_pool(responses, answers):
    with multiprocessing.Pool(2) as pool:
        return pool.map(one, list(zip(responses, answers)))


def with_an_executor(responses, answers):
    with ProcessPoolExecutor(2) as pool:
        return list(pool.map(one, list(zip(responses, answers))))


def takes_its_inputs(responses, answers):
    scores = in_process(responses, answers)
    responses.clear(), answers.pop()
    return scores


def exits(responses, answers):
    raise SystemExit(0)


def hangs(seconds):  # and says so, in a file named "hanging" beside this one
    open(os.path.join(os.path.dirname(__file__), "hanging"), "w").close()
    time.sleep(seconds)


calls = []
def hangs_once(responses, answers):  # its second call hangs while a file named "hang" is beside it
    calls.append(len(responses))
    if len(calls) == 2 and os.path.exists(os.path.join(os.path.dirname(__file__), "hang")):
        hangs(600)
    return in_process(responses, answers)


def hangs_in_a_pool(responses, answers):  # a grader's worker that never answers
    with ProcessPoolExecutor(2) as pool:
        return list(pool.map(hangs, [600] * len(responses)))
"""


@pytest.fixture
def reward_file(tmp_path):
    (tmp_path / "grading.py").write_text("def grade(response, answer):\n"
                                         "    return float(response.strip() == str(answer).strip())\n")
    (tmp_path / "pools.py").write_text(POOLS)
    return tmp_path / "pools.py"


def test_reward_functions_with_process_pools_train_as_in_process(reward_file, tmp_path):
    """A multiprocessing.Pool and a ProcessPoolExecutor over the file's own function (which imports a module beside
    it) give grpo.py the metrics the same function gives in-process, bitwise; no worker runs the trainer's SIGTERM
    handler (a pool ends its workers with SIGTERM); a function that empties its inputs changes nothing."""
    args = cli("grpo.py", total_episodes=24)
    runs = {}
    for name in ("in_process", "with_a_pool", "with_an_executor", "takes_its_inputs"):
        rows, printed = run_script("grpo.py", tmp_path / name, *args, "--reward_fn", f"{reward_file}:{name}")
        assert "stopping to save" not in printed, name
        runs[name] = without_timing(rows)
    assert runs["with_a_pool"] == runs["with_an_executor"] == runs["takes_its_inputs"] == runs["in_process"]
    assert len(runs["in_process"]) == 3


def test_sys_exit_in_reward_code_is_a_reward_failure(reward_file, tmp_path):
    out = tmp_path / "run"
    proc = launch("grpo.py", out, [*cli("grpo.py", total_episodes=24), "--reward_fn", f"{reward_file}:exits"])
    printed = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1, printed[-3000:]
    assert "is an error (SystemExit: 0); fix the reward" in printed and "--resume" in printed
    assert "Traceback" not in printed


def test_a_hung_reward_stops_at_its_timeout_and_the_resumed_run_is_the_one_never_stopped(reward_file, tmp_path):
    """The reward's second call hangs: past --reward_timeout it is a reward failure (checkpoint-1 and the command to
    go on). Resumed with the grader fixed, the run's metrics and final weights are those of the run that never hung,
    bitwise."""
    args = [*cli("grpo.py", total_episodes=24), "--reward_fn", f"{reward_file}:hangs_once", "--save_every", "3"]
    full, _ = run_script("grpo.py", tmp_path / "full", *args)
    (tmp_path / "hang").touch()
    out, started = tmp_path / "run", time.time()
    proc = launch("grpo.py", out, [*args, "--reward_timeout", "2"])
    printed = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1 and "Traceback" not in printed, printed[-3000:]
    assert "is an error (TimeoutError: no answer within --reward_timeout 2 s); fix the reward" in printed
    assert time.time() - started < 120  # not the 600 s of the hang
    command = printed.split("to go on:\n")[1].splitlines()[0].strip()
    assert command.endswith(f"--resume {out / 'checkpoint-1'}")
    (tmp_path / "hang").unlink()
    result = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=ROOT, env=ENV, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert without_timing(read_rows(out)) == without_timing(full)
    assert_bitwise_equal(final_state(out, 3), final_state(tmp_path / "full", 3))


def test_sigterm_stops_a_run_whose_reward_hangs_within_the_timeout(reward_file, tmp_path):
    """SIGTERM while the grader hangs, in-process or in a process pool's worker: the run saves and ends once the
    timeout rings (it cannot save sooner: the call holds the main thread), and no worker is left behind."""
    (tmp_path / "hang").touch()
    for name in ("hangs_once", "hangs_in_a_pool"):
        out = tmp_path / name
        proc = launch("grpo.py", out, [*cli("grpo.py", total_episodes=24), "--reward_fn", f"{reward_file}:{name}",
                                       "--reward_timeout", "5"])
        wait_for(lambda: (tmp_path / "hanging").exists(), proc)
        (tmp_path / "hanging").unlink()
        proc.send_signal(signal.SIGTERM)
        signalled = time.time()
        printed = proc.communicate(timeout=240)[0]
        assert time.time() - signalled < 30, name
        assert proc.returncode == 1 and "SIGTERM: stopping to save" in printed, printed[-3000:]
        assert "TimeoutError: no answer within --reward_timeout 5 s" in printed and "--resume" in printed
        # a forked worker has its parent's command line, which names this run's folder; one left behind (the run
        # gone, the worker handed to init) would still be found by it
        left = subprocess.run(["pgrep", "-f", f"--output_dir {out} "], capture_output=True, text=True).stdout
        assert left == "", name


@pytest.mark.parametrize("returned, why", [
    ("1.0", "nan: the batch's call returned a str for 3 responses"),
    ([1.0, 0.0], "nan: the batch's call returned 2 scores for 3 responses"),
    ([1.0, 0.0, 1.0, 1.0], "nan: the batch's call returned 4 scores for 3 responses"),
    (0.5, "nan: the batch's call returned a float for 3 responses"),
    ([1.0, 1e300, 0.0], "1e+300, past float32's range"),
])
def test_a_wrong_return_is_named(returned, why):
    """Before, a str had each character taken as a score, a wrong count blamed one response with "too many values
    to unpack", and 1e300 (finite in Python, inf in float32) was called "not a finite number"."""
    scores, reason = grpo.call_reward_fn(lambda responses, answers: returned, ["a", "b", "c"], [1, 2, 3], 10)
    assert reason == why
    assert not torch.tensor(scores).isfinite().all()  # the batch fails: no score is taken from it


# ---------------------------------------------------------------- a checkpoint moved away and linked back

def test_rotation_removes_a_linked_checkpoint_not_its_target(tmp_path):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_script("grpo.py", out, *cli("grpo.py", total_episodes=16, save_every=1))  # checkpoint-1 and -2
    elsewhere.mkdir()
    shutil.move(out / "checkpoint-1", elsewhere / "checkpoint-1")
    os.symlink(elsewhere / "checkpoint-1", out / "checkpoint-1")
    rows, printed = run_script("grpo.py", out, *cli("grpo.py", total_episodes=32, save_every=1), "--resume", "auto")
    assert len(rows) == 4 and sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == [
        "checkpoint-3", "checkpoint-4"]
    assert (elsewhere / "checkpoint-1" / "manifest.json").exists()  # what the link pointed to is still there


def test_a_resume_with_nothing_left_to_train_says_so(tmp_path):
    out = tmp_path / "run"
    run_script("grpo.py", out, *cli("grpo.py", total_episodes=16, save_every=1))  # two iterations
    rows, printed = run_script("grpo.py", out, *cli("grpo.py", total_episodes=8, save_every=1), "--resume", "auto")
    assert ("--total_episodes 8 ends at iteration 1; the checkpoint is at 2, so no step is taken: its policy is "
            "saved as it is (raise it to go on)") in printed
    assert len(rows) == 2


def test_a_resume_may_raise_the_reward_timeout_and_change_the_micro_batch(tmp_path):
    """A run stopped by a hung reward is resumed with a longer --reward_timeout; a checkpoint saved under torchrun,
    which lowers --micro_batch_size to the per-process minibatch, is resumed on one process with the command that
    made it: neither counts as a changed argument (the micro-batch changes the order of the float sums alone)."""
    out = tmp_path / "run"
    run_script("grpo.py", out, *cli("grpo.py", total_episodes=16, save_every=1, micro_batch_size=4,
                                    reward_timeout=30))
    assert grpo.read_json(out / "checkpoint-2" / "args.json")["micro_batch_size"] == 4
    rows, printed = run_script("grpo.py", out, *cli("grpo.py", total_episodes=24, save_every=1, reward_timeout=60),
                               "--resume", "auto")
    assert [r["iteration"] for r in rows] == [1, 2, 3] and "other values of" not in printed


# ---------------------------------------------------------------- data as people have it

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
    args = grpo.Args(eval_every=0)
    prompts, expected = grpo.load_prompts(str(jsonl), "train", args, tokenizer)
    for name in ("train.csv", "train.parquet", "train.jsonl.gz", "TRAIN.JSONL"):
        got, got_rows = grpo.load_prompts(str(tmp_path / name), "train", args, tokenizer)
        assert got == prompts, name
        assert [(r["prompt"], str(r["answer"])) for r in got_rows] == [(r["prompt"], r["answer"]) for r in expected]
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(SystemExit, match="dataset file '.*folder.jsonl' is a folder; pass a file of"):
        grpo.load_prompts(str(tmp_path / "folder.jsonl"), "train", args, tokenizer)
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(SystemExit, match="dataset file '.*bad.parquet' could not be loaded .*; check its contents"):
        grpo.load_prompts(str(tmp_path / "bad.parquet"), "train", args, tokenizer)


def test_a_null_answer_for_a_built_in_rule_is_refused(tmp_path):
    """"answer": null would be scored against the text 'None'; the row is named before any model loads."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": null}\n')
    args = grpo.Args(dataset=str(data), output_dir=str(tmp_path / "run"), eval_every=0)
    grpo.validate(args)
    with pytest.raises(SystemExit, match="--reward_fn arithmetic needs an answer column, but row 2 of .* has no "
                                         "\\(or a null\\) 'answer'"):
        grpo.load_task(args, torch.device("cpu"))
    assert not (tmp_path / "run").exists()
