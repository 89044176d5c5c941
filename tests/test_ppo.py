"""ppo.py against independent references: plain loops, hand computations and the specification's worked examples
(the four-case clipping table, the KL example); its own arguments, its value head on the policy's trunk, and the
script end to end."""

import json
import math
import os

import pytest
import torch
from helpers import ROOT, left_padded_prompts, make_args, run_main, tiny_llama_config
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import ppo
import rlhf_runtime as runtime
from rlhf_runtime.log import distinct_n, failure_alarms


def prefix_mask(lengths, T):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()


# ---------------------------------------------------------------- advantages


def gae_loop(rewards, values, gamma, lam):
    """GAE for one sequence of valid tokens, written as the definition: A_t = sum_k (gamma lam)^k delta_{t+k}."""
    T = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < T else 0.0) - values[t] for t in range(T)]
    return [sum((gamma * lam) ** k * deltas[t + k] for k in range(T - t)) for t in range(T)]


@pytest.mark.parametrize("B,T", [(1, 1), (3, 7), (5, 16)])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_plain_loop(B, T, gamma, lam):
    g = torch.Generator().manual_seed(B * 100 + T)
    lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
    mask = prefix_mask(lengths, T)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages, returns = ppo.gae_advantages(rewards, values, mask, gamma, lam)
    for b, n in enumerate(lengths):
        expected = gae_loop(rewards[b, :n].tolist(), values[b, :n].tolist(), gamma, lam)
        assert advantages[b, :n].tolist() == pytest.approx(expected, rel=1e-10, abs=1e-10)
        assert returns[b, :n].tolist() == pytest.approx(
            [a + v for a, v in zip(expected, values[b, :n].tolist())], abs=1e-10
        )
        # whatever lies in the padding must not leak into the answer or be produced there
        assert advantages[b, n:].abs().sum() == 0
        assert returns[b, n:].abs().sum() == 0


def test_gae_ignores_padding_contents():
    mask = prefix_mask([2, 4], 4)
    rewards = torch.randn(2, 4)
    values = torch.randn(2, 4)
    garbage_r = rewards + 100 * (1 - mask)
    garbage_v = values - 50 * (1 - mask)
    a1, _ = ppo.gae_advantages(rewards, values, mask, 1.0, 0.95)
    a2, _ = ppo.gae_advantages(garbage_r, garbage_v, mask, 1.0, 0.95)
    torch.testing.assert_close(a1, a2)


def test_whitening_is_masked_and_per_batch():
    torch.manual_seed(0)
    lengths = [3, 6, 1, 5]
    mask = prefix_mask(lengths, 6)
    x = torch.randn(4, 6, dtype=torch.float64) * 3 + 2
    x_padded = x + 1000 * (1 - mask)  # padding values must not enter the statistics
    white = ppo.masked_whiten(x_padded, mask)
    valid = [v for b, n in enumerate(lengths) for v in x[b, :n].tolist()]
    mean = sum(valid) / len(valid)
    std = math.sqrt(sum((v - mean) ** 2 for v in valid) / len(valid))
    for b, n in enumerate(lengths):
        assert white[b, :n].tolist() == pytest.approx([(v - mean) / std for v in x[b, :n].tolist()], rel=1e-6)
        assert white[b, n:].abs().sum() == 0
    # Per batch: another batch is whitened with its own statistics, not a running global one.
    white2 = ppo.masked_whiten(x * 10, mask)
    torch.testing.assert_close(white2, white, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- the four-case clipping table of the specification


@pytest.mark.parametrize(
    "ratio,advantage,objective,has_gradient",
    [
        (1.35, +2.0, 2.40, False),  # good token, already boosted a lot: stop boosting
        (1.05, +2.0, 2.10, True),  # good token, moved little: keep boosting
        (0.60, -2.0, -1.60, False),  # bad token, already suppressed a lot: stop suppressing
        (1.35, -2.0, -2.70, True),  # bad token whose probability rose: full corrective gradient
    ],
)
def test_four_case_clipping_table(ratio, advantage, objective, has_gradient):
    logprobs = torch.tensor([math.log(ratio)], dtype=torch.float64, requires_grad=True)
    loss, rho, clipped = ppo.clip_loss(
        logprobs, torch.zeros(1, dtype=torch.float64), torch.tensor([advantage], dtype=torch.float64), 0.2, 0.2
    )
    assert -loss.item() == pytest.approx(objective, abs=1e-12)
    loss.sum().backward()
    if has_gradient:  # d(rho A)/d logp = rho A, the unclipped term's gradient
        assert -logprobs.grad.item() == pytest.approx(ratio * advantage, rel=1e-12)
        assert clipped.item() == 0
    else:
        assert logprobs.grad.item() == 0
        assert clipped.item() == 1


def test_value_loss_clipped_by_hand():
    values_old = torch.zeros(3)
    returns = torch.ones(3)
    values = torch.tensor([0.5, 0.1, 1.5], requires_grad=True)
    loss, clipped = ppo.value_loss(values, values_old, returns, 0.2)
    # 0.5: unclipped (0.5-1)^2 = 0.25, clipped to 0.2 -> 0.64: the larger, clipped, wins.
    # 0.1: inside the range, both 0.81.  1.5: unclipped 0.25, clipped to 0.2 -> 0.64.
    assert loss.tolist() == pytest.approx([0.64, 0.81, 0.64])
    assert clipped.tolist() == [1.0, 0.0, 1.0]
    loss.sum().backward()
    assert values.grad.tolist() == pytest.approx([0.0, 2 * (0.1 - 1), 0.0])


# ---------------------------------------------------------------- the specification's KL worked example


def net_objective(score, n_tokens, mean_log_ratio, beta):
    mask = torch.ones(1, n_tokens, dtype=torch.float64)
    logprobs_old = torch.full((1, n_tokens), mean_log_ratio, dtype=torch.float64)
    rewards, kl = ppo.per_token_rewards(
        torch.tensor([score], dtype=torch.float64), logprobs_old, torch.zeros_like(logprobs_old), mask, beta
    )
    # the tax on every token
    assert rewards[0, :-1].tolist() == pytest.approx([-beta * mean_log_ratio] * (n_tokens - 1))
    return rewards.sum().item(), kl.sum().item()


def test_kl_worked_example():
    aggressive, kl_a = net_objective(3.1, 200, 0.06, 0.1)
    conservative, kl_c = net_objective(2.4, 200, 0.015, 0.1)
    assert (kl_a, kl_c) == pytest.approx((12.0, 3.0))
    assert (aggressive, conservative) == pytest.approx((1.9, 2.1))
    assert conservative > aggressive
    aggressive, _ = net_objective(3.1, 200, 0.06, 0.02)
    conservative, _ = net_objective(2.4, 200, 0.015, 0.02)
    assert (aggressive, conservative) == pytest.approx((2.86, 2.34))
    assert aggressive > conservative


def test_score_lands_on_last_valid_token():
    mask = prefix_mask([2, 4], 5)
    rewards, _ = ppo.per_token_rewards(torch.tensor([1.0, -2.0]), torch.zeros(2, 5), torch.zeros(2, 5), mask, 0.1)
    assert rewards.tolist() == [[0, 1.0, 0, 0, 0], [0, 0, 0, -2.0, 0]]


# ---------------------------------------------------------------- controllers, running statistics and the dashboard


def test_adaptive_kl_controller():
    beta = 0.1
    assert ppo.adaptive_kl_coef(beta, 9.0, 6.0, 1000, 100) > beta  # KL above target: tighten the leash
    assert ppo.adaptive_kl_coef(beta, 3.0, 6.0, 1000, 100) < beta  # below target: loosen it
    assert ppo.adaptive_kl_coef(beta, 6.0, 6.0, 1000, 100) == beta
    # The proportional error is clipped at +-0.2: beta (1 + 0.2 * 100 / 1000).
    assert ppo.adaptive_kl_coef(beta, 600.0, 6.0, 1000, 100) == pytest.approx(0.1 * 1.02)
    assert ppo.adaptive_kl_coef(beta, 0.0, 6.0, 1000, 100) == pytest.approx(0.1 * 0.98)
    # the KL of a broken policy's rollout (nan, inf) leaves beta where it was, never nan
    assert [ppo.adaptive_kl_coef(beta, kl, 6.0, 1000, 100) for kl in (float("nan"), float("inf"))] == [beta, beta]


def test_running_moments_match_whole_stream():
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randn(n, generator=g, dtype=torch.float64) * s + m
        for n, s, m in [(7, 1, 0), (64, 3, 2), (1, 1, 5), (30, 0.5, -1)]
    ]
    mean = 0.0
    var = 1.0
    count = 0.0
    for i, b in enumerate(batches):
        mean, var, count = ppo.update_moments(mean, var, count, b.mean().item(), b.var(unbiased=False).item(), len(b))
        seen = torch.cat(batches[: i + 1])
        assert (mean, var, count) == pytest.approx(
            (seen.mean().item(), seen.var(unbiased=False).item(), len(seen)), rel=1e-10
        )


def test_failure_alarms_fire_on_their_signatures():
    """rlhf_runtime's alarms (every script's), at ppo.py's default thresholds (--alarm_kl, --alarm_clipfrac,
    --alarm_collapse)."""
    state = dict(first_entropy=None, first_distinct2=None, first_value_loss=None, value_loss_ema=None)
    run = ppo.Args().run

    def alarms(m, state):
        return failure_alarms(m, state, run.alarm_kl, run.alarm_clipfrac, run.alarm_collapse)

    healthy = {
        "iteration": 1,
        "objective/kl": 3.0,
        "policy/clipfrac": 0.05,
        "policy/entropy": 1.8,
        "response/distinct2": 0.5,
        "val/loss": 1.0,
        "health/zero_signal": 0.0,
    }
    assert not any(alarms(healthy, state).values())
    for i in range(2, 12):  # a falling value loss is healthy
        assert not any(alarms({**healthy, "iteration": i, "val/loss": 0.5}, state).values())
    sick = {
        "iteration": 12,
        "objective/kl": 25.0,
        "policy/clipfrac": 0.4,
        "policy/entropy": 0.8,
        "response/distinct2": 0.2,
        "val/loss": 0.5,
        "health/zero_signal": 1.0,
    }
    assert alarms(sick, state) == {
        "kl_explosion": True,
        "clip_fraction": True,
        "entropy_collapse": True,
        "value_divergence": False,
        "diversity_collapse": True,
        "zero_signal": False,  # after 10 such iterations in a row
    }
    for i in range(13, 40):  # a value loss that climbs past where it started
        fired = alarms({**healthy, "iteration": i, "val/loss": 3.0}, state)
    assert fired["value_divergence"]
    assert not fired["kl_explosion"]


def test_distinct_n_by_hand():
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 1) == 4 / 6
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 2) == 3 / 4
    assert distinct_n([[5, 5, 5, 5]], 2) == 1 / 3


# ---------------------------------------------------------------- bad input, before anything loads


def args_with(**kw):
    defaults = dict(
        model_name_or_path=os.path.join(ROOT, "assets", "tiny-sft"),
        reward_model_path=(os.path.join(ROOT, "assets", "tiny-rm"),),
        dataset=os.path.join(ROOT, "assets", "reviews", "train.jsonl"),
    )
    return make_args(ppo, **{**defaults, **kw})


@pytest.mark.parametrize(
    "kw,message",
    [
        # PPO's own arguments; the checks every script shares (rlhf_runtime.settings) are in test_commands.py
        (dict(rollout_batch_size=64, minibatch_size=24), "must divide the 64 responses per iteration"),
        (dict(clip_range=-0.2), "--clip_range must be positive"),
        (dict(value_learning_rate=0.0), "--value_learning_rate must be positive"),
        (dict(vf_coef=-0.1), "--vf_coef must be zero or more"),
        (dict(lam=1.5), r"--lam must lie in \[0, 1\]"),
        (dict(gamma=-0.1), r"--gamma must lie in \[0, 1\]"),
    ],
)
def test_bad_arguments_fail_with_one_sentence(kw, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        ppo.validate(args_with(**{"output_dir": str(tmp_path / "run"), **kw}))


# ---------------------------------------------------------------- the value head on the policy's trunk


def test_shared_backbone_values_come_from_the_policys_trunk_and_both_heads_learn():
    """--shared_backbone: V is the head applied to the policy's last hidden states (computed here apart); the combined
    loss gives gradients to the LM head, the trunk and the value head, and the value loss alone reaches the trunk."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(tiny_llama_config()).eval()
    critic = ppo.ValueHead(policy)
    assert [n for n, _ in critic.named_parameters()] == ["score.weight"]  # the trunk is the policy's, not a copy
    with torch.no_grad():
        critic.score.weight.normal_()
    input_ids, attention_mask = left_padded_prompts([5, 9, 7], 40, seed=5)
    values = runtime.head_outputs(critic, input_ids, attention_mask)
    with torch.no_grad():
        hidden = policy.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=runtime.position_ids_from(attention_mask)
        ).last_hidden_state
    torch.testing.assert_close(values, (hidden @ critic.score.weight.T).squeeze(-1), atol=1e-5, rtol=1e-5)
    (values * attention_mask).sum().backward()  # the value loss alone
    assert policy.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
    assert policy.lm_head.weight.grad is None
    policy.zero_grad()
    critic.zero_grad()
    # In training the head reads the trunk's output of the log-prob forward: the same values, one trunk pass for both
    # heads. That forward runs the LM head on the positions the response's tokens are predicted from alone (P - 1 on).
    logprobs = ppo.response_logprobs(policy, input_ids, attention_mask, 3, 1.0)
    reused = critic(hidden=critic.trunk_output).squeeze(-1)
    torch.testing.assert_close(reused, values[:, 3 - 1 :], atol=1e-5, rtol=1e-5)
    (-logprobs.sum() + reused.sum()).backward()
    assert policy.lm_head.weight.grad.abs().sum() > 0
    assert critic.score.weight.grad.abs().sum() > 0
    trunk_grad = policy.model.layers[0].mlp.up_proj.weight.grad.clone()
    policy.zero_grad()
    ppo.response_logprobs(policy, input_ids, attention_mask, 3, 1.0).sum().neg().backward()
    # the value loss reached the trunk
    assert not torch.allclose(trunk_grad, policy.model.layers[0].mlp.up_proj.weight.grad)


# ---------------------------------------------------------------- the script, end to end


def run_ppo(tmp_path, *extra):
    out = tmp_path / "run"
    sizes = ["--rollout_batch_size=8", "--minibatch_size=4", "--micro_batch_size=2", "--num_epochs=2"]
    rows, output = run_main("ppo.py", out, *sizes, "--total_episodes=16", "--response_length=8", *extra)
    return out, rows, output


def test_smoke_run_on_embedded_default(tmp_path):
    out, rows, stdout = run_ppo(tmp_path)
    assert [r["iteration"] for r in rows] == [0, 1, 2]  # 0: the starting policy's held-out score
    # before training, then after the last
    assert "eval/score" in rows[0]
    assert "eval/score" not in rows[1]
    assert "eval/score" in rows[2]
    assert -5 < rows[0]["eval/score"] < 5
    assert -5 < rows[0]["eval/score_greedy"] < 5
    rows = rows[1:]
    for r in rows:
        for key in (
            "objective/score",
            "objective/kl",
            "objective/kl_coef",
            "policy/entropy",
            "policy/clipfrac",
            "policy/approx_kl",
            "val/loss",
            "val/explained_variance",
            "response/length",
            "response/eos_rate",
            "response/distinct2",
            "time/tokens_per_second",
        ):
            assert math.isfinite(r[key]), key
        assert 1 <= r["response/length"] <= 8
        assert 0 <= r["response/eos_rate"] <= 1
        # logprobs_old were recorded at sampling time, so before any update the ratio is 1
        assert r["policy/first_ratio_dev"] < 1e-4
    # the policy is the reference on the first rollout
    assert rows[0]["objective/kl"] == pytest.approx(0.0, abs=1e-4)
    assert "iter 2/2" in stdout
    model = AutoModelForCausalLM.from_pretrained(out)
    start = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
    moved = sum((a - b).abs().sum().item() for a, b in zip(model.parameters(), start.parameters()))
    assert moved > 0  # the saved policy is the trained one, not the starting one


def test_smoke_run_with_rule_reward(tmp_path):
    # --hub_kernels too: on a CPU transformers has no hub kernel to swap in, so it must run offline all the same
    out, rows, _ = run_ppo(
        tmp_path,
        "--dataset=assets/arithmetic/train.jsonl",
        "--reward_fn",
        "arithmetic",
        "--reward_model_path",
        "--hub_kernels",
    )
    assert all(0.0 <= r["objective/score"] <= 1.0 for r in rows[1:])  # an exact-match reward, no reward model
    # the held-out score of a rule reward is an accuracy over the 400 test prompts
    assert all(
        0.0 <= rows[i][k] <= 1.0 and rows[i][k] * 400 == pytest.approx(round(rows[i][k] * 400))
        for i in (0, -1)
        for k in ("eval/score", "eval/score_greedy")
    )
    args = json.loads((out / "args.json").read_text())
    assert args["value_model_path"] is None  # not rewritten: the critic starts from the policy (no reward model)


def test_a_run_with_a_shared_backbone(tmp_path):
    sizes = ["--rollout_batch_size=8", "--minibatch_size=8", "--micro_batch_size=4", "--num_epochs=2"]
    args = [*sizes, "--total_episodes=16", "--response_length=8", "--eval_every=0"]  # two iterations
    rows, _ = run_main("ppo.py", tmp_path / "shared", "--shared_backbone", *args)
    plain, _ = run_main("ppo.py", tmp_path / "plain", *args)
    assert [r["iteration"] for r in rows] == [1, 2]
    # the head starts at V = 0 and is trained
    assert rows[0]["val/mean"] == 0.0
    assert rows[1]["val/loss"] > 0
    assert "grad_norm/value" in rows[1]
    assert rows[1]["grad_norm/value"] > 0
    # one model fewer: the critic's weights and Adam states (as large as the policy's here) are not held
    assert rows[0]["memory/model_states_mb"] < 0.75 * plain[0]["memory/model_states_mb"]
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "shared")).config.architectures == ["LlamaForCausalLM"]
