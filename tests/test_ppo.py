"""ppo.py against independent references: plain loops, hand computations and the specification's worked examples
(the four-case clipping table, the KL example)."""

import json
import math
import os

import pytest
import torch
from helpers import assert_static_decode_matches_dynamic, run_script, tiny_llama_config
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

import ppo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAD = 0
EOS = 1


def tiny_config(**kw):
    return tiny_llama_config(max_position_embeddings=128, **kw)


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


# ---------------------------------------------------------------- controllers and running statistics


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
    state = dict(first_entropy=None, first_distinct2=None, first_value_loss=None, value_loss_ema=None)
    args = ppo.Args()
    healthy = {
        "iteration": 1,
        "objective/kl": 3.0,
        "policy/clipfrac": 0.05,
        "policy/entropy": 1.8,
        "response/distinct2": 0.5,
        "val/loss": 1.0,
    }
    assert not any(ppo.failure_alarms(healthy, state, args).values())
    for i in range(2, 12):  # a falling value loss is healthy
        assert not any(ppo.failure_alarms({**healthy, "iteration": i, "val/loss": 0.5}, state, args).values())
    sick = {
        "iteration": 12,
        "objective/kl": 25.0,
        "policy/clipfrac": 0.4,
        "policy/entropy": 0.8,
        "response/distinct2": 0.2,
        "val/loss": 0.5,
    }
    assert ppo.failure_alarms(sick, state, args) == {
        "kl_explosion": True,
        "clip_fraction": True,
        "entropy_collapse": True,
        "value_divergence": False,
        "diversity_collapse": True,
    }
    for i in range(13, 40):  # a value loss that climbs past where it started
        fired = ppo.failure_alarms({**healthy, "iteration": i, "val/loss": 3.0}, state, args)
    assert fired["value_divergence"]
    assert not fired["kl_explosion"]


def test_distinct_n_by_hand():
    assert ppo.distinct_n([[1, 2, 3], [1, 2, 4]], 1) == 4 / 6
    assert ppo.distinct_n([[1, 2, 3], [1, 2, 4]], 2) == 3 / 4
    assert ppo.distinct_n([[5, 5, 5, 5]], 2) == 1 / 3


def test_scores_take_the_minimum_over_reward_models():
    rm_a = torch.tensor([1.0, -2.0, 0.5])
    rm_b = torch.tensor([0.0, 3.0, 0.5])
    assert ppo.combine_scores([rm_a, rm_b]).tolist() == [0.0, -2.0, 0.5]
    assert ppo.combine_scores([rm_a, rm_b], torch.tensor([1.0, 0.0, 1.0])).tolist() == [1.0, -2.0, 1.5]
    assert ppo.combine_scores([], torch.tensor([1.0, 0.0])).tolist() == [1.0, 0.0]


def test_arithmetic_reward():
    assert ppo.arithmetic_reward([" 95", "94", "95 "], ["95", "95", "95"]) == [1.0, 0.0, 1.0]


def test_gsm8k_reward_reads_the_last_number_against_the_answer_after_hashes():
    # The first GSM8K training answer: intermediate numbers in the calculator annotations, the final one after '####'.
    answer = (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
    )
    responses = [
        "In May she sold 48 / 2 = 24, so 48 + 24 = 72 clips in all. The answer is 72.",  # last number 72: right
        "She sold 72 clips in April and May, 24 of them in May.",  # 72 appears, but the last number is 24: wrong
        "The answer is 72.0",  # the same number written as a decimal: right
        "No idea.",  # no number: wrong
    ]
    assert ppo.gsm8k_reward(responses, [answer] * 4) == [1.0, 0.0, 1.0, 0.0]
    # thousands separator, sign
    assert ppo.gsm8k_reward(["It costs $1,234 in total.", "-5"], ["#### 1234", "#### -5"]) == [1.0, 1.0]
    assert ppo.last_number("1,234.50 and then 7") == 7.0
    assert ppo.last_number("2.50 dollars") == 2.5


def test_hub_dataset_configuration_is_passed_to_load_dataset(monkeypatch):
    """Hub datasets with several configurations (openai/gsm8k: main, socratic) need --dataset_config; no hub here, so
    the loader is replaced by one that, like the hub's, refuses to guess a missing configuration."""
    import datasets

    def load_dataset(path, name=None, split=None):
        if name is None:
            raise ValueError("Config name is missing.")
        return [{"question": f"{path}/{name}/{split}", "answer": "#### 1"}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    args = ppo.Args(dataset="openai/gsm8k")
    with pytest.raises(SystemExit, match="--dataset_config"):
        ppo.read_rows("openai/gsm8k", "train", args)
    args.dataset_config = "main"
    assert ppo.read_rows("openai/gsm8k", "train", args) == [{"question": "openai/gsm8k/main/train", "answer": "#### 1"}]


# ---------------------------------------------------------------- generation and log-probs


def left_padded_prompts(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]
    return ppo.left_pad(prompts, PAD, "cpu")


def test_sampled_logprobs_equal_teacher_forced():
    """logprobs_old recorded while sampling with a KV cache == one full forward over the finished sequences."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(tiny_config()).eval()
    with torch.no_grad():  # make EOS likely enough that some sequences stop early and others do not
        policy.lm_head.weight[EOS] *= 0
        policy.lm_head.bias = None
    prompt_ids, prompt_mask = left_padded_prompts([1, 5, 3, 8, 2, 6], 40, seed=1)
    uniforms = torch.rand(6, 12, generator=torch.Generator().manual_seed(1))
    sampling = ppo.Sampling(12, 0.7, EOS, PAD)
    responses, logprobs_old, response_mask = ppo.generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
    lengths = response_mask.sum(1)
    assert 0 < (responses == EOS).any(1).sum() < len(responses) or lengths.min() < 12  # a mix of stopped and running
    for b in range(len(responses)):  # the mask covers the response up to and including its EOS, pad after
        n = int(lengths[b])
        eos_at = (responses[b] == EOS).nonzero()
        if len(eos_at):
            assert n == eos_at[0].item() + 1
        assert (responses[b, n:] == PAD).all()
        assert (logprobs_old[b, n:] == 0).all()
    input_ids = torch.cat([prompt_ids, responses], 1)
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    with torch.no_grad():
        teacher_forced = ppo.response_logprobs(policy, input_ids, attention_mask, prompt_ids.shape[1], 0.7)
    torch.testing.assert_close(teacher_forced * response_mask, logprobs_old, atol=2e-5, rtol=1e-5)


def test_sampling_follows_the_tempered_softmax():
    """Inverse-CDF sampling from uniforms: over 20,000 draws of the first token, each token's frequency is within
    five binomial standard deviations of its probability, softmax(logits / T) computed apart in float64."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(tiny_config()).eval()
    prompt_ids, prompt_mask = left_padded_prompts([4], 40, seed=3)
    n = 20_000
    uniforms = torch.rand(n, 1, generator=torch.Generator().manual_seed(4))
    sampling = ppo.Sampling(1, 0.7, EOS, PAD)
    tokens = ppo.generate(policy, prompt_ids.expand(n, -1), prompt_mask.expand(n, -1), sampling, uniforms)[0][:, 0]
    with torch.no_grad():
        probs = torch.softmax(policy(input_ids=prompt_ids).logits[0, -1].double() / 0.7, -1)
    frequency = torch.bincount(tokens, minlength=len(probs)).double() / n
    assert ((frequency - probs).abs() <= 5 * (probs * (1 - probs) / n).sqrt() + 1e-12).all()
    assert (frequency[probs < 1e-6] == 0).all()


@pytest.mark.parametrize("kernel_decode", [False, True])
def test_a_response_does_not_depend_on_its_batch(kernel_decode):
    """Each row samples from its own uniforms: alone, or in another batch, it gets the same tokens (what makes a run
    the same on any number of processes), with the plain decode loop and rlhf_kernels'."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(tiny_config()).eval()
    prompt_ids, prompt_mask = left_padded_prompts([1, 5, 3, 8, 2, 6], 40, seed=1)
    uniforms = torch.rand(6, 10, generator=torch.Generator().manual_seed(2))
    sampling = ppo.Sampling(10, 0.7, EOS, PAD, kernel_decode)
    together = ppo.generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
    for b in range(6):
        width = int(prompt_mask[b].sum())
        alone = ppo.generate(
            policy, prompt_ids[b : b + 1, -width:], prompt_mask[b : b + 1, -width:], sampling, uniforms[b : b + 1]
        )
        n = alone[0].shape[1]
        assert torch.equal(alone[0][0], together[0][b, :n])
        assert (together[2][b, n:] == 0).all()
        torch.testing.assert_close(alone[1][0], together[1][b, :n], atol=1e-5, rtol=1e-5)


def test_static_decode_samples_what_the_dynamic_loop_samples():
    """On the embedded policy: in float64 the same tokens, masks and log-probs (within 1e-6; see the helper); in the
    float32 the scripts run in, the same tokens here and log-probs within 2e-5 (rounding: the static cache's attention
    sums over its unused columns too)."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
    stop_ids = torch.tensor([tokenizer.eos_token_id])
    assert tokenizer.eos_token_id == 0  # the helper's zero uniforms draw it
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"), dtype=torch.float64)
    assert_static_decode_matches_dynamic(policy.eval(), tokenizer.pad_token_id, stop_ids, len(tokenizer))
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft")).eval()
    prompt_ids, prompt_mask = left_padded_prompts([3, 17, 9, 24, 1, 12, 20, 5], len(tokenizer), seed=3)
    uniforms = torch.rand(8, 24, generator=torch.Generator().manual_seed(3))
    for temperature in (0.7, 1.0):
        dynamic = ppo.Sampling(24, temperature, stop_ids, tokenizer.pad_token_id)
        static = ppo.Sampling(24, temperature, stop_ids, tokenizer.pad_token_id, kernel_decode=True)
        expected = ppo.generate(policy, prompt_ids, prompt_mask, dynamic, uniforms)
        got = ppo.generate(policy, prompt_ids, prompt_mask, static, uniforms)
        assert torch.equal(got[0], expected[0])
        assert torch.equal(got[2], expected[2])
        torch.testing.assert_close(got[1], expected[1], atol=2e-5, rtol=0)


def test_decode_auto_is_the_plain_loop_on_the_cpu(tmp_path):
    """--decode auto hands generate's steps to rlhf_kernels on one GPU only (CUDA graphs need one; on the CPU the
    static loop gains too little to give up the default runs as they were, bench/generate.md), and the option is
    left as the user gave it: args.json records auto."""
    out = tmp_path / "run"
    args = ppo.Args(output_dir=str(out))
    ppo.validate(args)
    assert not ppo.load_task(args, torch.device("cpu"))[4].kernel_decode
    ppo.Log(args, dict(elapsed=0.0, iteration=0), 0, None).file.close()
    assert json.load(open(out / "args.json"))["decode"] == "auto"


def test_response_logprobs_equal_plain_torch():
    """The scripts' log-probs, through rlhf_kernels/, equal log_softmax + gather on the same forward."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(tiny_config()).eval()
    input_ids, attention_mask = left_padded_prompts([4, 9, 6], 40, seed=2)
    P = 3
    with torch.no_grad():
        logp, entropy = ppo.response_logprobs(policy, input_ids, attention_mask, P, 0.7, return_entropy=True)
        logits = policy(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=ppo.position_ids_from(attention_mask)
        ).logits.double()
        plain = torch.log_softmax(logits[:, P - 1 : -1] / 0.7, -1)
    valid = attention_mask[:, P:].bool()  # positions past a row's end (here: its left padding) are exactly 0
    expected = torch.where(valid, plain.gather(-1, input_ids[:, P:, None]).squeeze(-1), 0.0)
    torch.testing.assert_close(logp.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        entropy.double(), torch.where(valid, -(plain.exp() * plain).sum(-1), 0.0), atol=1e-5, rtol=1e-5
    )


def test_reward_head_is_padding_invariant():
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(tiny_config(num_labels=1)).eval()
    seq = torch.randint(2, 40, (7,)).tolist() + [EOS]
    alone = ppo.head_outputs(rm, torch.tensor([seq]), torch.ones(1, 8, dtype=torch.long))[0, -1]
    ids = torch.tensor([[PAD] * 3 + seq + [PAD] * 2])
    mask = (torch.arange(13) >= 3) & (torch.arange(13) < 11)
    padded = ppo.head_outputs(rm, ids, mask.long()[None])[0, 10]
    torch.testing.assert_close(alone, padded, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- bad input, before anything loads


def write_tiny_models(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
    LlamaForCausalLM(tiny_config()).save_pretrained(tmp_path / "lm")
    LlamaForSequenceClassification(tiny_config(num_labels=1)).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "lm")
    return tokenizer


def args_with(**kw):
    defaults = dict(
        model_name_or_path=os.path.join(ROOT, "assets", "tiny-sft"),
        reward_model_path=(os.path.join(ROOT, "assets", "tiny-rm"),),
        dataset=os.path.join(ROOT, "assets", "reviews", "train.jsonl"),
    )
    return ppo.Args(**{**defaults, **kw})


@pytest.mark.parametrize(
    "kw,message",
    [
        # PPO's own arguments; the checks every script shares are in test_robustness.py, for all three
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


def test_wrong_model_kinds(tmp_path):
    write_tiny_models(tmp_path)
    with pytest.raises(SystemExit, match="not a causal LM"):
        ppo.validate(args_with(model_name_or_path=str(tmp_path / "rm")))
    with pytest.raises(SystemExit, match="not a sequence classifier"):
        ppo.validate(args_with(reward_model_path=(str(tmp_path / "lm"),)))


def test_bad_datasets(tmp_path):
    tokenizer = write_tiny_models(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "wrong.jsonl").write_text(json.dumps({"text": "the food was"}) + "\n")
    (tmp_path / "long.jsonl").write_text(
        json.dumps({"prompt": "the food was " * 20}) + "\n" + json.dumps({"prompt": "the plot was"}) + "\n"
    )
    with pytest.raises(SystemExit, match="does not exist"):
        ppo.load_prompts(str(tmp_path / "missing.jsonl"), "train", args_with(), tokenizer)
    with pytest.raises(SystemExit, match="empty"):
        ppo.load_prompts(str(tmp_path / "empty.jsonl"), "train", args_with(), tokenizer)
    with pytest.raises(SystemExit, match="no 'prompt' column"):
        ppo.load_prompts(str(tmp_path / "wrong.jsonl"), "train", args_with(), tokenizer)
    with pytest.raises(SystemExit, match="longer than --max_prompt_length 16"):
        ppo.load_prompts(str(tmp_path / "long.jsonl"), "train", args_with(max_prompt_length=16), tokenizer)
    with pytest.warns(UserWarning, match="cut to their last 16 tokens"):
        prompts, _ = ppo.load_prompts(
            str(tmp_path / "long.jsonl"), "train", args_with(max_prompt_length=16, truncate_prompts=True), tokenizer
        )
    full = tokenizer("the food was " * 20, add_special_tokens=False)["input_ids"]
    assert prompts[0] == full[-16:]
    assert prompts[1] == tokenizer("the plot was", add_special_tokens=False)["input_ids"]
    with pytest.raises(SystemExit, match="needs an answer column"):
        ppo.load_prompts(
            str(tmp_path / "long.jsonl"),
            "train",
            args_with(reward_fn=("arithmetic",), max_prompt_length=200),
            tokenizer,
        )
    (tmp_path / "broken.jsonl").write_text(
        json.dumps({"prompt": "the food was"}) + "\n\n" + '{"prompt": "the plot was"' + "\n"
    )
    with pytest.raises(SystemExit, match="line 3 of '.*broken.jsonl' is not valid JSON"):
        ppo.load_prompts(str(tmp_path / "broken.jsonl"), "train", args_with(), tokenizer)
    (tmp_path / "number.jsonl").write_text(json.dumps({"prompt": 12}) + "\n")
    with pytest.raises(SystemExit, match="row 1 of .* has a int as its prompt"):
        ppo.load_prompts(str(tmp_path / "number.jsonl"), "train", args_with(), tokenizer)
    # HF_HUB_OFFLINE=1 (conftest): a hub dataset cannot be fetched, and the error says so instead of a traceback
    with pytest.raises(
        SystemExit, match="hub dataset 'someone/reviews' could not be loaded .*; check its name, the split 'train'"
    ):
        ppo.load_prompts("someone/reviews", "train", args_with(), tokenizer)


# ---------------------------------------------------------------- the script, end to end


def run_ppo(tmp_path, *extra):
    out = tmp_path / "run"
    sizes = ["--rollout_batch_size=8", "--minibatch_size=4", "--micro_batch_size=2", "--num_epochs=2"]
    rows, output = run_script("ppo.py", out, *sizes, "--total_episodes=16", "--response_length=8", *extra)
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


def test_tokenizer_without_pad_falls_back_to_eos(tmp_path):
    import shutil

    from transformers import AutoTokenizer

    policy_dir = tmp_path / "policy"
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-sft"), policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(policy_dir)
    assert AutoTokenizer.from_pretrained(policy_dir).pad_token is None
    _, rows, output = run_ppo(tmp_path, f"--model_name_or_path={policy_dir}")
    assert "no pad token; using EOS as pad" in output
    rows = rows[1:]
    # With pad == EOS the mask, not the token id, ends a response: lengths stay within bounds and the
    # sampled log-probs still agree with the training forward pass.
    assert all(1 <= r["response/length"] <= 8 and r["policy/first_ratio_dev"] < 1e-4 for r in rows)


def test_held_out_dataset_defaults_to_the_test_split_beside_the_training_file(tmp_path):
    arithmetic = os.path.join(ROOT, "assets", "arithmetic")
    assert ppo.held_out_dataset(args_with(dataset=os.path.join(arithmetic, "train.jsonl"))) == os.path.join(
        arithmetic, "test.jsonl"
    )
    assert (
        ppo.held_out_dataset(args_with(dataset=os.path.join(arithmetic, "train.jsonl"), eval_dataset="x.jsonl"))
        == "x.jsonl"
    )
    assert ppo.held_out_dataset(args_with(dataset=os.path.join(arithmetic, "train.jsonl"), eval_every=0)) is None
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "the food was"}) + "\n")
    # no train/test layout: no evaluation
    assert ppo.held_out_dataset(args_with(dataset=str(tmp_path / "prompts.jsonl"))) is None
    assert ppo.held_out_dataset(args_with(dataset="someone/reviews")) is None


def test_shared_backbone_values_come_from_the_policys_trunk_and_both_heads_learn():
    """--shared_backbone: V is the head applied to the policy's last hidden states (computed here apart); the combined
    loss gives gradients to the LM head, the trunk and the value head, and the value loss alone reaches the trunk."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(tiny_config()).eval()
    critic = ppo.ValueHead(policy)
    assert [n for n, _ in critic.named_parameters()] == ["score.weight"]  # the trunk is the policy's, not a copy
    with torch.no_grad():
        critic.score.weight.normal_()
    input_ids, attention_mask = left_padded_prompts([5, 9, 7], 40, seed=5)
    values = ppo.head_outputs(critic, input_ids, attention_mask)
    with torch.no_grad():
        hidden = policy.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=ppo.position_ids_from(attention_mask)
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


def test_a_run_with_a_shared_backbone(tmp_path):
    sizes = ["--rollout_batch_size=8", "--minibatch_size=8", "--micro_batch_size=4", "--num_epochs=2"]
    args = [*sizes, "--total_episodes=16", "--response_length=8", "--eval_every=0"]  # two iterations
    rows, _ = run_script("ppo.py", tmp_path / "shared", "--shared_backbone", *args)
    plain, _ = run_script("ppo.py", tmp_path / "plain", *args)
    assert [r["iteration"] for r in rows] == [1, 2]
    # the head starts at V = 0 and is trained
    assert rows[0]["val/mean"] == 0.0
    assert rows[1]["val/loss"] > 0
    assert "grad_norm/value" in rows[1]
    assert rows[1]["grad_norm/value"] > 0
    # one model fewer: the critic's weights and Adam states (as large as the policy's here) are not held
    assert rows[0]["memory/model_states_mb"] < 0.75 * plain[0]["memory/model_states_mb"]
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "shared")).config.architectures == ["LlamaForCausalLM"]
