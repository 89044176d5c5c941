"""No signal, no change: a reward that never varies leaves the policy exactly where it started, in every script whose
loss or reward holds a KL term to the reference, and the zero-signal measures see such a run as it is.

Why it can hold exactly: with every score equal, every advantage is exactly 0; the reference's log-probs are computed
as the policy's (the same micro-batch beside the training forward, or the same chunks in rloo.py's KL-shaped reward,
and the LM head on a contiguous input), so the KL term of an unchanged policy and its gradient are exactly 0; AdamW
without weight decay then leaves every weight as it is. Before, float noise (about 1e-7) in the KL term's gradient and
AdamW's default decay moved the weights, and Adam's normalisation made full-size steps of them.
"""

import os

import pytest
import torch
from helpers import ROOT, constant_reward, run_script
from safetensors.torch import load_file

import rlhf_runtime
from rlhf_runtime.log import failure_alarms

TEN_ITERATIONS = [
    "--rollout_batch_size=2",
    "--num_generations=8",
    "--minibatch_size=16",
    "--micro_batch_size=4",  # micro-batches unlike the reference's chunks: the layout that showed the drift
    "--total_episodes=160",
    "--eval_every=0",
    "--save_every=0",
]


@pytest.mark.parametrize(
    "script, extra",
    [("grpo.py", []), ("dapo.py", ["--kl_coef=0.04"]), ("rloo.py", []), ("rloo.py", ["--kl_in_loss"])],
    ids=["grpo", "dapo-with-kl", "rloo", "rloo-kl-in-loss"],
)
def test_a_constant_reward_leaves_the_policy_at_the_reference(tmp_path, script, extra):
    out = tmp_path / "run"
    rows, _ = run_script(
        script, out, "--reward_fn", constant_reward(tmp_path), "--reward_model_path", *TEN_ITERATIONS, *extra
    )
    assert len(rows) == 10
    for row in rows:
        assert abs(row["objective/kl"]) < 1e-5  # the sampler's rounding against a forward's: about 1e-7 here
        assert row["adv/zero_signal_fraction"] == 1.0  # rloo.py: judged on the score, not on its KL shaping
        assert row["grad_norm/policy"] == 0.0
    start = load_file(os.path.join(ROOT, "assets", "tiny-sft", "model.safetensors"))
    end = load_file(out / "model.safetensors")
    changed = [name for name in start if not torch.equal(start[name], end[name])]
    assert changed == []


def test_ppo_sees_a_constant_score_as_every_score_equal(tmp_path):
    options = ["--rollout_batch_size=8", "--minibatch_size=8", "--total_episodes=16", "--eval_every=0"]
    rows, _ = run_script(
        "ppo.py", tmp_path / "run", "--reward_fn", constant_reward(tmp_path), "--reward_model_path", *options
    )
    # the float32 mean of eight 0.1s is not 0.1: the old test, mean((s - mean)^2) == 0, never saw them as equal
    assert [row["health/zero_signal"] for row in rows] == [1.0, 1.0]


def test_a_share_of_groups_is_exact_so_the_alarm_at_nine_tenths_fires():
    nine_of_ten = torch.tensor([True] * 9 + [False])
    share = rlhf_runtime.global_mean(nine_of_ten)
    assert share == 0.9  # float32's 0.9 is 0.8999999761..., under the alarm's 0.9
    state = {"first_entropy": None, "first_distinct2": None}
    fired = [failure_alarms({"health/zero_signal": share}, state, 1e9, 1.0, 0.0)["zero_signal"] for _ in range(10)]
    assert fired == [False] * 9 + [True]  # 10 iterations in a row
