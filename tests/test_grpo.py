"""grpo.py against independent references: the seed's worked example, plain loops, hand computations, and the
definitions of the KL estimators."""

import math
import os

import pytest
import torch
from helpers import GROUPS_OF_EIGHT, ROOT, constant_reward, make_args, run_main
from transformers import AutoModelForCausalLM

import grpo
import rloo


def test_seed_worked_example():
    # The seed: rewards 1, 0, 0, 1 from a checker give +1, -1, -1, +1 (population std 0.5).
    advantages = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, "group")
    assert advantages.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-6)


def advantages_loop(scores, G, mode):
    """The definition, one group at a time, in Python floats."""
    out = []
    everything = scores
    batch_mean = sum(everything) / len(everything)
    batch_std = math.sqrt(sum((x - batch_mean) ** 2 for x in everything) / len(everything))
    for g in range(0, len(scores), G):
        group = scores[g : g + G]
        mean = sum(group) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / G)
        scale = {"group": std, "batch": batch_std, "none": None}[mode]
        out += [(x - mean) / (scale + 1e-8) if scale is not None else x - mean for x in group]
    return out


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
@pytest.mark.parametrize("G", [2, 4, 8])
def test_group_advantages_match_plain_loop(mode, G):
    g = torch.Generator().manual_seed(G)
    scores = torch.randn(5 * G, generator=g, dtype=torch.float64)
    scores[:G] = 0.5  # one zero-signal group: its advantages are exactly 0 in every mode
    got = grpo.group_advantages(scores, G, mode)
    assert got.tolist() == pytest.approx(advantages_loop(scores.tolist(), G, mode), rel=1e-9, abs=1e-9)
    assert got[:G].abs().max() == 0


def test_zero_signal_groups():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    assert grpo.zero_signal_groups(scores, 4).tolist() == [False, True, True]
    assert grpo.group_advantages(scores, 4, "group")[4:].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["group", "batch", "none"])
@pytest.mark.parametrize("value", [0.1, 0.3, 1.3, 13.02])
def test_an_all_equal_group_has_advantage_zero_in_every_mode_and_dtype(value, mode, dtype):
    # one group of the value, one group with spread, one more equal group: the reference is exactly 0 on the equal ones
    scores = torch.tensor([value] * 8 + [0.0, 1.0, 0.5, 0.25, 1.0, 0.0, 0.75, 0.5] + [1.0] * 8, dtype=dtype)
    got = grpo.group_advantages(scores, 8, mode)
    expected = torch.tensor(advantages_loop([float(v) for v in scores], 8, mode), dtype=torch.float64)
    assert (got[:8] == 0).all(), got
    assert (got[16:] == 0).all(), got
    assert torch.allclose(got.double(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
    one_group = grpo.group_advantages(torch.tensor([value] * 8, dtype=dtype), 8, mode)
    assert (one_group == 0).all()
    loo = rloo.rloo_advantages(scores, 8)
    assert (loo[:8] == 0).all()
    assert (loo[16:] == 0).all()


# ---------------------------------------------------------------- loss aggregation

LENGTHS = [1, 3, 2]
T = 4


def ragged():
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    # 9s are padding
    losses = torch.tensor(
        [[2.0, 9, 9, 9], [1.0, 4.0, 7.0, 9], [3.0, 5.0, 9, 9]], dtype=torch.float64, requires_grad=True
    )
    return losses, mask


@pytest.mark.parametrize(
    "aggregation,expected",
    [
        ("token_mean", (2 + 1 + 4 + 7 + 3 + 5) / 6),  # one mean over the 6 valid tokens
        ("sequence_mean", (2 / 1 + (1 + 4 + 7) / 3 + (3 + 5) / 2) / 3),  # the mean of the 3 responses' means
        ("constant", (2 + 1 + 4 + 7 + 3 + 5) / (3 * T)),  # the token sum over 3 x response_length
    ],
)
def test_aggregation_by_hand(aggregation, expected):
    losses, mask = ragged()
    weights = grpo.loss_weights(mask, aggregation, T, num_sequences=3, num_tokens=6)
    assert (losses * weights).sum().item() == pytest.approx(expected, rel=1e-12)
    # Micro-batches that use the minibatch's counts add up to the same loss.
    halves = sum(
        (losses[s] * grpo.loss_weights(mask[s], aggregation, T, 3, 6)).sum() for s in (slice(0, 1), slice(1, 3))
    )
    assert halves.item() == pytest.approx(expected, rel=1e-12)


def test_aggregation_gradient_weights_long_and_short_responses():
    grads = {}
    for aggregation in ("token_mean", "sequence_mean", "constant"):
        losses, mask = ragged()
        (losses * grpo.loss_weights(mask, aggregation, T, 3, 6)).sum().backward()
        grads[aggregation] = losses.grad
        assert losses.grad[mask == 0].abs().max() == 0  # padding never gets a gradient
    short = (0, 0)  # a token of the 1-token response
    long = (1, 0)  # a token of the 3-token response
    assert grads["token_mean"][short] == grads["token_mean"][long] == pytest.approx(1 / 6)
    assert grads["constant"][short] == grads["constant"][long] == pytest.approx(1 / 12)
    # 3x longer, 3x less per token
    assert grads["sequence_mean"][long] == pytest.approx(grads["sequence_mean"][short] / 3)


# ---------------------------------------------------------------- the KL term


def test_kl_estimators_match_their_formulas():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(50, generator=g, dtype=torch.float64) * 5
    logp_ref = -torch.rand(50, generator=g, dtype=torch.float64) * 5
    for estimator, formula in (
        ("k1", lambda a, b: a - b),
        ("k2", lambda a, b: 0.5 * (a - b) ** 2),
        ("k3", lambda a, b: math.exp(b - a) - (b - a) - 1),
    ):
        got = grpo.kl_penalty(logp, logp_ref, estimator)
        assert got.tolist() == pytest.approx(
            [formula(a, b) for a, b in zip(logp.tolist(), logp_ref.tolist())], rel=1e-12, abs=1e-12
        )
    assert (grpo.kl_penalty(logp, logp_ref, "k3") >= 0).all()
    assert (grpo.kl_penalty(logp, logp_ref, "k1") < 0).any()


def test_k3_and_k1_are_unbiased_on_samples_from_the_policy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(12, generator=g, dtype=torch.float64)
    # a reference close to the policy, as in RLHF, where k3 has the lower variance
    p = torch.softmax(logits, 0)
    q = torch.softmax(logits + 0.3 * torch.randn(12, generator=g, dtype=torch.float64), 0)
    true_kl = (p * (p / q).log()).sum().item()
    tokens = torch.multinomial(p, 400_000, replacement=True, generator=g)
    logp = p.log()[tokens]
    logp_ref = q.log()[tokens]
    for estimator in ("k1", "k3"):
        assert grpo.kl_penalty(logp, logp_ref, estimator).mean().item() == pytest.approx(true_kl, rel=0.02)
    # why GRPO takes k3
    assert grpo.kl_penalty(logp, logp_ref, "k3").var() < grpo.kl_penalty(logp, logp_ref, "k1").var()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_ignore_pads_of_any_log_prob(estimator):
    logprobs = torch.tensor([[-0.5, -1.2, -1e4, -1e4], [-2.0, -1e4, -1e4, -1e4]], requires_grad=True)
    logprobs_ref = torch.tensor([[-0.7, -1.0, 0.0, 0.0], [-1.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    kl = grpo.kl_penalty(logprobs, logprobs_ref, estimator, mask)
    total = (kl * mask).sum()
    total.backward()
    expected = 0.0  # the valid tokens alone, by hand
    for lp, ref in ((-0.5, -0.7), (-1.2, -1.0), (-2.0, -1.5)):
        log_r = ref - lp
        expected += {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": torch.tensor(log_r).expm1().item() - log_r}[estimator]
    assert torch.isfinite(total)
    assert total.item() == pytest.approx(expected, rel=1e-6)
    assert torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[mask == 0] == 0).all()


# ---------------------------------------------------------------- the clipped surrogate with two epsilons


@pytest.mark.parametrize(
    "ratio,advantage,objective",
    [
        (1.35, 2.0, 1.25 * 2.0),  # above 1 + eps_high: clipped there, no gradient
        (1.22, 2.0, 1.22 * 2.0),  # inside [0.8, 1.25]: not clipped, though 1.22 > 1 + eps_low
        (0.60, -2.0, 0.8 * -2.0),  # below 1 - eps_low with a negative advantage: clipped
        (1.35, -2.0, 1.35 * -2.0),  # moved the wrong way: the full gradient pushes it back, whatever the epsilons
    ],
)
def test_clip_higher(ratio, advantage, objective):
    logp_old = torch.tensor([-1.0], dtype=torch.float64)
    logp = (logp_old + math.log(ratio)).requires_grad_(True)
    loss, _, _ = grpo.clip_loss(logp, logp_old, torch.tensor([advantage], dtype=torch.float64), 0.2, 0.25)
    assert -loss.item() == pytest.approx(objective)
    loss.sum().backward()
    assert (logp.grad.abs().item() > 0) == (objective == pytest.approx(ratio * advantage))


# ---------------------------------------------------------------- set-up and the script end to end


def args_with(**kw):
    return make_args(grpo, **{"model_name_or_path": os.path.join(ROOT, "assets", "tiny-sft"), **kw})


def test_kl_coef_zero_loads_no_reference():
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
    policy, ref_policy, reward_models = grpo.build_models(args_with(kl_coef=0.0), tokenizer, torch.device("cpu"))
    assert ref_policy is None
    assert reward_models == []
    _, ref_policy, _ = grpo.build_models(args_with(kl_coef=0.04), tokenizer, torch.device("cpu"))
    assert not any(p.requires_grad for p in ref_policy.parameters())


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(num_generations=1), "--num_generations must be at least 2"),
        (
            dict(rollout_batch_size=4, num_generations=6, minibatch_size=16),
            "must divide the 24 responses per iteration",
        ),
        (dict(clip_range_high=0.0), "--clip_range_high must be positive"),
        (dict(kl_coef=-1.0), "--kl_coef must be zero or more"),
    ],
)
def test_bad_arguments(kw, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        grpo.validate(args_with(output_dir=str(tmp_path / "run"), **kw))


def run_grpo(tmp_path, *extra):
    out = tmp_path / "run"
    rows, _ = run_main("grpo.py", out, *GROUPS_OF_EIGHT, "--total_episodes=64", *extra)  # two iterations
    return out, rows


def moved(out):
    trained = AutoModelForCausalLM.from_pretrained(out)
    start = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
    return sum((a - b).abs().sum().item() for a, b in zip(trained.parameters(), start.parameters()))


def test_smoke_run_on_embedded_default(tmp_path):
    out, rows = run_grpo(tmp_path)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    # SFT: greedy beats sampling
    assert 0.0 <= rows[0]["eval/score"] <= 1.0
    assert rows[0]["eval/score_greedy"] > rows[0]["eval/score"]
    for r in rows[1:]:
        for key in (
            "objective/score",
            "objective/rule_reward",
            "objective/kl",
            "objective/group_reward_std",
            "adv/zero_signal_fraction",
            "policy/entropy",
            "policy/clipfrac",
            "policy/kl_term",
            "response/length",
            "grad_norm/policy",
        ):
            assert math.isfinite(r[key]), key
        # the rule alone: the score is the rule reward, the exact-match accuracy
        assert r["objective/score"] == r["objective/rule_reward"]
        assert r["policy/first_ratio_dev"] < 1e-4  # logprobs_old recorded while sampling
        assert not any(k.startswith("val/") for k in r)  # no critic
    assert rows[1]["objective/kl"] == pytest.approx(0.0, abs=1e-4)
    assert moved(out) > 0


def test_zero_signal_groups_are_left_out_of_the_update(tmp_path):
    # A reward that never varies makes every group zero-signal. An entropy bonus still moves the policy, unless those
    # groups are dropped, in which case no step is taken. (Near-greedy sampling made them zero-signal before, but its
    # entropy, at T = 0.01, has no gradient in float32: the policy moved then only by AdamW's weight decay, now off.)
    common = ("--reward_fn", constant_reward(tmp_path), "--ent_coef=0.01", "--kl_coef=0", "--total_episodes=32")
    out, rows = run_grpo(tmp_path / "kept", *common)
    assert rows[1]["adv/zero_signal_fraction"] == 1.0
    assert moved(out) > 0
    out, rows = run_grpo(tmp_path / "dropped", *common, "--drop_zero_signal_groups")
    assert rows[1]["adv/zero_signal_fraction"] == 1.0
    assert moved(out) == 0
    assert "objective/kl" not in rows[1]  # --kl_coef 0: no reference, so no KL to report
