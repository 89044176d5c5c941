"""Never losing a run (rlhf_runtime/checkpoints.py, written once for every script, run through the scripts): a run
stopped by SIGTERM or Ctrl-C, or by a reward failing before its first step, in an evaluation or mid-run, and resumed
with the command it printed writes the same log and the same weights, to its Adam states, as one never stopped; a kill
during a save leaves the previous checkpoint; a damaged checkpoint is named and the one before taken, and is not
counted among those kept; a --resume that names no checkpoint says what to pass; non-finite steps
are skipped and never saved; one run per folder (the lock, taken first); the same seed gives the same run; resumes
that refuse other runs' or other arguments' checkpoints and allow what may change. What the runtime does alike for
every script is shown once, on one script; what a checkpoint holds of each algorithm's own state, per script.

Why a resumed run is bitwise the same run on a CPU: everything random is drawn from generators seeded afresh from
the seed (each iteration's samples and minibatches from (seed, iteration), the data order from seed + data epoch,
evaluation from the seed), so there is no generator state to save; the models and Adam states are saved exactly
(torch.distributed.checkpoint); and CPU kernels are deterministic for a fixed thread count."""

import errno
import json
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import tyro
from helpers import (
    ARITHMETIC,
    ENV,
    MODULES,
    ROOT,
    TINY,
    args_for,
    assert_bitwise_equal,
    checkpointed,
    cli,
    failing_reward,
    final_state,
    finished,
    launch,
    make_args,
    read_rows,
    resume_as_printed,
    run_main,
    run_script,
    script_command,
    set_up,
    tiny_run,
    wait_for,
    without_timing,
)
from safetensors.torch import load_file

import grpo
import ppo
import rlhf_runtime as runtime
from rlhf_runtime import checkpoints


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each script's tiny run, never stopped (computed once per script, in this process)."""
    runs = {}

    def get(script):
        if script not in runs:
            out = tmp_path_factory.mktemp(script.replace(".", "_"))
            rows, _ = run_main(script, out, *cli(script, save_every=3))
            runs[script] = (out, without_timing(rows), final_state(out))
        return runs[script]

    return get


# ---------------------------------------------------------------- stopped and resumed


@pytest.mark.parametrize("script,stop", [("ppo.py", signal.SIGTERM), ("rloo.py", signal.SIGINT)])
def test_a_stopped_and_resumed_run_is_the_same_run(script, stop, tmp_path, uninterrupted):
    """SIGTERM (a cluster's pre-emption) or Ctrl-C (SIGINT), then the command the run printed, as a command. What a
    checkpoint holds besides the models and Adam states is the plumbing's bookkeeping and the algorithm's own state:
    ppo.py's KL coefficient, score moments and value head, rloo.py's score moments; grpo.py has none of its own (its
    state is rloo.py's without the moments), and dapo.py's sampling rounds are test_dapo.py's."""
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
    rows, printed = run_main("ppo.py", out, *cli("ppo.py", save_every=3), "--resume=auto")
    assert f"resuming from {out / 'checkpoint-1'}" in printed
    assert not (out / "checkpoint-2.tmp").exists()  # the first save that succeeds clears what the kill left
    assert without_timing(rows) == full_rows
    assert_bitwise_equal(final_state(out), full_state)


def test_the_same_seed_gives_the_same_run(tmp_path, uninterrupted):
    _, full_rows, full_state = uninterrupted("rloo.py")
    rows, _ = run_main("rloo.py", tmp_path / "again", *cli("rloo.py", save_every=3))
    assert without_timing(rows) == full_rows
    assert_bitwise_equal(final_state(tmp_path / "again"), full_state)
    rows, _ = run_main("rloo.py", tmp_path / "other", *cli("rloo.py", save_every=3, seed=2))
    assert without_timing(rows) != full_rows  # the comparison can fail


def test_a_reward_failing_in_iteration_1_resumes_bitwise(tmp_path, uninterrupted):
    """The reward (a grading service standing in for the arithmetic rule) fails in iteration 1, before any optimiser
    step: checkpoint-0 is what the run leaves. Resumed with the service back, the run is the one whose reward never
    failed, to its Adam states. The stop and the resume are the plumbing's: shown on grpo.py, whose tiny run is
    ARITHMETIC's (its defaults), and so the run never stopped."""
    script = "grpo.py"
    args = [*cli(script), *ARITHMETIC]
    full_dir, full, _ = uninterrupted(script)
    out = tmp_path / "run"
    proc = launch(script, out, args, prelude=failing_reward(tmp_path, 1, rank=0))
    printed = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1, printed[-3000:]
    assert "stopped after iteration 0; to go on:" in printed, printed[-3000:]
    printed = resume_as_printed(printed, out / "checkpoint-0")
    assert "torch.distributed is disabled" not in printed  # a plain run's checkpoint is one process's, as meant
    assert without_timing(read_rows(out)) == full
    assert_bitwise_equal(final_state(out), final_state(full_dir))


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """grpo.py's tiny run on the arithmetic task, evaluated before training and after the last iteration, never
    stopped (in this process): its options, its folder and its rows."""
    held_out = tmp_path_factory.mktemp("held_out") / "test.jsonl"  # 8 prompts: one call of the rule per pass
    held_out.write_text("".join(open(os.path.join(ROOT, "assets", "arithmetic", "test.jsonl")).readlines()[:8]))
    evaluation = ["--eval_every=100", "--save_every=100", f"--eval_dataset={held_out}", "--eval_batch_size=8"]
    args = [*cli("grpo.py"), *ARITHMETIC, *evaluation]
    out = tmp_path_factory.mktemp("full")
    rows, _ = run_main("grpo.py", out, *args)
    return args, out, rows


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_reward_failing_in_an_evaluation_stops_the_run_and_the_resume_goes_on(which, tmp_path, evaluated):
    """The grading service goes away during the evaluation of the starting policy (its first call), or during the
    last one (after 2 calls for iteration 0's two passes and 6 iterations): the run stops with the checkpoint of the
    policy the evaluation was of, and the resumed run goes on from it without that evaluation (not redone). Its log is
    the log of the run whose reward never failed without that evaluation's scores, and its final weights and Adam
    states are that run's. Evaluation is the plumbing's: both cases on grpo.py, against one run never stopped."""
    script = "grpo.py"
    args, full_dir, full = evaluated
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
    assert_bitwise_equal(final_state(out), final_state(full_dir))


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
    assert "stopped after iteration 2; to go on:\n" in printed
    resume_as_printed(printed, out / "checkpoint-2")
    assert without_timing(read_rows(out)) == full_rows
    assert_bitwise_equal(final_state(out), full_state)


def test_the_command_a_stop_prints_holds_one_resume(tmp_path, monkeypatch, capsys):
    """A run started with --resume (a path, or auto, in either spelling) and stopped again prints the command to go on
    with the new checkpoint as its only --resume (each stop added one after the last: `--resume auto --resume ...`)."""
    checkpoint = str(tmp_path / "checkpoint-5")
    monkeypatch.setattr(checkpoints, "save_checkpoint", lambda args, models, optimizers, state, rank: checkpoint)
    argv = [
        "grpo.py",
        "--output_dir",
        str(tmp_path),
        "--resume",
        "auto",
        "--seed=2",
        f"--resume={tmp_path}/checkpoint-3",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    policy = torch.nn.Linear(1, 1)
    with pytest.raises(SystemExit) as stopped:
        runtime.stop_if_asked(
            [signal.SIGTERM], runtime.new_state(), {"policy": policy}, {}, grpo.Args(output_dir=str(tmp_path))
        )
    assert stopped.value.code == 128 + signal.SIGTERM
    command = capsys.readouterr().out.split("to go on:\n")[1].strip()
    assert shlex.split(command) == [
        "python",
        "grpo.py",
        "--output_dir",
        str(tmp_path),
        "--seed=2",
        "--resume",
        checkpoint,
    ]


def test_a_run_saved_with_decode_auto_goes_on_with_the_plain_loop(tmp_path):
    """A one-GPU run (--decode auto: CUDA graphs) goes on under torchrun or on a CPU, where only the plain loop runs:
    its checkpoint after iteration 2, resumed with --decode plain, ends as the run never stopped, bitwise (on the CPU
    auto is the plain loop too; what is shown is that --decode is an option a resume may change)."""
    run = tiny_run("ppo.py", total_episodes=24, response_length=8, eval_every=0, save_every=1)  # three iterations
    full_rows, _ = run_main("ppo.py", tmp_path / "full", *run, "--decode=auto")
    checkpoint = tmp_path / "full" / "checkpoint-2"
    rows, printed = run_main("ppo.py", tmp_path / "resumed", *run, "--decode=plain", f"--resume={checkpoint}")
    assert "other values of" not in printed
    assert [r["iteration"] for r in rows] == [r["iteration"] for r in full_rows] == [1, 2, 3]
    timing = ("time/", "memory/")
    for got, expected in zip(rows, full_rows):  # the checkpoint's rows, then iteration 3 run again
        assert {k: v for k, v in got.items() if not k.startswith(timing)} == {
            k: v for k, v in expected.items() if not k.startswith(timing)
        }
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    for name, weight in load_file(tmp_path / "full" / "model.safetensors").items():
        assert torch.equal(resumed[name], weight), name


# ---------------------------------------------------------------- resumes that go on and resumes that are refused


def test_resuming_with_other_arguments_is_refused(tmp_path, uninterrupted, capsys):
    out, _, _ = uninterrupted("grpo.py")
    checkpoint = str(out / "checkpoint-6")
    with pytest.raises(SystemExit, match="was made with other values of --learning_rate, --response_length"):
        set_up(
            grpo,
            make_args(
                grpo,
                **{
                    **TINY["grpo.py"],
                    "output_dir": str(tmp_path),
                    "resume": checkpoint,
                    "learning_rate": 1e-3,
                    "response_length": 9,
                },
            ),
        )
    # more episodes: allowed
    args = make_args(grpo, **{**TINY["grpo.py"], "output_dir": str(out), "resume": "auto", "total_episodes": 96})
    set_up(grpo, args)
    assert f"--resume auto: resuming from {checkpoint}\n" in capsys.readouterr().out


def test_a_resume_with_nothing_left_to_train_says_so(tmp_path):
    out = tmp_path / "run"
    run_main("grpo.py", out, *cli("grpo.py", total_episodes=16, save_every=1))  # two iterations
    rows, printed = run_main("grpo.py", out, *cli("grpo.py", total_episodes=8, save_every=1), "--resume=auto")
    assert ("--total_episodes 8 ends at iteration 1: no step is taken") in printed
    assert len(rows) == 2


def test_a_resume_may_raise_the_reward_timeout_and_change_the_micro_batch(tmp_path):
    """A run stopped by a hung reward is resumed with a longer --reward_timeout; a checkpoint saved
    with another --micro_batch_size is resumed with the default: neither counts as a changed argument (the
    micro-batch changes the order of the float sums alone)."""
    out = tmp_path / "run"
    run_main("grpo.py", out, *cli("grpo.py", total_episodes=16, save_every=1, micro_batch_size=4, reward_timeout=30))
    assert checkpoints.read_json(out / "checkpoint-2" / "args.json")["micro_batch_size"] == 4
    rows, printed = run_main(
        "grpo.py", out, *cli("grpo.py", total_episodes=24, save_every=1, reward_timeout=60), "--resume=auto"
    )
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert "other values of" not in printed


def run_as_found(tmp_path, uninterrupted, script="ppo.py"):
    """A copy of the script's tiny run, as a user finds it: checkpoints 3 and 6, its log, its arguments, its policy."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted(script)[0], out, ignore=shutil.ignore_patterns("*.pt"))  # final_state's files
    return out


def tiny_args(script, out, **kw):
    """The arguments of the tiny runs (relative paths, as on their command lines)."""
    return make_args(MODULES[script], **{**TINY[script], "output_dir": str(out), **kw})


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


def test_a_resume_onto_a_policy_of_another_size_is_refused_in_one_sentence(tmp_path):
    """The policy's folder, after the run, holds a model of another width: the checkpoint cannot be loaded into it,
    and the resume says so instead of DCP's traceback."""
    from transformers import AutoConfig, AutoModelForCausalLM

    policy = tmp_path / "policy"
    out = tmp_path / "run"
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-sft"), policy)
    run_main("grpo.py", out, *cli("grpo.py", total_episodes=8), f"--model_name_or_path={policy}")
    config = AutoConfig.from_pretrained(policy)
    config.hidden_size = 2 * config.hidden_size
    config.intermediate_size = 2 * config.intermediate_size
    AutoModelForCausalLM.from_config(config).save_pretrained(policy)
    args = make_args(
        grpo,
        **{**TINY["grpo.py"], "total_episodes": 16},
        model_name_or_path=str(policy),
        output_dir=str(out),
        resume="auto",
    )
    with pytest.raises(
        SystemExit,
        match=rf"^--resume auto: no checkpoint in '{out}' could be loaded \(the last: ValueError: Size mismatch "
        r".*\); if the models changed size, resume with those it was trained from, or start afresh in another "
        r"--output_dir\.$",
    ):
        grpo.main(args)


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
    rows, printed = run_main("ppo.py", out, *cli("ppo.py", save_every=3), "--resume=auto")
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


def saved_by_hand(folder, iteration, args):
    """A checkpoint folder of the given name holding a state of the given iteration, completed as a save completes."""
    tmp = folder.parent / (folder.name + ".tmp")
    tmp.mkdir()
    (folder.parent / "metrics.jsonl").touch()  # the run's log, which the checkpoint copies
    checkpoints.complete_checkpoint(str(tmp), str(folder), args, runtime.new_state() | {"iteration": iteration})


def test_a_state_of_another_iteration_than_its_name_is_refused(tmp_path):
    """checkpoint-3 whose state.json says iteration 1 (a folder renamed, or a state copied in): refused before it
    loads (it would log iterations 2 and 3 twice)."""
    args = grpo.Args(output_dir=str(tmp_path))
    saved_by_hand(tmp_path / "checkpoint-2", 2, args)
    saved_by_hand(tmp_path / "checkpoint-3", 1, args)
    assert checkpoints.checkpoint_problem(str(tmp_path / "checkpoint-2")) is None
    assert (
        checkpoints.checkpoint_problem(str(tmp_path / "checkpoint-3")) == "its name says iteration 3, its state.json 1"
    )


def run_made_by_hand(folder, iterations):
    """A folder of grpo.py's tiny run (tiny_args) holding a checkpoint completed by hand (no shards) for each
    iteration, all kept."""
    args = tiny_args("grpo.py", folder, keep_checkpoints=len(iterations))
    folder.mkdir()
    for iteration in iterations:
        saved_by_hand(folder / f"checkpoint-{iteration}", iteration, args)
    return folder


def test_a_resume_that_names_no_checkpoint_says_what_to_pass(tmp_path):
    """--resume given the run's folder (it once said "no checkpoint beside it is whole", which was false), a path that
    does not exist, or TRL's True: one sentence naming what to pass instead, before anything is made."""
    run = run_made_by_hand(tmp_path / "run", [1, 2])
    missing = tmp_path / "no-such-run" / "checkpoint-3"
    said = {
        str(run): f"--resume '{run}' is a run's folder, not a checkpoint; pass --resume {run / 'checkpoint-2'}, its "
        f"newest whole checkpoint, or --resume auto with --output_dir {run}.",
        f"{run}/": f"--resume '{run}' is a run's folder, not a checkpoint; pass --resume {run / 'checkpoint-2'}, its "
        f"newest whole checkpoint, or --resume auto with --output_dir {run}.",
        str(missing): f"--resume '{missing}' does not exist; pass a checkpoint's folder (checkpoint-N in a run's "
        "--output_dir), or --resume auto for the newest one in --output_dir.",
        "True": "--resume True is TRL's way to go on from the newest checkpoint; here it is --resume auto.",
    }
    for given, sentence in said.items():
        with pytest.raises(SystemExit) as refused:
            set_up(grpo, tiny_args("grpo.py", tmp_path / "new", resume=given))
        assert refused.value.code == sentence
    cut_in_half(run / "checkpoint-2" / "state.json")  # its newest whole checkpoint is now checkpoint-1
    with pytest.raises(SystemExit, match=f"; pass --resume {re.escape(str(run / 'checkpoint-1'))}, its newest whole"):
        set_up(grpo, tiny_args("grpo.py", tmp_path / "new", resume=str(run)))
    cut_in_half(run / "checkpoint-1" / "args.json")
    with pytest.raises(SystemExit) as refused:
        set_up(grpo, tiny_args("grpo.py", tmp_path / "new", resume=str(run)))
    assert refused.value.code == (
        f"--resume '{run}' is a run's folder, not a checkpoint, and none of its checkpoints is whole; start afresh in "
        "another --output_dir."
    )
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("entry", [{}, 17], ids=["no bytes", "a number"])
def test_a_manifest_entry_without_its_size_is_skipped_with_a_line(entry, tmp_path, capsys):
    """manifest.json's entry for state.json holds no size: --resume auto says so and takes the one before; named, the
    checkpoint is refused in one sentence (it was a KeyError's traceback)."""
    run = run_made_by_hand(tmp_path / "run", [1, 2])
    manifest = json.loads((run / "checkpoint-2" / "manifest.json").read_text())
    manifest["files"]["state.json"] = entry
    (run / "checkpoint-2" / "manifest.json").write_text(json.dumps(manifest))
    set_up(grpo, tiny_args("grpo.py", run, resume="auto"))
    printed = capsys.readouterr().out
    assert (
        f"--resume auto: skipping {run / 'checkpoint-2'}: its manifest.json gives no size for state.json\n" in printed
    )
    assert f"--resume auto: resuming from {run / 'checkpoint-1'}\n" in printed
    with pytest.raises(SystemExit) as refused:
        set_up(grpo, tiny_args("grpo.py", tmp_path / "new", resume=str(run / "checkpoint-2")))
    assert refused.value.code == (
        f"--resume '{run / 'checkpoint-2'}' is not a whole checkpoint: its manifest.json gives no size for "
        f"state.json; resume from {run / 'checkpoint-1'}, the newest whole checkpoint beside it."
    )


def test_a_damaged_checkpoint_is_not_counted_among_those_kept(tmp_path):
    """A run's folder as found: checkpoints 1 and 4 damaged, 2 whole. The save of checkpoint-3 keeps the two newest
    whole ones (--keep_checkpoints 2): 2 and 3 (by count, 3 and 4 were kept, one of them whole); checkpoint-1, older,
    goes; checkpoint-4 stays, counted for nothing, until the run saves over it."""
    run = run_made_by_hand(tmp_path / "run", [1, 2, 4])
    cut_in_half(run / "checkpoint-1" / "state.json")
    cut_in_half(run / "checkpoint-4" / "args.json")
    saved_by_hand(run / "checkpoint-3", 3, tiny_args("grpo.py", run, keep_checkpoints=2))
    assert sorted(os.listdir(run)) == ["checkpoint-2", "checkpoint-3", "checkpoint-4", "metrics.jsonl"]
    assert checkpoints.sound_checkpoints(str(run)) == [str(run / "checkpoint-3"), str(run / "checkpoint-2")]


GRPO_ONE_ITERATION = [
    "--total_episodes=8",
    "--rollout_batch_size=2",
    "--num_generations=4",
    "--minibatch_size=8",
    "--micro_batch_size=8",
    "--response_length=6",
    "--eval_every=0",
]


def test_a_checkpoint_damaged_in_place_is_refused_under_python_O(tmp_path):
    """Its check is plain code, not an assert (under -O an assert passes anything): a size that disagrees with the
    manifest's is refused there too."""
    stripped = subprocess.run([sys.executable, "-O", "-c", "assert False"], capture_output=True)
    assert stripped.returncode == 0  # -O does strip asserts here, so the check below would see one
    out = tmp_path / "run"
    run_script("grpo.py", out, *GRPO_ONE_ITERATION)  # a process of its own: the -O run below takes its folder's lock
    checkpoint = out / "checkpoint-1"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["state.json"]["bytes"] += 1  # state.json is no longer of the size recorded
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=2))
    cmd = [sys.executable, "-O", "grpo.py", "--output_dir", str(out), *GRPO_ONE_ITERATION, "--resume", str(checkpoint)]
    result = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"'{checkpoint}' is not a whole checkpoint: state.json is not of the size it was saved with" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- saves flushed, rotated, never non-finite


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


def test_rotation_removes_a_linked_checkpoint_not_its_target(tmp_path):
    out = tmp_path / "run"
    elsewhere = tmp_path / "elsewhere"
    run_main("grpo.py", out, *cli("grpo.py", total_episodes=16, save_every=1))  # checkpoint-1 and -2
    elsewhere.mkdir()
    shutil.move(out / "checkpoint-1", elsewhere / "checkpoint-1")
    os.symlink(elsewhere / "checkpoint-1", out / "checkpoint-1")
    rows, printed = run_main("grpo.py", out, *cli("grpo.py", total_episodes=32, save_every=1), "--resume=auto")
    assert len(rows) == 4
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == [
        "checkpoint-3",
        "checkpoint-4",
    ]
    assert (elsewhere / "checkpoint-1" / "manifest.json").exists()  # what the link pointed to is still there


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


@pytest.mark.parametrize("script", ["ppo.py"])  # the optimiser step is the plumbing's; ppo.py's steps the critic too
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


# The non-finite steps are the runtime's (optimizer_step, stop_if_asked, finish), the same for every script: one script
# shows both endings. rloo.py, whose reward model gives the first step a gradient of its own (grpo.py's rule scores
# the tiny policy's responses all 0: its first step would come from the rounding of its KL term alone).
@pytest.mark.parametrize("steps", ["several", "one"])
def test_a_learning_rate_of_1e9_never_ends_with_a_broken_policy_saved(steps, tmp_path, keep_signal_handlers):
    """The first step takes every weight to about 1e9 (finite, but the logits are nan from then on). In two epochs of
    two minibatches the run takes four steps an iteration, so three non-finite ones in a row stop it at the end of its
    first; in one step an iteration, the run ends after a single bad step: the final save refuses the policy."""
    script = "rloo.py"
    several = dict(minibatch_size=4, micro_batch_size=4, num_epochs=2) if steps == "several" else {}
    message = (
        "3 optimiser steps in a row had a non-finite loss or gradient \\(iteration 1\\)"
        if several
        else "the last 1 optimiser step\\(s\\) had a non-finite loss or gradient, so the policy is not saved"
    )
    with pytest.raises(SystemExit, match=message):
        MODULES[script].main(args_for(script, tmp_path, total_episodes=16, learning_rate=1e9, save_every=1, **several))
    assert not (tmp_path / "model.safetensors").exists()
    for checkpoint in checkpoints.checkpoints_in(str(tmp_path)):  # what was written is finite
        assert all(torch.isfinite(w).all() for w in checkpointed(checkpoint)["policy"]["model"].values())


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
    assert checkpoints.checkpoint_problem(str(out / "checkpoint-3")) is None


@pytest.mark.parametrize("saved", [[], ["--lora_r=4", "--save_adapters_only"]], ids=["policy", "adapters"])
def test_the_saved_policy_has_the_mode_of_the_runs_other_files(saved, tmp_path):
    """safetensors writes through a temporary file of mode 0600: under umask 022 the policy's model.safetensors (or
    --save_adapters_only's adapter_model.safetensors) must be readable by others as every other file of the run is."""
    umask = os.umask(0o022)
    try:
        run_main("grpo.py", tmp_path, *cli("grpo.py", total_episodes=8), *saved)
    finally:
        os.umask(umask)
    mode = (tmp_path / "args.json").stat().st_mode
    assert mode & 0o777 == 0o644
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert any(path.suffix == ".safetensors" for path in files)
    assert {str(path): oct(path.stat().st_mode) for path in files} == {str(path): oct(mode) for path in files}


# ---------------------------------------------------------------- one run per folder: the lock, taken first


def test_a_second_run_into_a_busy_folder_is_refused_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    first = launch("grpo.py", out, cli("grpo.py", total_episodes=48))
    wait_for(lambda: os.path.exists(out / "metrics.jsonl") and os.path.getsize(out / "metrics.jsonl") > 0, first)
    first.send_signal(signal.SIGSTOP)  # still running, frozen while the second tries: the folder cannot change
    before = {name: (out / name).read_bytes() for name in os.listdir(out) if os.path.isfile(out / name)}
    second = finished(script_command("grpo.py", out, cli("grpo.py", total_episodes=48, learning_rate=1e-3)))
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
    assert len(read_rows(out)) == 6


def test_a_lock_left_by_a_process_that_ended_is_taken_over_and_said(tmp_path):
    """A run killed with -9 holds no lock any more (the system let it go), and its file still names it."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.lock").write_text(f"process 4194999 on {os.uname().nodename}")
    rows, printed = run_main("grpo.py", out, *cli("grpo.py", total_episodes=16))
    assert f"process 4194999 on {os.uname().nodename} has ended; this run takes the folder over" in printed
    assert len(rows) == 2


def test_a_run_refused_the_folder_does_not_say_it_takes_it_over(tmp_path, capsys):
    """The lock of a process that ended, in a folder holding a run's checkpoint: a new run there is refused (it would
    mix with that run) and must not first say it takes the folder over; the run that goes on there says so."""
    out = tmp_path / "run"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "run.lock").write_text(f"process 4194999 on {os.uname().nodename}")
    with pytest.raises(SystemExit, match="holds the checkpoints of a run"):
        set_up(grpo, make_args(grpo, **{**TINY["grpo.py"], "output_dir": str(out)}))
    assert "has ended" not in capsys.readouterr().out
    (out / "checkpoint-3").rmdir()  # the folder made free: this run goes on
    rows, printed = run_main("grpo.py", out, *cli("grpo.py", total_episodes=8))
    assert f"process 4194999 on {os.uname().nodename} has ended; this run takes the folder over" in printed
    assert len(rows) == 1


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
        args = make_args(grpo, output_dir=str(out), resume="auto", eval_every=0)
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
        set_up(grpo, make_args(grpo, output_dir=str(out), eval_every=0))
    if os.geteuid() != 0:  # root writes any file
        (out / "run.lock").rmdir()
        (out / "run.lock").write_text("")
        (out / "run.lock").chmod(0o444)
        with pytest.raises(SystemExit, match="its run.lock cannot be opened for writing \\(Permission denied\\)"):
            set_up(grpo, make_args(grpo, output_dir=str(out), eval_every=0))


def test_a_run_lock_that_is_a_link_is_refused_and_what_it_names_left_whole(tmp_path):
    """run.lock a symbolic link to a file of the user's, or to none: refused in one sentence, the file left as it
    was and none created (before, the link was followed and the file it names emptied)."""
    (tmp_path / "notes.txt").write_text("a week of notes")
    for target in ("notes.txt", "nothing-here"):
        out = tmp_path / f"run-{target}"
        out.mkdir()
        (out / "run.lock").symlink_to(tmp_path / target)
        with pytest.raises(SystemExit, match="its run.lock cannot be opened for writing \\(it is a symbolic link, "):
            checkpoints.take_lock(str(out))
    assert (tmp_path / "notes.txt").read_text() == "a week of notes"
    assert not (tmp_path / "nothing-here").exists()


def test_a_run_lock_holding_bytes_that_are_not_text_is_taken_over_and_said(tmp_path):
    (tmp_path / "run.lock").write_bytes(b"\xff\xfe\x00garbage")
    lock, taken_over = checkpoints.take_lock(str(tmp_path))
    assert "garbage has ended; this run takes the folder over" in taken_over
    assert (tmp_path / "run.lock").read_text() == f"process {os.getpid()} on {os.uname().nodename}"
    lock.close()


def test_a_file_system_without_locks_is_said_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    def no_locks(fd, cmd, length):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(os, "lockf", no_locks)
    lock, _ = checkpoints.take_lock(str(tmp_path))
    assert (
        "this file system cannot lock (No locks available): a second run here would not be refused"
        in capsys.readouterr().out
    )
    assert (tmp_path / "run.lock").read_text() == f"process {os.getpid()} on {os.uname().nodename}"
    lock.close()


def test_ctrl_c_while_starting_is_one_line(monkeypatch, capsys):
    """Ctrl-C before the run's own handler is set (while the models load): one line and exit status 130, no
    KeyboardInterrupt traceback."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tyro, "cli", interrupted)
    monkeypatch.setattr(sys, "argv", ["grpo.py"])
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # runtime.launch sets the runs' own
    code = None
    try:
        runpy.run_path(os.path.join(ROOT, "grpo.py"), run_name="__main__")
    except KeyboardInterrupt:  # what python prints as a traceback
        pytest.fail("Ctrl-C while starting ended in a KeyboardInterrupt traceback")
    except SystemExit as e:
        code = e.code
    assert code == 130
    assert capsys.readouterr().err == "stopped by Ctrl-C while starting: nothing was saved\n"
