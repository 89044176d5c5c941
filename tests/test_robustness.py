"""Never losing a run, in all three scripts: a run stopped by SIGTERM and resumed writes the same log and the same
weights as one never stopped; a kill during a save leaves the previous checkpoint; non-finite steps are skipped;
a failing reward function is named; the same seed gives the same run; nothing opens a socket; bad input stops
with one sentence before any model loads.

Why a resumed run is bitwise the same run on a CPU: everything random is drawn from generators seeded afresh from
the seed (each iteration's samples and minibatches from (seed, iteration), the data order from seed + data epoch,
evaluation from the seed), so there is no generator state to save; the models and Adam states are saved exactly
(torch.distributed.checkpoint); and CPU kernels are deterministic for a fixed thread count."""

import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import tyro
from helpers import ROOT, TINY_SIZES, TORCHRUN, options, run_script, set_up
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoTokenizer

import grpo
import ppo
import rloo

MODULES = {"ppo.py": ppo, "grpo.py": grpo, "rloo.py": rloo}
# Six iterations each, in seconds on two cores: grpo.py and rloo.py at the tiny run's sizes (helpers.TINY_SIZES),
# ppo.py in two epochs of two minibatches, evaluating on a small held-out set (its own generator must not disturb the
# run's).
TINY = {
    "ppo.py": dict(
        total_episodes=48,
        rollout_batch_size=8,
        minibatch_size=4,
        micro_batch_size=4,
        num_epochs=2,
        response_length=8,
        eval_every=3,
    ),
    "grpo.py": dict(TINY_SIZES["grpo.py"], total_episodes=48, response_length=8, eval_every=0),
    "rloo.py": dict(TINY_SIZES["rloo.py"], total_episodes=48, response_length=8, eval_every=0),
    "dapo.py": dict(TINY_SIZES["dapo.py"], total_episodes=48, response_length=8, eval_every=0),
}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
# the files of a checkpoint saved by two processes, each writing its own shard
TWO_PROCESS_CHECKPOINT = [
    ".metadata",
    "__0_0.distcp",
    "__1_0.distcp",
    "args.json",
    "manifest.json",
    "metrics.jsonl",
    "state.json",
]


def cli(script, **extra):
    return options(**{**TINY[script], **extra})


def without_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def read_rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def checkpointed(checkpoint):
    """A checkpoint's trained models and optimiser states, {name: {"model": ..., "optimizer": ...}}, read into one
    process."""
    flat = str(checkpoint) + ".pt"
    dcp_to_torch_save(checkpoint, flat)
    return torch.load(flat)


def final_state(out, iteration=6):
    """The saved policy and the last checkpoint's models and optimiser states."""
    return load_file(os.path.join(out, "model.safetensors")), checkpointed(os.path.join(out, f"checkpoint-{iteration}"))


def assert_bitwise_equal(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_bitwise_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_bitwise_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def script_command(script, out, args, head=(sys.executable,)):
    """head (python, or torchrun, then any prelude file), the script, --output_dir out and args."""
    return [*head, os.path.join(ROOT, script), "--output_dir", str(out), *args]


def launch(script, out, args, prelude=None, runner=(sys.executable,)):
    """The script in a subprocess under runner (python, or torchrun), optionally under a prelude file that patches
    something first."""
    head = [*runner, prelude] if prelude else runner
    cmd = script_command(script, out, args, head)
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(cmd, env=ENV, timeout=240, **kw):
    """cmd run to its end from the repository root, its output captured as text."""
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def wait_for(condition, proc, timeout=240):
    start = time.time()
    while not condition():
        assert proc.poll() is None, f"the run ended before it could be stopped:\n{proc.stdout.read()[-3000:]}"
        assert time.time() - start < timeout
        time.sleep(0.05)


@pytest.fixture(scope="module", autouse=True)
def small_held_out_set(tmp_path_factory):
    path = tmp_path_factory.mktemp("held_out") / "test.jsonl"
    path.write_text("".join(open(os.path.join(ROOT, "assets", "reviews", "test.jsonl")).readlines()[:16]))
    TINY["ppo.py"]["eval_dataset"] = str(path)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each script's tiny run, never stopped (computed once per script)."""
    runs = {}

    def get(script):
        if script not in runs:
            out = tmp_path_factory.mktemp(script.replace(".", "_"))
            rows, _ = run_script(script, out, *cli(script, save_every=3))
            runs[script] = (out, without_timing(rows), final_state(out))
        return runs[script]

    return get


@pytest.mark.parametrize(
    "script,stop", [("ppo.py", signal.SIGTERM), ("grpo.py", signal.SIGINT), ("rloo.py", signal.SIGTERM)]
)
def test_a_stopped_and_resumed_run_is_the_same_run(script, stop, tmp_path, uninterrupted):
    """SIGTERM (a cluster's pre-emption) or Ctrl-C (SIGINT), then the command the run printed."""
    _, full_rows, full_state = uninterrupted(script)
    out = tmp_path / "run"
    proc = launch(script, out, cli(script, save_every=3))
    first_rows = 2 if TINY[script]["eval_every"] else 1  # the held-out row 0, then iteration 1
    wait_for(
        lambda: os.path.exists(out / "metrics.jsonl") and len(open(out / "metrics.jsonl").readlines()) >= first_rows,
        proc,
    )
    # Frozen while signalled, so that it cannot finish first: it stops inside iteration 2 (or 3), either before
    # its update (the rollout is dropped and iteration 1's state saved) or after it.
    for s in (signal.SIGSTOP, stop, signal.SIGCONT):
        proc.send_signal(s)
    printed = proc.communicate(timeout=240)[0]
    assert proc.returncode == 128 + stop, printed[-3000:]
    command = printed.split("to go on:\n")[1].splitlines()[0].strip()
    assert not os.path.exists(out / "model.safetensors")  # it did not run to the end
    # The very command it printed resumes the run.
    argv = shlex.split(command)
    assert argv[0] == "python"
    assert "--resume" in argv
    result = finished([sys.executable, *argv[1:]])
    assert result.returncode == 0, result.stderr[-3000:]
    assert without_timing(read_rows(out)) == full_rows
    assert_bitwise_equal(final_state(out), full_state)


def test_a_stopped_and_resumed_torchrun_run_is_the_same_run(tmp_path):
    """Two processes (gloo, FSDP2): each writes its own shards of the models and optimiser states; torchrun passes
    SIGTERM on to both, and the command they print resumes the run."""
    args = cli("rloo.py", save_every=3, micro_batch_size=4)  # 4 responses per process
    full = finished(script_command("rloo.py", tmp_path / "full", args, TORCHRUN), timeout=300)
    assert full.returncode == 0, full.stderr[-3000:]
    out = tmp_path / "run"
    proc = launch("rloo.py", out, args, runner=TORCHRUN)
    wait_for(lambda: os.path.exists(out / "metrics.jsonl") and len(open(out / "metrics.jsonl").readlines()) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    printed = proc.communicate(timeout=240)[0]
    assert proc.returncode != 0, printed[-3000:]
    assert not os.path.exists(out / "model.safetensors"), printed[-3000:]
    argv = shlex.split(printed.split("to go on:\n")[1].splitlines()[0])
    assert argv[:2] == ["torchrun", "--nproc_per_node=2"]
    checkpoint = argv[argv.index("--resume") + 1]
    assert sorted(os.listdir(checkpoint)) == TWO_PROCESS_CHECKPOINT
    result = finished([*TORCHRUN, *argv[2:]], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert without_timing(read_rows(out)) == without_timing(read_rows(tmp_path / "full"))
    assert_bitwise_equal(final_state(out), final_state(tmp_path / "full"))


def test_a_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path, uninterrupted):
    _, full_rows, full_state = uninterrupted("ppo.py")
    out = tmp_path / "run"
    flag = tmp_path / "saving"
    prelude = tmp_path / "slow_save.py"
    prelude.write_text(f"""import runpy
import sys
import time

import torch.distributed.checkpoint as dcp

save = dcp.save
def slow_save(state_dict, checkpoint_id):  # the save of checkpoint-2 hangs before its rename, long enough to be killed
    save(state_dict, checkpoint_id=checkpoint_id)
    if "checkpoint-2.tmp" in str(checkpoint_id):
        open({str(flag)!r}, "w").close()
        time.sleep(120)
dcp.save = slow_save
sys.argv = sys.argv[1:]
sys.path.insert(0, {ROOT!r})
runpy.run_path(sys.argv[0], run_name="__main__")
""")
    proc = launch("ppo.py", out, cli("ppo.py", save_every=1), prelude=str(prelude))
    wait_for(flag.exists, proc)
    proc.send_signal(signal.SIGTERM)  # the first asks for a save after this one...
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # ...the second ends the run at once, mid-save
    printed = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGTERM, printed[-3000:]
    assert sorted(os.listdir(out / "checkpoint-1")) == [
        ".metadata",
        "__0_0.distcp",
        "args.json",
        "manifest.json",
        "metrics.jsonl",
        "state.json",
    ]
    assert (out / "checkpoint-2.tmp").exists()
    assert not (out / "checkpoint-2").exists()
    rows, printed = run_script("ppo.py", out, *cli("ppo.py", save_every=3), "--resume=auto")
    assert f"resuming from {out / 'checkpoint-1'}" in printed
    assert not (out / "checkpoint-2.tmp").exists()  # the first save that succeeds clears what the kill left
    assert without_timing(rows) == full_rows
    assert_bitwise_equal(final_state(out), full_state)


def test_the_same_seed_gives_the_same_run(tmp_path, uninterrupted):
    _, full_rows, full_state = uninterrupted("rloo.py")
    rows, _ = run_script("rloo.py", tmp_path / "again", *cli("rloo.py", save_every=3))
    assert without_timing(rows) == full_rows
    assert_bitwise_equal(final_state(tmp_path / "again"), full_state)
    rows, _ = run_script("rloo.py", tmp_path / "other", *cli("rloo.py", save_every=3, seed=2))
    assert without_timing(rows) != full_rows  # the comparison can fail


# ---------------------------------------------------------------- in-process runs, with one function patched


@pytest.fixture
def keep_signal_handlers():
    """main() installs its own SIGTERM and Ctrl-C handlers; give pytest its own back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def args_for(script, out, **kw):
    paths = dict(model_name_or_path=os.path.join(ROOT, "assets", "tiny-sft"))
    if script != "grpo.py":  # grpo's default is the arithmetic rule; the others use the reward model
        paths.update(
            reward_model_path=(os.path.join(ROOT, "assets", "tiny-rm"),),
            dataset=os.path.join(ROOT, "assets", "reviews", "train.jsonl"),
        )
    else:
        paths.update(dataset=os.path.join(ROOT, "assets", "arithmetic", "train.jsonl"))
    # one optimiser step per iteration: the whole rollout is one minibatch and one micro-batch
    one_step = dict(
        minibatch_size=8, micro_batch_size=8, num_epochs=1, rollout_batch_size=8 if script == "ppo.py" else 2
    )
    return MODULES[script].Args(**{**TINY[script], **one_step, "eval_every": 0, **paths, "output_dir": str(out), **kw})


# A function of each script that every training forward goes through once (rloo.py's REINFORCE loss skips the clipped
# one).
LOSS_FUNCTION = {"ppo.py": "clip_loss", "grpo.py": "clip_loss", "rloo.py": "loss_weights"}


def poison_the_loss(monkeypatch, script, bad_calls):
    """Make the loss nan on the given calls (1-based), as a bf16 overflow would."""
    module = MODULES[script]
    name = LOSS_FUNCTION[script]
    calls = []
    real = getattr(module, name)

    def poisoned(*args):
        calls.append(1)
        out = real(*args)
        nan = float("nan") if len(calls) in bad_calls else 1.0
        if isinstance(out, tuple):  # (the loss, what else the function returns)
            return (out[0] * nan, *out[1:])
        return out * nan

    monkeypatch.setattr(module, name, poisoned)


@pytest.mark.parametrize("script", list(MODULES))
def test_a_non_finite_step_is_skipped_and_the_run_goes_on(script, tmp_path, monkeypatch, keep_signal_handlers, capsys):
    module = MODULES[script]
    poison_the_loss(monkeypatch, script, bad_calls={2})
    module.main(args_for(script, tmp_path, total_episodes=24, save_every=1, keep_checkpoints=10))
    states = [checkpointed(tmp_path / f"checkpoint-{i}") for i in (1, 2, 3)]
    # iteration 2's step was skipped: its weights and optimiser states are those after iteration 1
    assert_bitwise_equal(states[1], states[0])
    # and the run went on: iteration 3 stepped
    assert not torch.equal(
        states[2]["policy"]["model"]["model.norm.weight"], states[1]["policy"]["model"]["model.norm.weight"]
    )
    rows = read_rows(tmp_path)
    assert [r["health/skipped_steps"] for r in rows] == [0, 1, 1]
    assert "iteration 2: a non-finite loss or gradient" in capsys.readouterr().out


def test_max_bad_steps_in_a_row_stop_the_run(tmp_path, monkeypatch, keep_signal_handlers):
    poison_the_loss(monkeypatch, "ppo.py", bad_calls={2, 3, 4})
    with pytest.raises(
        SystemExit,
        match=r"2 optimiser steps in a row had a non-finite loss or gradient "
        r"\(iteration 3\).*learning rate",
    ):
        ppo.main(args_for("ppo.py", tmp_path, total_episodes=48, max_bad_steps=2))


# ---------------------------------------------------------------- reward functions written by users

PROMPTS = ["what is 2+3?", "what is 7+1?", "what is 4+4?", "what is 9+0?"]
RESPONSES = ["5", "8", "nine", "9"]


def scored(fn, on_reward_error="stop", penalty=1.0, more=()):
    """score_responses on four known prompts and responses with a rule reward (and more (--reward_fn, function)
    pairs) and no reward model."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"), padding_side="left")
    encode = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]
    prompt_ids, prompt_mask = ppo.left_pad(encode, tokenizer.pad_token_id, "cpu")
    replies = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in RESPONSES]
    width = max(map(len, replies))
    responses = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in replies])
    response_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in replies])
    args = ppo.Args(on_reward_error=on_reward_error, missing_eos_penalty=penalty)
    return ppo.score_responses(
        ppo.Scorer([], [("fn", fn), *more], tokenizer),
        torch.cat([prompt_ids, responses], 1),
        torch.cat([prompt_mask, response_mask], 1),
        prompt_ids.shape[1],
        [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, ["5", "8", "8", "9"])],
        args,
    )


def test_a_failing_reward_function_is_pinned_on_its_response():
    def fails_on_words(texts, answers):
        return [float(int(t) == int(a)) for t, a in zip(texts, answers)]  # int("nine") raises

    with pytest.raises(
        SystemExit,
        match=r"the response 'nine' to the prompt 'what is 4\+4\?' is an error "
        r"\(ValueError: invalid literal.*--on_reward_error penalty",
    ):
        scored(fails_on_words)
    # with the penalty it scores --missing_eos_penalty below the lowest valid score of the batch: min(1, 1, 1) - 0.5
    scores = scored(fails_on_words, "penalty", penalty=0.5)
    assert scores.raw.tolist() == [1.0, 1.0, 0.5, 1.0]
    assert scores.failed == 1
    assert scores.texts == RESPONSES
    reward_metrics = scores.metrics
    assert reward_metrics["objective/rule_reward"].tolist() == [1.0, 1.0, 0.0, 1.0]  # the rule counts it as wrong


def test_a_non_finite_score_is_named():
    with pytest.raises(SystemExit, match=r"the response '9' to the prompt 'what is 9\+0\?' is not a finite number"):
        scored(lambda texts, answers: [0.0, 1.0, 2.0, float("inf")])
    scores = scored(lambda texts, answers: [0.0, float("nan"), 2.0, 3.0], "penalty")
    assert scores.raw.tolist() == [0.0, -1.0, 2.0, 3.0]
    assert scores.failed == 1


def test_a_wrong_number_of_scores_is_named():
    with pytest.raises(
        SystemExit,
        match=r"the response '5' .* is nan: the batch's call returned 3 scores for 4 "
        r"responses; fix the reward",
    ):  # the count named, not one response blamed
        scored(lambda texts, answers: [1.0 for t in texts if t != "nine"])  # drops a response

    def one_at_a_time(texts, answers):  # scores a single response, and raises on a batch of several
        if len(texts) == 1:
            return [1.0]
        raise ZeroDivisionError("division by zero")

    with pytest.raises(
        SystemExit,
        match=r"is nan: the batch's call raised \(ZeroDivisionError: division by zero\) but no single response's did; "
        "make the reward score a batch as it scores each response",
    ):
        scored(one_at_a_time)
    # every response failed: no batch minimum, and the advice is not the option already on
    with pytest.raises(
        SystemExit,
        match="every response of the batch failed its reward "
        r"\(the response '5' .* is not a finite number\); fix the reward function\.$",
    ):
        scored(lambda texts, answers: [float("nan")] * len(texts), "penalty")


def test_penalised_reward_errors_are_counted_in_a_run(tmp_path, monkeypatch, keep_signal_handlers):
    def half_broken(texts, answers):  # a reward that fails on every other response
        return [float("nan") if i % 2 else 1.0 for i in range(len(texts))]

    monkeypatch.setitem(grpo.REWARD_FNS, "arithmetic", half_broken)
    grpo.main(args_for("grpo.py", tmp_path, total_episodes=16, on_reward_error="penalty"))
    rows = read_rows(tmp_path)
    assert [r["health/reward_errors"] for r in rows] == [4, 4]  # 4 of the 8 responses of each iteration
    with pytest.raises(SystemExit, match="is not a finite number; fix the reward"):
        grpo.main(args_for("grpo.py", tmp_path / "stop", total_episodes=16))


# ---------------------------------------------------------------- the outside world


def test_no_socket_is_opened_when_every_path_is_local(tmp_path):
    log = tmp_path / "sockets.log"
    prelude = tmp_path / "watch_sockets.py"
    prelude.write_text(f"""import runpy
import sys

log = open({str(log)!r}, "w")
def hook(event, args):  # every socket operation passes through the audit hook, whichever library does it
    if event.startswith("socket."):
        log.write(f"{{event}} {{args!r}}\\n")
        log.flush()
sys.addaudithook(hook)
sys.argv = sys.argv[1:]
sys.path.insert(0, {ROOT!r})
runpy.run_path(sys.argv[0], run_name="__main__")
""")
    opens = tmp_path / "opens.py"
    opens.write_text("import socket\nsocket.socket().close()\n")
    subprocess.run([sys.executable, str(prelude), str(opens)], check=True)
    assert "socket.__new__" in log.read_text()  # the watch sees a socket when there is one
    # not even told to stay offline
    env = {k: v for k, v in ENV.items() if not k.startswith(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))}
    args = cli("ppo.py", total_episodes=16, eval_every=1)
    result = finished(script_command("ppo.py", tmp_path / "run", args, (sys.executable, str(prelude))), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert log.read_text() == ""


def test_track_on_a_node_without_network_logs_offline_for_a_later_sync(tmp_path):
    """--track with WANDB_MODE=offline, as docs/long-runs.md says to set on a node without network."""
    env = {**ENV, "WANDB_MODE": "offline", "WANDB_BASE_URL": "http://127.0.0.1:9"}  # nothing listens on port 9
    args = ["--track", *cli("rloo.py", total_episodes=8), "--log_samples_every=1"]
    result = finished(script_command("rloo.py", tmp_path, args), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = [tmp_path / "wandb" / n for n in os.listdir(tmp_path / "wandb") if n.startswith("offline-run-")]
    # what a later `wandb sync` uploads: the code, the sample tables, and (in the run's record) the config and the
    # metrics
    assert (run / "files" / "code" / "rloo.py").read_text() == open(os.path.join(ROOT, "rloo.py")).read()
    tables = os.listdir(run / "files" / "media" / "table")
    assert any(t.startswith("samples_") for t in tables)
    assert json.load(open(run / "files" / "media" / "table" / tables[0]))["columns"] == ["prompt", "response", "score"]
    record = next(run.glob("run-*.wandb")).read_bytes()
    assert b"num_generations" in record
    assert b"objective/kl" in record


# ---------------------------------------------------------------- bad input, in every script

COMMON_BAD = [
    (dict(model_name_or_path="/nonexistent/model"), "could not be found"),
    (dict(temperature=0.0), "--temperature must be positive"),
    (dict(reward_model_path=(), reward_fn=()), "no reward"),
    (dict(reward_fn=("nope",)), "unknown --reward_fn"),
    (dict(total_episodes=4), "must be at least one rollout"),
    (dict(micro_batch_size=0), "--micro_batch_size must be at least 1"),
    (dict(num_epochs=0), "--num_epochs must be at least 1"),
    (dict(response_length=0), "--response_length must be at least 1"),
    (dict(max_grad_norm=-1.0), "--max_grad_norm must be positive"),
    (dict(learning_rate=0.0), "--learning_rate must be positive"),
    (dict(kl_coef=-0.1), "--kl_coef must be zero or more"),
    (dict(save_every=-1), "--save_every must be 0 \\(never\\) or more"),
    (dict(keep_checkpoints=0), "--keep_checkpoints must be at least 1"),
    (dict(max_bad_steps=0), "--max_bad_steps must be at least 1"),
    (dict(resume="/nonexistent/checkpoint-3"), "is not a whole checkpoint: its manifest.json is missing or damaged"),
    (dict(resume="/nonexistent/checkpoint-3.tmp"), "is not a whole checkpoint: its manifest.json is missing"),
    (dict(minibatch_size=8, micro_batch_size=3), "must divide the per-process minibatch"),
    (dict(output_dir="/proc/no/such/run"), "--output_dir '/proc/no/such/run' cannot be created or written to"),
    # non-finite floats pass every comparison but "finite"; a seed past 9e12 overflows the generator's 64 bits
    (dict(kl_coef=float("inf")), "--kl_coef must be finite and within \\+-3.4e\\+38 \\(got inf\\)"),
    (dict(temperature=float("inf")), "--temperature must be finite"),
    (dict(ent_coef=float("nan")), "--ent_coef must be finite and within \\+-3.4e\\+38 \\(got nan\\)"),
    (dict(kl_coef=1e39), "--kl_coef must be finite and within \\+-3.4e\\+38 \\(got 1e\\+39\\)"),  # inf in float32
    (dict(lora_alpha=float("inf")), "--lora_alpha must be finite"),
    (dict(seed=2 * 10**13), "--seed must lie in \\[0, 9e12\\]"),
    (dict(seed=2**63 - 1), "--seed must lie in"),
    (
        dict(model_name_or_path=os.path.join(ROOT, "assets", "tiny-sft", "config.json")),
        "--model_name_or_path '.*config.json' is a file; pass the folder that holds the model",
    ),
]
GROUP_BAD = [
    (dict(num_generations=1), "--num_generations must be at least 2"),
    (
        dict(rollout_batch_size=3, world_size=2, minibatch_size=4, micro_batch_size=2),
        "--rollout_batch_size must be a multiple of the 2 processes \\(each samples whole groups of prompts\\) "
        "\\(got 3\\)",
    ),
]


@pytest.mark.parametrize("script", list(MODULES))
@pytest.mark.parametrize(
    "kw,message", COMMON_BAD + GROUP_BAD, ids=lambda x: str(x)[:40] if isinstance(x, dict) else None
)
def test_bad_arguments_fail_with_one_sentence_in_every_script(script, kw, message, tmp_path):
    if "num_generations" in kw and script == "ppo.py":
        pytest.skip("ppo.py has no groups")
    with pytest.raises(SystemExit, match=message):
        set_up(MODULES[script], args_for(script, tmp_path / "run", **kw))


def test_a_float_option_must_fit_in_float32():
    """1e308 is finite in Python and inf in a float32 tensor: --clip_range_high 1e308 is refused in one sentence
    (before, the first step's torch.clamp overflowed: a traceback); float32's largest passes that check."""
    most = torch.finfo(torch.float32).max
    for value in (1e308, 3.5e38, float("inf")):
        with pytest.raises(SystemExit, match=r"^--clip_range_high must be finite and within \+-3.4e\+38 \(got "):
            grpo.validate(grpo.Args(clip_range_high=value, eval_every=0))
    try:
        grpo.validate(grpo.Args(clip_range_high=most, ent_coef=most, eval_every=0))
    except SystemExit as e:  # another rule of the option may refuse it, never its range
        assert "within +-" not in str(e.code)


@pytest.mark.parametrize("script", list(MODULES))
def test_the_command_line_refuses_a_choice_it_does_not_offer(script, capsys):
    """--model_dtype, --decode and --on_reward_error are Literal fields: tyro refuses another value and names the
    choices, before anything runs."""
    for option, value in (("--model_dtype", "float64"), ("--decode", "fast"), ("--on_reward_error", "ignore")):
        with pytest.raises(SystemExit) as stopped:
            tyro.cli(MODULES[script].Args, args=[option, value], use_underscores=True)
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert value in err
        assert option in err


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py"])
def test_a_rule_reward_needs_answers(script, tmp_path):
    args = args_for(script, tmp_path, reward_fn=("arithmetic",))
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    with pytest.raises(
        SystemExit, match="--reward_fn arithmetic needs an answer column, but row 1 of .*reviews/train.jsonl"
    ):
        MODULES[script].load_prompts(os.path.join(ROOT, "assets", "reviews", "train.jsonl"), "train", args, tokenizer)


def test_resuming_with_other_arguments_is_refused(tmp_path, uninterrupted, capsys):
    out, _, _ = uninterrupted("grpo.py")
    checkpoint = str(out / "checkpoint-6")
    with pytest.raises(SystemExit, match="was made with other values of --learning_rate, --response_length"):
        set_up(
            grpo,
            grpo.Args(
                **{
                    **TINY["grpo.py"],
                    "output_dir": str(tmp_path),
                    "resume": checkpoint,
                    "learning_rate": 1e-3,
                    "response_length": 9,
                }
            ),
        )
    # more episodes: allowed
    args = grpo.Args(**{**TINY["grpo.py"], "output_dir": str(out), "resume": "auto", "total_episodes": 96})
    set_up(grpo, args)
    assert f"--resume auto: resuming from {checkpoint}\n" in capsys.readouterr().out


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("script", list(MODULES))
def test_a_terminal_gets_a_live_progress_bar_and_a_log_file_only_lines(script, tmp_path, monkeypatch, capsys):
    """In a terminal, a tqdm bar counts the iterations with the time left and the live objective; redirected to a
    file, stderr gets no bar; either way stdout has one line per iteration (8 responses each: 3 iterations)."""
    for where, stderr in (("terminal", Terminal()), ("file", io.StringIO())):
        monkeypatch.setattr(sys, "stderr", stderr)
        MODULES[script].main(args_for(script, tmp_path / where, total_episodes=24))
        assert [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("iter ")] == [
            "1/3",
            "2/3",
            "3/3",
        ]
        bar = stderr.getvalue()
        if where == "terminal":
            # done, with the objective and the time left
            assert "3/3" in bar
            assert "score=" in bar
            assert "kl=" in bar
            assert "<00:00" in bar
        else:
            assert "3/3" not in bar


# ---------------------------------------------------------------- checkpoints checked before they load


def cut_in_half(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garbage_of_the_same_size(path):
    """The file's bytes replaced by random ones, its size unchanged: the stat before loading passes it."""
    size = path.stat().st_size
    path.write_bytes(os.urandom(size))


def iteration_7(path):
    """state.json's iteration changed from 6 to 7, its size unchanged."""
    path.write_text(path.read_text().replace('"iteration": 6', '"iteration": 7'))


# Each kind of file of a checkpoint, damaged: (the file, what is done to it, what --resume auto says of it).
DAMAGE = {
    "shard cut": ("__0_0.distcp", cut_in_half, "__0_0.distcp is not of the size it was saved with"),
    ".metadata deleted": (".metadata", os.remove, ".metadata is missing"),
    "state.json cut": ("state.json", cut_in_half, "state.json is not of the size it was saved with"),
    "state.json of another iteration": ("state.json", iteration_7, "its name says iteration 6, its state.json 7"),
    "args.json garbage": ("args.json", garbage_of_the_same_size, "its args.json cannot be read"),
    "metrics.jsonl deleted": ("metrics.jsonl", os.remove, "metrics.jsonl is missing"),
    "metrics.jsonl cut": ("metrics.jsonl", cut_in_half, "metrics.jsonl is not of the size it was saved with"),
    "manifest deleted": ("manifest.json", os.remove, "its manifest.json is missing or damaged"),
}


def run_as_found(tmp_path, uninterrupted, script="ppo.py"):
    """A copy of the script's tiny run, as a user finds it: checkpoints 3 and 6, its log, its arguments, its policy."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted(script)[0], out, ignore=shutil.ignore_patterns("*.pt"))  # final_state's files
    return out


def tiny_args(script, out, **kw):
    """The arguments of the tiny runs (relative paths, as on their command lines)."""
    return MODULES[script].Args(**{**TINY[script], "output_dir": str(out), **kw})


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_named_and_the_one_before_taken(damage, tmp_path, uninterrupted, capsys):
    out = run_as_found(tmp_path, uninterrupted)
    name, spoil, said = DAMAGE[damage]
    spoil(out / "checkpoint-6" / name)
    set_up(ppo, tiny_args("ppo.py", out, resume="auto"))  # no traceback, nothing loaded
    printed = capsys.readouterr().out
    assert f"--resume auto: skipping {out / 'checkpoint-6'}: {said}\n" in printed
    assert f"--resume auto: resuming from {out / 'checkpoint-3'}\n" in printed
    # named outright: one sentence with the file and the checkpoint to take instead
    with pytest.raises(SystemExit) as refused:
        set_up(ppo, tiny_args("ppo.py", tmp_path / "elsewhere", resume=str(out / "checkpoint-6")))
    assert refused.value.code == (
        f"--resume '{out / 'checkpoint-6'}' is not a whole checkpoint: {said}; resume from {out / 'checkpoint-3'}, "
        "the newest whole checkpoint beside it."
    )


def test_a_shard_that_fails_to_load_gives_way_to_the_checkpoint_before(tmp_path, uninterrupted):
    """Garbage of the right size in the newest shard passes the stat and fails in dcp.load: --resume auto names it,
    goes on from checkpoint-3, writes checkpoint-6 anew over it, and ends as the run that was never damaged, its log
    cut back to checkpoint-3's rows and written on from there."""
    _, full_rows, full_state = uninterrupted("ppo.py")
    out = run_as_found(tmp_path, uninterrupted)
    garbage_of_the_same_size(out / "checkpoint-6" / "__0_0.distcp")
    rows, printed = run_script("ppo.py", out, *cli("ppo.py", save_every=3), "--resume=auto")
    assert f"--resume auto: {out / 'checkpoint-6'} could not be loaded (" in printed
    assert f"--resume auto: resuming from {out / 'checkpoint-3'}\n" in printed
    assert without_timing(rows) == full_rows
    assert_bitwise_equal(final_state(out), full_state)


def test_a_shard_that_fails_to_load_is_refused_by_hand_naming_the_one_before(tmp_path, uninterrupted):
    out = run_as_found(tmp_path, uninterrupted)
    garbage_of_the_same_size(out / "checkpoint-6" / "__0_0.distcp")
    with pytest.raises(SystemExit) as refused:
        ppo.main(tiny_args("ppo.py", out, resume=str(out / "checkpoint-6")))
    assert refused.value.code.startswith(f"checkpoint '{out / 'checkpoint-6'}' could not be loaded (")
    assert refused.value.code.endswith(
        f"); resume from {out / 'checkpoint-3'}, the newest whole checkpoint beside it, or if the models changed "
        "size, resume with those it was trained from."
    )


def test_a_new_run_never_resumes_or_mixes_in_another_runs_checkpoints(tmp_path, uninterrupted):
    """Run B, on other data, in the folder of run A: refused before anything is written, however it is started;
    run A's checkpoints, log and policy stay as they were (run.lock aside: B held the folder while it read it, and the
    lock's note names B)."""
    out = run_as_found(tmp_path, uninterrupted)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "run.lock"}
    other_data = dict(dataset=os.path.join("assets", "arithmetic", "train.jsonl"))
    refusal = (
        rf"^--output_dir '{re.escape(str(out))}' holds the checkpoints of a run \(the newest: checkpoint-6\); pass "
        r"--resume auto to continue it, or another --output_dir\.$"
    )
    with pytest.raises(SystemExit, match=refusal):
        ppo.main(tiny_args("ppo.py", out, **other_data))
    with pytest.raises(SystemExit, match="was made with other values of --dataset"):
        ppo.main(tiny_args("ppo.py", out, resume="auto", **other_data))
    elsewhere = uninterrupted("ppo.py")[0] / "checkpoint-3"  # a whole checkpoint of a run of its own
    with pytest.raises(SystemExit, match=refusal):
        ppo.main(tiny_args("ppo.py", out, resume=str(elsewhere)))
    with pytest.raises(SystemExit, match=refusal):
        ppo.main(tiny_args("ppo.py", out))  # the same run started again without --resume
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "run.lock"} == before
    assert (out / "run.lock").read_text() == f"process {os.getpid()} on {os.uname().nodename}"


def test_a_checkpoint_of_another_script_is_refused(tmp_path, uninterrupted):
    checkpoint = uninterrupted("ppo.py")[0] / "checkpoint-6"
    with pytest.raises(
        SystemExit,
        match=rf"'{re.escape(str(checkpoint))}' is a checkpoint of ppo.py, not of grpo.py; "
        "resume it with ppo.py",
    ):
        set_up(grpo, tiny_args("grpo.py", tmp_path, resume=str(checkpoint)))


@pytest.mark.parametrize("script", list(MODULES))
def test_a_learning_rate_of_1e9_never_ends_with_a_broken_policy_saved(script, tmp_path, keep_signal_handlers):
    """The first step takes every weight to about 1e9 (finite, but the logits are nan from then on). PPO here takes
    four steps an iteration, so three non-finite ones in a row stop it at the end of its first; the others take one,
    and the run ends after a single bad step: the final save refuses the policy."""
    several = dict(minibatch_size=4, micro_batch_size=4, num_epochs=2) if script == "ppo.py" else {}
    message = (
        "3 optimiser steps in a row had a non-finite loss or gradient \\(iteration 1\\)"
        if several
        else "the last 1 optimiser step\\(s\\) had a non-finite loss or gradient, so the policy is not saved"
    )
    with pytest.raises(SystemExit, match=message):
        MODULES[script].main(args_for(script, tmp_path, total_episodes=16, learning_rate=1e9, save_every=1, **several))
    assert not (tmp_path / "model.safetensors").exists()
    for checkpoint in MODULES[script].checkpoints_in(str(tmp_path)):  # what was written is finite
        assert all(torch.isfinite(w).all() for w in checkpointed(checkpoint)["policy"]["model"].values())


def failing_reward(tmp_path, from_batch, rank):
    """A prelude that runs a script with its arithmetic reward behind a grading service that goes away at the given
    rollout (counting batches), on the given process; the script's own reward is the function fixed."""
    prelude = tmp_path / "failing_reward.py"
    prelude.write_text(f"""import os
import runpy
import sys

sys.argv = sys.argv[1:]
sys.path.insert(0, {ROOT!r})
script = runpy.run_path(sys.argv[0], run_name="script")  # its functions; main not run yet
arithmetic = script["REWARD_FNS"]["arithmetic"]
batches = []
def grading_service(texts, answers):
    batches.append(len(texts) > 1)
    if os.environ.get("RANK", "0") == {str(rank)!r} and sum(batches) >= {from_batch}:
        raise ConnectionError("the grading service went away")
    return arithmetic(texts, answers)
script["REWARD_FNS"]["arithmetic"] = grading_service
script["main"](script["tyro"].cli(script["Args"], use_underscores=True))
""")
    return str(prelude)


def test_a_reward_that_fails_mid_run_leaves_a_checkpoint_to_go_on_from(tmp_path, uninterrupted):
    """The reward fails at iteration 3 (save_every 3: no checkpoint yet): the run saves the state before it, names
    the failure, prints the command that goes on; with the function fixed that command ends as the run whose reward
    never failed."""
    _, full_rows, full_state = uninterrupted("grpo.py")
    out = tmp_path / "run"
    proc = launch("grpo.py", out, cli("grpo.py", save_every=3), prelude=failing_reward(tmp_path, 3, rank=0))
    printed = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1, printed[-3000:]
    assert "Traceback" not in printed, printed[-3000:]
    assert "is an error (ConnectionError: the grading service went away); fix the reward" in printed
    command = printed.split("stopped after iteration 2; to go on:\n")[1].splitlines()[0].strip()
    assert command.endswith(f"--resume {out / 'checkpoint-2'}")
    result = finished([sys.executable, *shlex.split(command)[1:]])
    assert result.returncode == 0, result.stderr[-3000:]
    assert without_timing(read_rows(out)) == full_rows
    assert_bitwise_equal(final_state(out), full_state)


def test_a_reward_that_fails_on_one_process_stops_them_all_together(tmp_path):
    """Under torchrun the second process's reward fails at iteration 2: both save iteration 1's state, and the
    failure is said once, by rank 0, with the command that goes on."""
    out = tmp_path / "run"
    head = [*TORCHRUN, failing_reward(tmp_path, 2, rank=1)]
    result = finished(
        script_command("grpo.py", out, cli("grpo.py", save_every=3, micro_batch_size=4), head), timeout=300
    )
    printed = result.stdout + result.stderr
    assert result.returncode != 0, printed[-3000:]
    assert printed.count("the grading service went away") == 1, printed[-3000:]
    assert printed.count("stopped after iteration 1; to go on:\n  torchrun --nproc_per_node=2 ") == 1
    assert grpo.checkpoint_problem(str(out / "checkpoint-1")) is None
    assert sorted(os.listdir(out / "checkpoint-1")) == TWO_PROCESS_CHECKPOINT
    assert json.load(open(out / "checkpoint-1" / "state.json"))["iteration"] == 1


def files_of_a_megabyte():
    """In the child: files may grow to 1 MB (a full disk for the checkpoint's shard, 17 MB), and going past the limit
    is an error to the writer instead of a signal that kills it."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_a_failed_write_ends_in_one_sentence_and_leaves_the_last_checkpoint(tmp_path, uninterrupted):
    out = tmp_path / "run"
    os.makedirs(out)
    shutil.copytree(uninterrupted("rloo.py")[0] / "checkpoint-3", out / "checkpoint-3")
    args = [*cli("rloo.py", save_every=1), "--resume=auto"]
    result = finished(script_command("rloo.py", out, args), preexec_fn=files_of_a_megabyte)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.search(
        rf"writing {re.escape(str(out / 'checkpoint-4'))} failed \(.+\); free some space on "
        rf"'{re.escape(str(out))}' \(or make it writable again\) and go on from "
        rf"{re.escape(str(out / 'checkpoint-3'))}, the last good checkpoint, with --resume auto\.$",
        result.stderr.strip(),
    )
    assert sorted(os.listdir(out)) == ["args.json", "checkpoint-3", "metrics.jsonl", "run.lock"]  # no checkpoint-4.tmp
    assert rloo.checkpoint_problem(str(out / "checkpoint-3")) is None
