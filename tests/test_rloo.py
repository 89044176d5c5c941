"""rloo.py against independent references: the leave-one-out baseline as a plain loop, its closed form, the
KL-shaped reward by hand, and REINFORCE against the clipped loss at ratio 1."""

import math

import pytest
import torch
from helpers import run_main

import rloo


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_leave_one_out_matches_plain_loop(k):
    g = torch.Generator().manual_seed(k)
    rewards = torch.randn(6 * k, generator=g, dtype=torch.float64)
    expected = []
    for start in range(0, len(rewards), k):
        group = rewards[start : start + k].tolist()
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :]
            expected.append(r - sum(others) / len(others))
    got = rloo.rloo_advantages(rewards, k)
    assert got.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # the identity: r_i - mean of the others = k / (k - 1) * (r_i - mean of the group)
    grouped = rewards.view(-1, k)
    assert got.tolist() == pytest.approx(
        (k / (k - 1) * (grouped - grouped.mean(1, keepdim=True))).reshape(-1).tolist(), rel=1e-12, abs=1e-12
    )


def test_kl_shaped_rewards_by_hand():
    # Two responses of lengths 3 and 1 (T = 3); beta = 0.1.
    logprobs_old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -9.0, -9.0]])
    logprobs_ref = torch.tensor([[-1.5, -1.0, -0.7], [-0.1, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    rewards, kl = rloo.kl_shaped_rewards(torch.tensor([2.0, -1.0]), logprobs_old, logprobs_ref, mask, 0.1)
    # KL of the first: (0.5) + (-1.0) + (0.2) = -0.3 nats; of the second: -0.2 (padding never counts)
    assert kl.tolist() == pytest.approx([-0.3, -0.2])
    assert rewards.tolist() == pytest.approx([2.0 + 0.03, -1.0 + 0.02])


def test_reinforce_gradient_equals_clipped_gradient_at_ratio_one():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, generator=g, dtype=torch.float64)
    advantages = torch.randn(5, 1, generator=g, dtype=torch.float64)
    logprobs_old = torch.log_softmax(logits, -1)
    grads = []
    for reinforce in (True, False):
        logprobs = torch.log_softmax(logits, -1).requires_grad_(True)
        loss, ratio, _ = rloo.clip_loss(logprobs, logprobs_old, advantages, 0.2, 0.2)
        if reinforce:
            loss = -advantages * logprobs
        loss.sum().backward()
        grads.append(logprobs.grad)
        assert torch.allclose(ratio, torch.ones_like(ratio))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


def test_bad_arguments(tmp_path):
    args = rloo.Args(num_generations=1, output_dir=str(tmp_path / "run"))
    with pytest.raises(SystemExit, match="--num_generations must be at least 2"):
        rloo.validate(args)


def run_rloo(tmp_path, *extra):
    sizes = ["--rollout_batch_size=4", "--num_generations=4", "--minibatch_size=16", "--micro_batch_size=8"]
    return run_main("rloo.py", tmp_path / "run", *sizes, "--total_episodes=32", "--response_length=8", *extra)[0]


def test_smoke_run_on_embedded_default(tmp_path):
    rows = run_rloo(tmp_path)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert "eval/score" in rows[0]
    assert "eval/score" in rows[2]
    for r in rows[1:]:
        for key in (
            "objective/score",
            "objective/score_normalized",
            "objective/kl",
            "objective/rlhf_reward",
            "policy/entropy",
            "grad_norm/policy",
        ):
            assert math.isfinite(r[key]), key
        # one update per rollout: the ratio is 1
        assert r["policy/first_ratio_dev"] < 1e-4
        assert r["policy/clipfrac"] == 0.0
        assert not any(k.startswith("val/") for k in r)
    assert rows[1]["objective/kl"] == pytest.approx(0.0, abs=1e-4)


def test_several_updates_per_rollout_and_kl_in_loss(tmp_path):
    rows = run_rloo(tmp_path, "--num_epochs=2", "--minibatch_size=8", "--kl_in_loss")
    assert all(math.isfinite(r["policy/kl_term"]) for r in rows[1:])  # the k3 term is in the loss
    assert rows[1]["policy/ratio_max"] > 1.0  # later minibatches see a moved policy: the clipped loss is in use
