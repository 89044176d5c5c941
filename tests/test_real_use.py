"""Runs as people make them: two runs into one folder, a stop before the first optimiser step, reward code that uses
process pools, calls sys.exit, changes its inputs, hangs or returns the wrong thing, a checkpoint moved elsewhere and
linked back. Each case is
compared with what must happen: one run refused in one sentence, the same run bitwise, the same metrics as the
function called in-process."""

import errno
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
import test_robustness
import torch
from helpers import ROOT, TORCHRUN, run_script, set_up, torchrun
from test_reward_code import alive
from test_robustness import (  # noqa: F401 (small_held_out_set: its autouse fixture, which sets the tiny runs' data)
    ENV,
    TINY,
    assert_bitwise_equal,
    cli,
    failing_reward,
    final_state,
    finished,
    launch,
    read_rows,
    run_as_found,
    script_command,
    small_held_out_set,
    tiny_args,
    wait_for,
    without_timing,
)
from transformers import AutoTokenizer

import grpo
import ppo

# test_robustness's fixture of the tiny runs, never stopped, for the tests here that take it (a fixture is found by
# its name in the test's module)
uninterrupted = test_robustness.uninterrupted

# ---------------------------------------------------------------- one run per folder


def test_a_second_run_into_a_busy_folder_is_refused_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    first = launch("grpo.py", out, cli("grpo.py", total_episodes=160))
    wait_for(lambda: os.path.exists(out / "metrics.jsonl") and os.path.getsize(out / "metrics.jsonl") > 0, first)
    first.send_signal(signal.SIGSTOP)  # still running, frozen while the second tries: the folder cannot change
    before = {name: (out / name).read_bytes() for name in os.listdir(out) if os.path.isfile(out / name)}
    second = finished(script_command("grpo.py", out, cli("grpo.py", total_episodes=160, learning_rate=1e-3)))
    holder = f"process {first.pid} on {os.uname().nodename}"
    assert second.returncode == 1, second.stderr[-3000:]
    assert "Traceback" not in second.stderr, second.stderr[-3000:]
    assert second.stderr.strip().endswith(
        f"--output_dir '{out}' is in use by another run ({holder}, its "
        f"{out}/run.lock); wait for it to end, or pass another --output_dir."
    )
    assert {name: (out / name).read_bytes() for name in os.listdir(out) if os.path.isfile(out / name)} == before
    first.send_signal(signal.SIGCONT)
    first.communicate(timeout=240)
    # the first run went on, alone
    assert first.returncode == 0
    assert len(read_rows(out)) == 20


def test_a_lock_left_by_a_process_that_ended_is_taken_over_and_said(tmp_path):
    """A run killed with -9 holds no lock any more (the system let it go), and its file still names it."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.lock").write_text(f"process 4194999 on {os.uname().nodename}")
    rows, printed = run_script("grpo.py", out, *cli("grpo.py", total_episodes=16))
    assert f"process 4194999 on {os.uname().nodename} has ended; this run takes the folder over" in printed
    assert len(rows) == 2


# ---------------------------------------------------------------- exact resume from a stop before the first step

ARITHMETIC_TRAIN = f"--dataset={os.path.join(ROOT, 'assets', 'arithmetic', 'train.jsonl')}"
ARITHMETIC = [ARITHMETIC_TRAIN, "--reward_fn", "arithmetic", "--reward_model_path", "--eval_every=0", "--save_every=3"]


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
    assert proc.returncode == 1, printed[-3000:]
    assert "stopped after iteration 0; to go on:" in printed, printed[-3000:]
    printed = resume_as_printed(printed, out / "checkpoint-0")
    assert "torch.distributed is disabled" not in printed  # a plain run's checkpoint is one process's, as meant
    assert without_timing(read_rows(out)) == without_timing(full)
    assert_bitwise_equal(final_state(out), final_state(tmp_path / "full"))


def resume_as_printed(printed, checkpoint):
    """The command a stopped run printed, which must resume the given checkpoint, run as printed."""
    command = printed.split("to go on:\n")[1].splitlines()[0].strip()
    assert command.endswith(f"--resume {checkpoint}"), command
    result = finished([sys.executable, *shlex.split(command)[1:]])
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.mark.parametrize("script,which", [("ppo.py", "first"), ("grpo.py", "last")])
def test_a_reward_failing_in_an_evaluation_stops_the_run_and_the_resume_goes_on(script, which, tmp_path):
    """The grading service goes away during the evaluation of the starting policy (its first call), or during the
    last one (after 2 calls for iteration 0's two passes and 6 iterations): the run stops with the checkpoint of the
    policy the evaluation was of, and the resumed run goes on from it without that evaluation (not redone). Its log is
    the log of the run whose reward never failed without that evaluation's scores, and its final weights and Adam
    states are that run's."""
    held_out = tmp_path / "test.jsonl"  # 8 prompts: one call of the rule per pass (sampled, greedy)
    held_out.write_text("".join(open(os.path.join(ROOT, "assets", "arithmetic", "test.jsonl")).readlines()[:8]))
    evaluation = ["--eval_every=100", "--save_every=100", f"--eval_dataset={held_out}", "--eval_batch_size=8"]
    args = [*cli(script), *ARITHMETIC, *evaluation]
    full, _ = run_script(script, tmp_path / "full", *args)
    assert [r["iteration"] for r in full if "eval/score" in r] == [0, 6]
    out = tmp_path / "run"
    from_batch, iteration = {"first": (1, 0), "last": (9, 6)}[which]
    proc = launch(script, out, args, prelude=failing_reward(tmp_path, from_batch, rank=0))
    printed = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1, printed[-3000:]
    assert f"stopped after iteration {iteration}; to go on:" in printed, printed[-3000:]
    printed = resume_as_printed(printed, out / f"checkpoint-{iteration}")
    assert "held-out score" not in printed  # iteration 0's own row is not printed again
    expected = []
    for row in without_timing(full):
        if row["iteration"] == iteration:
            row = {k: v for k, v in row.items() if not k.startswith("eval/")}
        if set(row) != {"iteration", "episodes"}:  # the starting policy's row held its scores alone
            expected.append(row)
    assert without_timing(read_rows(out)) == expected
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
    responses.clear()
    answers.pop()
    return scores


def exits(responses, answers):
    raise SystemExit(0)


def hangs(seconds):  # and says so, with its process id, in a file named "hanging" beside this one
    with open(os.path.join(os.path.dirname(__file__), "hanging"), "a") as said:
        said.write(f"{os.getpid()}\\n")
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
    (tmp_path / "grading.py").write_text(
        "def grade(response, answer):\n    return float(response.strip() == str(answer).strip())\n"
    )
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
    assert "is an error (SystemExit: 0); fix the reward" in printed
    assert "--resume" in printed
    assert "Traceback" not in printed


def test_a_hung_reward_stops_at_its_timeout_and_the_resumed_run_is_the_one_never_stopped(reward_file, tmp_path):
    """The reward's second call hangs: past --reward_timeout it is a reward failure (checkpoint-1 and the command to
    go on). Resumed with the grader fixed, the run's metrics and final weights are those of the run that never hung,
    bitwise."""
    args = [*cli("grpo.py", total_episodes=24), "--reward_fn", f"{reward_file}:hangs_once", "--save_every=3"]
    full, _ = run_script("grpo.py", tmp_path / "full", *args)
    (tmp_path / "hang").touch()
    out = tmp_path / "run"
    started = time.time()
    proc = launch("grpo.py", out, [*args, "--reward_timeout=2"])
    printed = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1, printed[-3000:]
    assert "Traceback" not in printed, printed[-3000:]
    assert "is an error (TimeoutError: no answer within --reward_timeout 2 s); fix the reward" in printed
    assert time.time() - started < 120  # not the 600 s of the hang
    command = printed.split("to go on:\n")[1].splitlines()[0].strip()
    assert command.endswith(f"--resume {out / 'checkpoint-1'}")
    (tmp_path / "hang").unlink()
    result = finished([sys.executable, *shlex.split(command)[1:]])
    assert result.returncode == 0, result.stderr[-3000:]
    assert without_timing(read_rows(out)) == without_timing(full)
    assert_bitwise_equal(final_state(out, 3), final_state(tmp_path / "full", 3))


def test_sigterm_stops_a_run_whose_reward_hangs_within_seconds_whatever_the_timeout(reward_file, tmp_path):
    """SIGTERM while the grader hangs, in its process or in a process pool's worker, under the default 600 s
    --reward_timeout: the run leaves the call within a second, saves the state before the rollout and ends with the
    command that goes on (before: only once the timeout rang); no process of the grader is left behind."""
    (tmp_path / "hang").touch()
    for name, iteration in (("hangs_once", 1), ("hangs_in_a_pool", 0)):  # its second call hangs; its first
        out = tmp_path / name
        proc = launch("grpo.py", out, [*cli("grpo.py", total_episodes=24), "--reward_fn", f"{reward_file}:{name}"])
        wait_for(lambda: (tmp_path / "hanging").exists() and (tmp_path / "hanging").read_text().endswith("\n"), proc)
        hung = [int(pid) for pid in (tmp_path / "hanging").read_text().split()]
        (tmp_path / "hanging").unlink()
        proc.send_signal(signal.SIGTERM)
        signalled = time.time()
        printed = proc.communicate(timeout=240)[0]
        assert time.time() - signalled < 15, name
        assert proc.returncode == 128 + signal.SIGTERM, printed[-3000:]
        assert "SIGTERM: stopping to save" in printed, printed[-3000:]
        assert f"stopped after iteration {iteration}; to go on:" in printed
        assert "Traceback" not in printed, printed[-3000:]
        assert not any(alive(pid) for pid in hung), name  # killed with the grader's process, not handed to init


@pytest.mark.parametrize(
    "returned, why",
    [
        ("1.0", "nan: the batch's call returned a str for 3 responses"),
        ([1.0, 0.0], "nan: the batch's call returned 2 scores for 3 responses"),
        ([1.0, 0.0, 1.0, 1.0], "nan: the batch's call returned 4 scores for 3 responses"),
        (0.5, "nan: the batch's call returned a float for 3 responses"),
        ([1.0, 1e300, 0.0], "1e+300, past float32's range"),
    ],
)
def test_a_wrong_return_is_named(returned, why):
    """Before, a str had each character taken as a score, a wrong count blamed one response with "too many values
    to unpack", and 1e300 (finite in Python, inf in float32) was called "not a finite number"."""
    scores, reason = grpo.call_reward_fn(lambda responses, answers: returned, ["a", "b", "c"], [1, 2, 3], 10)
    assert reason == why
    assert not torch.tensor(scores).isfinite().all()  # the batch fails: no score is taken from it


# ---------------------------------------------------------------- a checkpoint moved away and linked back


def test_rotation_removes_a_linked_checkpoint_not_its_target(tmp_path):
    out = tmp_path / "run"
    elsewhere = tmp_path / "elsewhere"
    run_script("grpo.py", out, *cli("grpo.py", total_episodes=16, save_every=1))  # checkpoint-1 and -2
    elsewhere.mkdir()
    shutil.move(out / "checkpoint-1", elsewhere / "checkpoint-1")
    os.symlink(elsewhere / "checkpoint-1", out / "checkpoint-1")
    rows, printed = run_script("grpo.py", out, *cli("grpo.py", total_episodes=32, save_every=1), "--resume=auto")
    assert len(rows) == 4
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == [
        "checkpoint-3",
        "checkpoint-4",
    ]
    assert (elsewhere / "checkpoint-1" / "manifest.json").exists()  # what the link pointed to is still there


def test_a_resume_with_nothing_left_to_train_says_so(tmp_path):
    out = tmp_path / "run"
    run_script("grpo.py", out, *cli("grpo.py", total_episodes=16, save_every=1))  # two iterations
    rows, printed = run_script("grpo.py", out, *cli("grpo.py", total_episodes=8, save_every=1), "--resume=auto")
    assert ("--total_episodes 8 ends at iteration 1: no step is taken") in printed
    assert len(rows) == 2


def test_a_resume_may_raise_the_reward_timeout_and_change_the_micro_batch(tmp_path):
    """A run stopped by a hung reward is resumed with a longer --reward_timeout; a checkpoint saved
    with another --micro_batch_size is resumed with the default: neither counts as a changed argument (the
    micro-batch changes the order of the float sums alone)."""
    out = tmp_path / "run"
    run_script("grpo.py", out, *cli("grpo.py", total_episodes=16, save_every=1, micro_batch_size=4, reward_timeout=30))
    assert grpo.read_json(out / "checkpoint-2" / "args.json")["micro_batch_size"] == 4
    rows, printed = run_script(
        "grpo.py", out, *cli("grpo.py", total_episodes=24, save_every=1, reward_timeout=60), "--resume=auto"
    )
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert "other values of" not in printed


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
    """ "answer": null would be scored against the text 'None'; the row is named before any model loads."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": null}\n')
    args = grpo.Args(dataset=str(data), output_dir=str(tmp_path / "run"), eval_every=0)
    grpo.validate(args)
    with pytest.raises(
        SystemExit,
        match="--reward_fn arithmetic needs an answer column, but row 2 of .* has no \\(or a null\\) 'answer'",
    ):
        grpo.load_task(args, torch.device("cpu"))
    assert not (tmp_path / "run").exists()


def test_a_reward_that_hangs_on_each_response_is_not_retried_past_the_first_timeout(tmp_path):
    """The batch's call raises, and each response alone then hangs: the first single call that times out ends the
    retries (before, each of the B responses waited its own timeout), and every score is a failure."""
    rule = tmp_path / "rule.py"
    rule.write_text(
        "import time\n"
        "def grader(responses, answers):\n"
        f"    print(len(responses), file=open({str(tmp_path / 'calls')!r}, 'a'), flush=True)\n"
        "    if len(responses) > 1:\n"
        "        raise ValueError('batch unsupported')\n"
        "    time.sleep(30)\n"
    )
    reward_fn = grpo.load_reward_fn(f"{rule}:grader", 10)
    scores, why = grpo.call_reward_fn(reward_fn, ["a", "b", "c"], [1, 2, 3], timeout=0.5)
    assert (tmp_path / "calls").read_text().split() == ["3", "1"]
    assert all(s != s for s in scores)
    assert len(scores) == 3
    assert why == "an error (TimeoutError: no answer within --reward_timeout 0.5 s)"


# ---------------------------------------------------------------- every input checked before loading


def test_a_checkpoint_whose_name_disagrees_with_its_state_is_not_resumed(tmp_path, uninterrupted, capsys):
    """checkpoint-3 copied to checkpoint-7 (the iteration in its name, and the log would go 1-3 then 8): --resume auto
    passes over it to checkpoint-6, and naming it is refused with the reason."""
    out = run_as_found(tmp_path, uninterrupted)
    shutil.copytree(out / "checkpoint-3", out / "checkpoint-7")
    set_up(ppo, tiny_args("ppo.py", out, resume="auto"))
    assert f"--resume auto: resuming from {out / 'checkpoint-6'}\n" in capsys.readouterr().out
    with pytest.raises(
        SystemExit,
        match=r"checkpoint-7' is not a whole checkpoint: its name says iteration 7, its state.json 3; resume from .*-6",
    ):
        set_up(ppo, tiny_args("ppo.py", out, resume=str(out / "checkpoint-7")))


def test_lengths_past_the_policys_positions_and_lora_targets_it_lacks_are_refused_before_loading(tmp_path):
    """The embedded policy has 128 positions and Llama's module names."""
    out = str(tmp_path / "run")
    with pytest.raises(
        SystemExit,
        match=r"^--response_length plus --max_prompt_length must fit the policy's 128 "
        r"positions \(got 65\)\.$",
    ):
        grpo.validate(grpo.Args(output_dir=out, max_prompt_length=64, response_length=65))
    grpo.validate(grpo.Args(output_dir=out, max_prompt_length=64, response_length=64))  # 128 fit
    with pytest.raises(
        SystemExit,
        match=r"^--lora_target_modules must each end the name of a module of the policy, "
        r"or be all-linear \(got \('q_proj', 'qkv'\)\)\.$",
    ):
        grpo.validate(grpo.Args(output_dir=out, lora_r=4, lora_target_modules=("q_proj", "qkv")))
    grpo.validate(grpo.Args(output_dir=out, lora_r=4, lora_target_modules=("q_proj", "mlp.down_proj")))
    assert not os.path.exists(out)


def test_a_lone_surrogate_and_a_broken_chat_template_are_named(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"), padding_side="left")
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "\\ud83d+1=", "answer": 2}\n')  # JSON's half an emoji
    with pytest.raises(SystemExit, match=r"row 2 of .* holds a lone surrogate \(half of a UTF-16 pair\); fix its text"):
        grpo.load_prompts(str(data), "train", grpo.Args(), tokenizer)
    for template, error in (
        ("{{ raise_exception('no system role') }}", "no system role"),
        ("{% for m in messages %}<|{{ m['role'] }}|>{% endfor %}", "substring not found"),
    ):
        tokenizer.chat_template = template  # one that raises; one that leaves the assistant's answer out
        with pytest.raises(
            SystemExit,
            match=rf"the chat template of 'here' fails on a user turn and its answer "
            rf"\(.*{error}.*\); fix it",
        ):
            grpo.stop_token_ids(tokenizer, "here")


def test_a_template_that_raises_is_named_before_the_chat_prompts_are_rendered(tmp_path):
    """load_task tries the template before it renders any prompt with it."""
    policy = tmp_path / "policy"
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-sft"), policy)
    config = json.loads((policy / "tokenizer_config.json").read_text())
    (policy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ raise_exception('x') }}"}))
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": 2}) + "\n")
    args = grpo.Args(model_name_or_path=str(policy), dataset=str(data), eval_every=0, output_dir=str(tmp_path / "run"))
    with pytest.raises(SystemExit, match="the chat template of .* fails on a user turn and its answer"):
        grpo.load_task(args, torch.device("cpu"))


def test_reward_model_tokenizers_without_a_pad_or_with_ids_past_the_embeddings_are_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    policy = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"), padding_side="left")
    for name, specials, vocab in (("no-pad", {}, 784), ("too-many", {"pad_token": "<p>"}, 2)):
        rm = tmp_path / name
        shutil.copytree(os.path.join(ROOT, "assets", "tiny-rm"), rm)
        for f in rm.glob("*token*"):
            f.unlink()
        words = {w: i for i, w in enumerate(["<p>", *(f"w{i}" for i in range(9))])}
        PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words)), **specials).save_pretrained(rm)
        config = json.loads((rm / "config.json").read_text())
        (rm / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
        args = grpo.Args(reward_model_path=(str(rm),))
        with pytest.raises(
            SystemExit,
            match=rf"the tokenizer beside --reward_model_path '{rm}' has no pad, EOS or unk "
            rf"token, or ids past the model's {vocab} embeddings \(its largest is 9\); save the one",
        ):
            grpo.load_reward_models(args, policy, torch.device("cpu"))


def test_a_resume_onto_a_policy_of_another_size_is_refused_in_one_sentence(tmp_path):
    """The policy's folder, after the run, holds a model of another width: the checkpoint cannot be loaded into it,
    and the resume says so instead of DCP's traceback."""
    from transformers import AutoConfig, AutoModelForCausalLM

    policy = tmp_path / "policy"
    out = tmp_path / "run"
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-sft"), policy)
    run_script("grpo.py", out, *cli("grpo.py", total_episodes=8), f"--model_name_or_path={policy}")
    config = AutoConfig.from_pretrained(policy)
    config.hidden_size = 2 * config.hidden_size
    config.intermediate_size = 2 * config.intermediate_size
    AutoModelForCausalLM.from_config(config).save_pretrained(policy)
    args = grpo.Args(
        **{**TINY["grpo.py"], "total_episodes": 16}, model_name_or_path=str(policy), output_dir=str(out), resume="auto"
    )
    with pytest.raises(
        SystemExit,
        match=rf"^--resume auto: no checkpoint in '{out}' could be loaded \(the last: ValueError: Size mismatch "
        r".*\); if the models changed size, resume with those it was trained from, or start afresh in another "
        r"--output_dir\.$",
    ):
        grpo.main(args)


def test_a_reward_file_that_fails_on_one_process_stops_both_and_says_why_once(tmp_path):
    rule = tmp_path / "rule.py"
    rule.write_text(
        "import os\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise RuntimeError('no grader on this node')\n"
        "def score(responses, answers):\n"
        "    return [0.0] * len(responses)\n"
    )
    result = torchrun(
        "grpo.py", tmp_path / "run", *cli("grpo.py"), "--reward_fn", f"{rule}:score", "--reward_model_path"
    )
    assert result.returncode != 0
    said = f"--reward_fn {rule}:score: '{rule}' could not be loaded (RuntimeError: no grader on this node)"
    assert result.stderr.count(said) == 1, result.stderr[-3000:]
    assert "Connection closed by peer" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_eval_every_without_a_held_out_set_is_said(tmp_path):
    data = tmp_path / "prompts.jsonl"  # no test.jsonl beside it, and no --eval_dataset
    data.write_text('{"prompt": "1+1=", "answer": 2}\n')
    with pytest.warns(
        UserWarning, match="--eval_every 5: no held-out set \\(pass --eval_dataset\\); nothing is evaluated"
    ):
        held_out = grpo.load_task(grpo.Args(dataset=str(data), eval_every=5), torch.device("cpu"))[3]
    assert held_out == ([], [])


def test_a_file_system_without_locks_is_said_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    def no_locks(fd, cmd, length):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(os, "lockf", no_locks)
    lock = grpo.take_lock(str(tmp_path))
    assert (
        "this file system cannot lock (No locks available): a second run here would not be refused"
        in capsys.readouterr().out
    )
    assert (tmp_path / "run.lock").read_text() == f"process {os.getpid()} on {os.uname().nodename}"
    lock.close()


def hangs_on_rank_1(tmp_path):
    """The options of grpo.py's tiny run on the arithmetic prompts, scored by a reward file whose rule (the arithmetic
    one) hangs on rank 1 at its second call, after leaving a file named "hanging" in tmp_path."""
    rule = tmp_path / "rule.py"
    rule.write_text(
        "import os\n"
        "import time\n"
        "calls = []\n"
        "def score(responses, answers):\n"
        "    calls.append(1)\n"
        "    if os.environ['RANK'] == '1' and len(calls) == 2:\n"
        f"        open({str(tmp_path / 'hanging')!r}, 'w').close()\n"
        "        time.sleep(600)\n"
        "    return [float(r.strip() == str(a).strip()) for r, a in zip(responses, answers)]\n"
    )
    return [
        *cli("grpo.py"),
        ARITHMETIC_TRAIN,
        "--reward_fn",
        f"{rule}:score",
        "--reward_model_path",
        "--eval_every=0",
    ]


def test_a_reward_hung_on_one_process_stops_both_at_its_timeout(tmp_path):
    """Under torchrun the grader hangs on rank 1 only, at its second call: rank 1's alarm makes it a reward failure,
    and the stop reaches rank 0 too. Both save checkpoint-1 (the state before the hung rollout), and rank 0 names the
    timeout and prints the torchrun command that goes on."""
    hangs = hangs_on_rank_1(tmp_path)
    out = tmp_path / "run"
    start = time.time()
    result = torchrun("grpo.py", out, *hangs, "--reward_timeout=3")
    assert result.returncode != 0
    assert time.time() - start < 300
    assert "is an error (TimeoutError: no answer within --reward_timeout 3 s)" in result.stderr, result.stderr[-3000:]
    assert "stopped after iteration 1; to go on:\n  torchrun --nproc_per_node=2 " in result.stdout
    assert os.listdir(out / "checkpoint-1")
    assert not grpo.checkpoint_problem(str(out / "checkpoint-1"))


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "rloo.py"])
def test_the_seed_help_says_what_the_code_does(script):
    """Every process seeds its generators with --seed itself (torch.manual_seed(args.seed) in main, the sampling
    generators from seed and iteration alone): the help must not say a rank is added."""
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), "--help"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = " ".join(result.stdout.split())
    seed_help = text[text.index("--seed") :][:200]
    assert "the same on every process" in seed_help
    assert "rank" not in seed_help
    assert "torch.manual_seed(args.seed)" in open(os.path.join(ROOT, script)).read()


def test_sigterm_to_torchrun_stops_every_process_of_a_run_whose_reward_hangs(tmp_path):
    """SIGTERM to torchrun while rank 1's grader hangs: torchrun passes it to both processes, rank 1 leaves the hung
    call when its alarm rings (within --reward_timeout), and the stop reaches rank 0: both save checkpoint-1, well
    before torchrun's own 30 s grace would kill them."""
    hangs = hangs_on_rank_1(tmp_path)
    out = tmp_path / "run"
    proc = launch("grpo.py", out, [*hangs, "--reward_timeout=5"], runner=TORCHRUN)
    wait_for(lambda: os.path.exists(tmp_path / "hanging"), proc)
    start = time.time()
    proc.send_signal(signal.SIGTERM)
    printed = proc.communicate(timeout=120)[0]
    assert time.time() - start < 25, printed[-3000:]
    assert "SIGTERM: stopping to save a checkpoint" in printed
    assert "stopped after iteration 1" in printed
    assert not grpo.checkpoint_problem(str(out / "checkpoint-1"))
