"""torchrun with FSDP2 (gloo, CPU): for each script, two processes compute what one process computes, with half the
model state each, and a run goes on from a checkpoint on another number of processes; the defaults run
under torchrun; a stop, a failing or hung reward on one process stops every process together, saves and says so
once; the collectives wait longer than a reward may.

Why two processes agree with one:
- every random draw of an iteration comes from one generator seeded by (seed, iteration) and drawn in full on every
  process: the uniforms that sample each response (a row per response; each process takes its rows) and the
  permutations that make the minibatches of the global rollout;
- prompts are left-padded to the width of the global batch and responses right-padded to the longest anywhere, and
  the rollout is gathered, so each process computes its share of the same global minibatches; its loss is its share
  of the global loss, and FSDP2 sums the gradients;
- whatever the algorithm takes over the batch (whitening, score moments, group statistics, the KL, the dashboard) is
  all-reduced; evaluation gives each process a contiguous share of the held-out prompts with their own draws.
What is left is float32 rounding (matrix products over 8 rows rather than 16, sums in another order), so the logged
values agree to 1e-5 of the size of the terms they are made of (tests/helpers.py derives the rule, assert_rows_agree):
relative where the terms share a sign; absolute for the loss, the advantages, the scores and the values, whose terms,
of size about one, nearly cancel; of length x entropy nats for the KL and the terms made of it; and 1e-5 x sqrt(N)
relative for the largest ratio, one token's of the iteration's N. The weights agree to 1e-5.
Not compared: time/*, memory/* (it is what must differ) and policy/first_ratio_dev (the first micro-batch of rank 0,
which is another micro-batch than the single process's first)."""

import datetime
import json
import logging
import os
import shlex
import shutil
import signal
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
    ARITHMETIC_TRAIN,
    MODULES,
    ROOT,
    TORCHRUN,
    assert_bitwise_equal,
    assert_rows_agree,
    assert_same_model,
    cli,
    common,
    failing_reward,
    final_state,
    finished,
    launch,
    make_args,
    read_rows,
    run_main,
    run_torchrun,
    script_command,
    torchrun,
    wait_for,
    without_timing,
)
from transformers import AutoConfig

from rlhf_runtime import checkpoints
from rlhf_runtime import processes as runtime_processes
from rlhf_runtime.settings import RunSettings

# Per script: what two processes must agree on is each algorithm's own math over the batch (its advantages, its
# statistics, its models), which the runtime's gathers and means serve but do not make (dapo.py's: test_dapo.py).
SCRIPTS = ["ppo.py", "grpo.py", "rloo.py"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, held_out):
    """Each script once on one process (in this process) and once on two (computed once per script)."""
    done = {}

    def get(script):
        if script not in done:
            one = tmp_path_factory.mktemp("one")
            two = tmp_path_factory.mktemp("two")
            rows_one, _ = run_main(script, one, *common(script, held_out))
            done[script] = (one, rows_one, two, run_torchrun(script, two, *common(script, held_out)))
        return done[script]

    return get


@pytest.mark.parametrize("script", SCRIPTS)
def test_two_processes_compute_what_one_computes(script, runs):
    one, rows_one, two, rows_two = runs(script)
    assert_rows_agree(rows_two, rows_one)
    assert "policy/kl_term" in rows_one[-1] or "objective/kl" in rows_one[-1]  # the KL is among what was compared
    assert_same_model(two, one)  # the saved policy, gathered from the shards, loads with from_pretrained
    assert AutoConfig.from_pretrained(str(two)).architectures == ["LlamaForCausalLM"]  # not the FSDP wrapper's class


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_process_holds_about_half_the_model_state(script, runs):
    """Parameters of every model plus Adam states, counted over the local shards of rank 0 (FSDP2 pads a shard by
    at most one row of a weight)."""
    _, rows_one, _, rows_two = runs(script)
    ratio = rows_two[-1]["memory/model_states_mb"] / rows_one[-1]["memory/model_states_mb"]
    assert 0.45 <= ratio <= 0.55


@pytest.mark.parametrize(
    "script,flags",
    [
        ("ppo.py", ["--lora_r=4", "--lora_alpha=8"]),
        ("ppo.py", ["--shared_backbone"]),
        (
            "grpo.py",
            [
                "--policy_loss=gspo",
                "--loss_aggregation=sequence_mean",
                "--clip_range_low=3e-4",
                "--clip_range_high=4e-4",
            ],
        ),
        (
            "rloo.py",
            [
                "--decode=plain",
                "--lora_r=4",
                "--lora_alpha=8",
                "--policy_loss=cispo",
                "--clip_range_low=1",
                "--mask_truncated",
            ],
        ),
    ],
    ids=["ppo-lora", "ppo-shared-backbone", "grpo-gspo", "rloo-plain-decode-lora-cispo-mask-truncated"],
)
def test_two_processes_compute_what_one_computes_with_other_options(script, flags, held_out, tmp_path):
    """The same agreement with adapters (peft's layers inside FSDP2's units, the reference as the policy with its
    adapters off, the merged save gathered from the shards; in ppo.py's policy and critic, the one loading code every
    script shares), with the value head on the policy's sharded trunk, with --decode plain (what auto is under
    torchrun: the policy held whole while it samples), and with GSPO's ratio per response and CISPO's clipped weights
    (cut-off responses left out). Options of one script that one run can carry share it."""
    one = tmp_path / "one"
    two = tmp_path / "two"
    rows_one, _ = run_main(script, one, *common(script, held_out), *flags)
    assert_rows_agree(run_torchrun(script, two, *common(script, held_out), *flags), rows_one)
    assert_same_model(two, one)
    if "--mask_truncated" in flags:  # some responses were cut off and left out
        assert any(r["response/truncated_left_out"] > 0 for r in rows_one[1:])


def test_a_run_goes_on_from_a_checkpoint_on_another_number_of_processes(runs, held_out, tmp_path):
    """The two-process run's checkpoint after iteration 2 (sharded in two), resumed on one process, ends as the
    one-process run does."""
    one, rows_one, two, _ = runs("rloo.py")
    out = tmp_path / "resumed"
    rows, _ = run_main("rloo.py", out, *common("rloo.py", held_out), f"--resume={two / 'checkpoint-2'}")
    assert_rows_agree(rows, rows_one)
    assert_same_model(out, one)


# ---------------------------------------------------------------- torchrun with the defaults


@pytest.mark.parametrize("script", ["ppo.py"])
def test_the_defaults_run_under_torchrun_on_two_processes(script, tmp_path):
    """ppo.py's defaults (its critic, four epochs of four minibatches) for one rollout under torchrun; each script's
    default micro-batch, above its per-process minibatch on two processes, is one micro-batch for each number of
    processes below (validate is what would rewrite it; the loop over micro-batches is the plumbing's)."""
    per_rollout = {"ppo.py": 64, "grpo.py": 256, "rloo.py": 64}[script]
    done = torchrun(script, tmp_path, f"--total_episodes={per_rollout}", "--eval_every=0")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["iteration"] for r in rows] == [1]
    # the default --micro_batch_size, above the per-process minibatch, is one micro-batch: kept as given, not rewritten
    assert json.load(open(tmp_path / "args.json"))["micro_batch_size"] == MODULES[script].Args().micro_batch_size


@pytest.mark.parametrize("processes", [1, 2, 4, 8])
@pytest.mark.parametrize("script", list(MODULES))  # each script's own defaults and validate (no model loads)
def test_the_defaults_pass_the_checks_on_1_to_8_processes(script, processes, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # a process other than rank 0 says nothing
    args = make_args(MODULES[script], output_dir=str(tmp_path / "run"), world_size=processes)
    MODULES[script].validate(args)  # a micro-batch past the per-process minibatch is one micro-batch
    assert args.micro_batch_size == MODULES[script].Args.micro_batch_size  # as given: never rewritten


def test_a_stopping_message_under_torchrun_is_printed_once_on_its_own_line(tmp_path):
    done = torchrun("ppo.py", tmp_path / "run", "--temperature=0")
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "--temperature must be positive" in line]
    assert lines == ["--temperature must be positive (got 0.0)."]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- stops, failures and hangs on one process of two


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


def test_a_stopped_and_resumed_torchrun_run_is_the_same_run(tmp_path, runs, held_out):
    """Two processes (gloo, FSDP2): each writes its own shards of the models and optimiser states; torchrun passes
    SIGTERM on to both, and the command they print resumes the run: it ends as rloo.py's two-process run above, never
    stopped, to its Adam states."""
    _, _, full, _ = runs("rloo.py")
    args = common("rloo.py", held_out)
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
    assert without_timing(read_rows(out)) == without_timing(read_rows(full))
    assert_bitwise_equal(final_state(out, 3), final_state(full, 3))


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
    assert checkpoints.checkpoint_problem(str(out / "checkpoint-1")) is None
    assert sorted(os.listdir(out / "checkpoint-1")) == TWO_PROCESS_CHECKPOINT
    assert json.load(open(out / "checkpoint-1" / "state.json"))["iteration"] == 1


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
    assert not checkpoints.checkpoint_problem(str(out / "checkpoint-1"))


def test_the_collectives_wait_twice_the_reward_timeout_and_a_checkpoint(monkeypatch):
    """Under torchrun the process group's timeout is 2 x --reward_timeout + CHECKPOINT_S (NCCL's default of 10
    minutes is the default --reward_timeout itself), on gloo as on NCCL; with no reward timeout, a week."""
    seen = []

    def init_process_group(backend, timeout):
        seen.append((backend, timeout))

    monkeypatch.setattr(runtime_processes.dist, "init_process_group", init_process_group)
    monkeypatch.setenv("WORLD_SIZE", "1")
    for reward_timeout in (600.0, 3.0, 0.0):
        runtime_processes.start_processes(RunSettings(reward_timeout=reward_timeout))
    assert runtime_processes.CHECKPOINT_S >= 600
    assert seen == [
        ("gloo", datetime.timedelta(seconds=1200 + runtime_processes.CHECKPOINT_S)),
        ("gloo", datetime.timedelta(seconds=6 + runtime_processes.CHECKPOINT_S)),
        ("gloo", datetime.timedelta(days=7)),
    ]


def test_a_hung_rank_saves_on_both_within_the_collective_timeout(tmp_path):
    """Under torchrun the grader hangs on rank 1 only, at its second call: rank 1's alarm makes it a reward failure,
    and the stop reaches rank 0 too. Both save checkpoint-1 (the state before the hung rollout), and rank 0 names the
    timeout and prints the torchrun command that goes on. And the rule, with a checkpoint allowed 30 s (grpo.py copied
    beside a copy of rlhf_runtime/ whose processes.py has CHECKPOINT_S = 30): rank 0 waits in the stop check's
    all_reduce for about --reward_timeout (3 s); the group's 36 s outlast that wait, and the run ends with the command
    that goes on, not with gloo's timeout. (One run for what were two tests,
    test_a_reward_hung_on_one_process_stops_both_at_its_timeout and this one.)"""
    project = tmp_path / "project"  # grpo.py and its runtime beside the repository's assets and kernels
    project.mkdir()
    for name in ("assets", "rlhf_kernels"):
        os.symlink(os.path.join(ROOT, name), project / name)
    script = str(project / "grpo.py")
    shutil.copy(os.path.join(ROOT, "grpo.py"), script)  # a copy, not a link: python imports from the file's own folder
    shutil.copytree(
        os.path.join(ROOT, "rlhf_runtime"), project / "rlhf_runtime", ignore=shutil.ignore_patterns("__pycache__")
    )
    timing = project / "rlhf_runtime" / "processes.py"
    text = timing.read_text()
    assert "\nCHECKPOINT_S = 1200 " in text
    timing.write_text(text.replace("\nCHECKPOINT_S = 1200 ", "\nCHECKPOINT_S = 30 "))
    out = tmp_path / "run"
    started = time.time()
    result = torchrun(script, out, *hangs_on_rank_1(tmp_path), "--reward_timeout=3")
    assert result.returncode != 0
    assert "stopped after iteration 1; to go on:\n  torchrun --nproc_per_node=2 " in result.stdout, result.stderr[
        -3000:
    ]
    assert "is an error (TimeoutError: no answer within --reward_timeout 3 s)" in result.stderr, result.stderr[-3000:]
    assert "Timed out" not in result.stderr
    assert os.listdir(out / "checkpoint-1")
    assert not checkpoints.checkpoint_problem(str(out / "checkpoint-1"))
    assert time.time() - started < 120


# ---------------------------------------------------------------- what a failing test's report shows


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a save in one process, as intended
def test_a_checkpoints_debug_records_stay_out_of_a_failing_tests_report(caplog, tmp_path):
    """torch sets its checkpoint logger to DEBUG, and it logs the start and end of each step of a save and a load;
    pytest's log_level (pyproject.toml) keeps a failing test's report to WARNING and above. caplog holds what the
    report would show: of a save, a load and one warning on that logger, the warning alone."""
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "checkpoint", no_dist=True)
    dcp.load({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "checkpoint", no_dist=True)
    logging.getLogger("c10d-NullHandler-dcp_logger").warning("a warning is still shown")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", "a warning is still shown")]
