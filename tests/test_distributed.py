"""torchrun with FSDP2 (gloo, CPU): for each script, two processes compute what one process computes, with half the
model state each, and a run goes on from a checkpoint on another number of processes.

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
values agree to 1e-5 relative, with a floor of 1e-6 absolute for values that are nearly cancelling sums, and the
weights to 1e-5. The KL and the terms made of it are differences of log-prob sums (about length x entropy nats per
response) that float32 holds to about 1e-7 of their size: they are compared to 1e-5 of that size, not of their own
(at the first iteration the policy is the reference and the KL is rounding alone).
Not compared: time/*, memory/* (it is what must differ) and policy/first_ratio_dev (the first micro-batch of rank 0,
which is another micro-batch than the single process's first)."""

import json
import math
import os

import pytest
import torch
from helpers import ROOT, run_script, torchrun
from transformers import AutoConfig, AutoModelForCausalLM

# Three iterations each; several minibatches and micro-batches per process, and a held-out set of 15 prompts in
# batches of 4 (the second process's share of 8 is topped up with an uncounted copy).
GROUPS = ["--rollout_batch_size=4", "--num_generations=8", "--minibatch_size=16", "--micro_batch_size=4"]
ARGS = {
    "ppo.py": ["--rollout_batch_size=16", "--minibatch_size=8", "--micro_batch_size=2", "--total_episodes=48"],
    "grpo.py": [*GROUPS, "--total_episodes=96"],
    "rloo.py": [*GROUPS, "--total_episodes=96"],
    "dapo.py": [*GROUPS, "--total_episodes=96"],  # tests/test_dapo.py runs it on two processes
}
SCRIPTS = ["ppo.py", "grpo.py", "rloo.py"]


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    runs = {}
    for task in ("reviews", "arithmetic"):
        path = tmp_path_factory.mktemp("held_out") / "test.jsonl"
        path.write_text("".join(open(os.path.join(ROOT, "assets", task, "test.jsonl")).readlines()[:15]))
        runs[task] = str(path)
    return runs


def common(script, held_out):
    task = "arithmetic" if script in ("grpo.py", "dapo.py") else "reviews"
    evaluation = ["--eval_every=1", "--eval_batch_size=4", f"--eval_dataset={held_out[task]}"]
    return [*ARGS[script], "--num_epochs=2", "--response_length=8", "--save_every=1", *evaluation]


def run_torchrun(script, out, *args):
    """Like run_script, on two processes: returns the rows of the run's metrics.jsonl."""
    result = torchrun(script, out, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_rows(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, held_out):
    """Each script once on one process and once on two (computed once per script)."""
    done = {}

    def get(script):
        if script not in done:
            one = tmp_path_factory.mktemp("one")
            two = tmp_path_factory.mktemp("two")
            rows_one, _ = run_script(script, one, *common(script, held_out))
            done[script] = (one, rows_one, two, run_torchrun(script, two, *common(script, held_out)))
        return done[script]

    return get


def read_rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def compared(rows):
    return [
        {k: v for k, v in r.items() if not k.startswith(("time/", "memory/")) and k != "policy/first_ratio_dev"}
        for r in rows
    ]


LOGPROB_DIFFERENCES = {
    "objective/kl",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "policy/kl_term",
    "policy/approx_kl",
}


def assert_rows_agree(got, expected):
    assert len(got) == len(expected) == 4  # the held-out row 0 and three iterations
    for a, b in zip(compared(got), compared(expected)):
        assert a.keys() == b.keys()
        logprob_scale = b.get("response/length", 0) * b.get("policy/entropy", 0)  # nats of log-prob per response
        for k in a:
            floor = max(1e-6, 1e-5 * logprob_scale) if k in LOGPROB_DIFFERENCES else 1e-6
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=floor), (
                f"iteration {a['iteration']} {k}: {a[k]} on two processes, {b[k]} on one"
            )


def assert_same_model(got, expected):
    a = AutoModelForCausalLM.from_pretrained(str(got)).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(expected)).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=k)


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
        ("grpo.py", ["--lora_r=4", "--lora_alpha=8"]),
        ("rloo.py", ["--decode=plain", "--lora_r=4", "--lora_alpha=8"]),
        (
            "grpo.py",
            [
                "--policy_loss=gspo",
                "--loss_aggregation=sequence_mean",
                "--clip_range_low=3e-4",
                "--clip_range_high=4e-4",
            ],
        ),
        ("rloo.py", ["--policy_loss=cispo", "--clip_range_low=1", "--mask_truncated"]),
    ],
    ids=[
        "ppo-lora",
        "ppo-shared-backbone",
        "grpo-lora",
        "rloo-plain-decode-lora",
        "grpo-gspo",
        "rloo-cispo-mask-truncated",
    ],
)
def test_two_processes_compute_what_one_computes_with_other_options(script, flags, held_out, tmp_path):
    """The same agreement with adapters (peft's layers inside FSDP2's units, the reference as the policy with its
    adapters off, the merged save gathered from the shards), with the value head on the policy's sharded trunk, with
    --decode plain (what auto is under torchrun: the policy held whole while it samples), and with GSPO's
    ratio per response and CISPO's clipped weights (cut-off responses left out)."""
    one = tmp_path / "one"
    two = tmp_path / "two"
    rows_one, _ = run_script(script, one, *common(script, held_out), *flags)
    assert_rows_agree(run_torchrun(script, two, *common(script, held_out), *flags), rows_one)
    assert_same_model(two, one)
    if "--mask_truncated" in flags:  # some responses were cut off and left out
        assert any(r["response/truncated_left_out"] > 0 for r in rows_one[1:])


def test_a_run_goes_on_from_a_checkpoint_on_another_number_of_processes(runs, held_out, tmp_path):
    """The two-process run's checkpoint after iteration 2 (sharded in two), resumed on one process, ends as the
    one-process run does."""
    one, rows_one, two, _ = runs("rloo.py")
    out = tmp_path / "resumed"
    rows, _ = run_script("rloo.py", out, *common("rloo.py", held_out), f"--resume={two / 'checkpoint-2'}")
    assert_rows_agree(rows, rows_one)
    assert_same_model(out, one)
