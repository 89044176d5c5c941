"""grpo.py's and rloo.py's --policy_loss gspo and cispo against plain float64 computations written from the papers'
equations (values, gradients by hand, clip fractions, with padding); --mask_truncated, in all three scripts; and the KL
term in the loss at low temperatures."""

import math
import os

import pytest
import torch
from helpers import GROUPS_OF_EIGHT, ROOT, run_main, tiny_run
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo
import rloo

LENGTHS = [7, 3, 5, 1, 6, 4]  # responses of a rollout, right-padded to 7


ADVANTAGES = [1.5, -0.7, 0.4, -2.0, 0.9, -0.3]


def ragged(seed=0):
    """log-probs (B, T) float64 as response_logprobs gives them (0 past each response's end), the rollout's, a mask
    and one advantage per response (B, 1); the ratios spread over both sides of a clip range of 0.1."""
    g = torch.Generator().manual_seed(seed)
    T = max(LENGTHS)
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).double()
    old = -3 * torch.rand(len(LENGTHS), T, generator=g, dtype=torch.float64) * mask
    new = (old + 0.3 * torch.randn(len(LENGTHS), T, generator=g, dtype=torch.float64)) * mask
    return new, old, torch.tensor(ADVANTAGES, dtype=torch.float64)[:, None], mask


@pytest.mark.parametrize("module", [grpo, rloo])
def test_gspo_matches_the_papers_sequence_ratio_token_by_token(module):
    new, old, adv, mask = ragged(seed=1)
    low = 0.1
    high = 0.08
    logprobs = new.clone().requires_grad_()
    weights = torch.rand(new.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * mask
    loss, ratio, clipped = module.gspo_loss(logprobs, old, adv, mask, low, high)
    (loss * weights).sum().backward()
    seen = set()
    for i, n in enumerate(LENGTHS):
        s = math.exp(sum(new[i, t].item() - old[i, t].item() for t in range(n)) / n)  # exp of the mean log-ratio
        a = ADVANTAGES[i]
        objective = min(s * a, min(max(s, 1 - low), 1 + high) * a)
        is_clipped = (a > 0 and s > 1 + high) or (a < 0 and s < 1 - low)  # the min took the clipped term: no gradient
        seen.add(is_clipped)
        for t in range(n):
            assert loss[i, t].item() == pytest.approx(-objective, rel=1e-12)
            assert ratio[i, t].item() == pytest.approx(s, rel=1e-12)
            assert clipped[i, t].item() == float(is_clipped)
            # by hand: sg(s) exp(log pi - sg(log pi)) has the gradient s per token, so -w s A, or 0 when clipped
            expected = 0.0 if is_clipped else -weights[i, t].item() * s * a
            assert logprobs.grad[i, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert (logprobs.grad[i, n:] == 0).all()  # padding
    assert seen == {True, False}  # both cases are tested


@pytest.mark.parametrize("module", [grpo, rloo])
def test_gspo_with_sequence_mean_is_the_papers_sequence_objective(module):
    """With one advantage per response and sequence_mean weights, the GSPO-token loss equals -J_GSPO(theta) =
    -1/B sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i), s_i = exp(mean_t log(pi/pi_old)), and so does
    its gradient (autograd through the sequence form)."""
    new, old, adv, mask = ragged(seed=2)
    low = 0.05
    high = 0.05
    B, T = new.shape
    token_form = new.clone().requires_grad_()
    weights = module.loss_weights(mask, "sequence_mean", T, B, mask.sum().item())
    loss = (module.gspo_loss(token_form, old, adv, mask, low, high)[0] * weights).sum()
    sequence_form = new.clone().requires_grad_()
    s = torch.exp(((sequence_form - old) * mask).sum(1) / mask.sum(1))  # (B,)
    objective = torch.min(s * adv[:, 0], torch.clamp(s, 1 - low, 1 + high) * adv[:, 0]).mean()
    assert loss.item() == pytest.approx(-objective.item(), rel=1e-12)
    (grad_token,) = torch.autograd.grad(loss, token_form)
    (grad_sequence,) = torch.autograd.grad(-objective, sequence_form)
    torch.testing.assert_close(grad_token, grad_sequence, rtol=1e-12, atol=1e-15)
    # some responses clipped, some not
    assert (grad_sequence != 0).any()
    assert (grad_sequence == 0).any()


@pytest.mark.parametrize("module", [grpo, rloo])
def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient(module):
    new, old, adv, mask = ragged(seed=3)
    low = 0.1
    high = 0.2
    logprobs = new.clone().requires_grad_()
    weights = mask / mask.sum()
    loss, ratio, clipped = module.cispo_loss(logprobs, old, adv, low, high)
    (loss * weights).sum().backward()
    kinds = set()
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            rho = math.exp(new[i, t].item() - old[i, t].item())
            w = min(max(rho, 1 - low), 1 + high)  # the clipped importance weight, a constant for autograd
            if rho < 1 - low:
                kinds.add("low")
            elif rho > 1 + high:
                kinds.add("high")
            else:
                kinds.add("inside")
            assert loss[i, t].item() == pytest.approx(-w * ADVANTAGES[i] * new[i, t].item(), rel=1e-12)
            assert ratio[i, t].item() == pytest.approx(rho, rel=1e-12)
            assert clipped[i, t].item() == float(not 1 - low <= rho <= 1 + high)
            # by hand: d/d log pi of -w A log pi is -w A, clipped or not
            assert logprobs.grad[i, t].item() == pytest.approx(-weights[i, t].item() * w * ADVANTAGES[i], rel=1e-12)
    assert kinds == {"low", "high", "inside"}
    # clipped tokens still learn
    assert (logprobs.grad[clipped.bool()] != 0).all()
    assert clipped.sum() > 0


@pytest.mark.parametrize("module", [grpo, rloo])
def test_policy_loss_picks_the_loss_and_clip_is_todays_loss(module):
    new, old, adv, mask = ragged(seed=4)
    for kind, expected in (
        ("clip", module.clip_loss(new, old, adv, 0.1, 0.2)),
        ("gspo", module.gspo_loss(new, old, adv, mask, 0.1, 0.2)),
        ("cispo", module.cispo_loss(new, old, adv, 0.1, 0.2)),
    ):
        for got, want in zip(module.policy_loss(kind, new, old, adv, mask, 0.1, 0.2), expected):
            assert torch.equal(got, want), kind
    # every ratio 1 (the first minibatch of a rollout): each loss is -A per token, or -A log pi (CISPO)
    for kind in ("clip", "gspo", "cispo"):
        loss, ratio, clipped = module.policy_loss(kind, new, new, adv, mask, 0.1, 0.2)
        assert torch.equal(ratio * mask, mask)
        assert not clipped.any()


# ---------------------------------------------------------------- the losses in a run, on the embedded task


TINY = [*GROUPS_OF_EIGHT, "--total_episodes=64", "--eval_every=0"]  # two iterations


PAPERS = {
    "gspo": ["--loss_aggregation=sequence_mean", "--clip_range_low=3e-4", "--clip_range_high=4e-4"],
    "cispo": ["--clip_range_low=1"],
}


@pytest.mark.parametrize("script,loss", [("grpo.py", "gspo"), ("rloo.py", "cispo")])
def test_each_loss_trains_with_a_first_ratio_of_one(script, loss, tmp_path):
    """policy_loss is the same function in both files (test_code.py keeps the copies identical; the math of each loss
    is tested above on each module): each loss trains in a run of one of them."""
    rows, _ = run_main(script, tmp_path, *TINY, f"--policy_loss={loss}", *PAPERS[loss])
    assert len(rows) == 2
    for r in rows:
        assert r["policy/first_ratio_dev"] < 1e-5  # logprobs_old recorded while sampling: ratio 1 on the first
        assert math.isfinite(r["policy/loss"])
        assert math.isfinite(r["grad_norm/policy"])
        assert r["grad_norm/policy"] > 0
    if loss == "gspo":  # four minibatches per rollout move each response's ratio past 4e-4 after the first
        assert any(r["policy/clipfrac"] > 0 for r in rows)


@pytest.mark.parametrize("temperature", ["0.25", "0.1"])
@pytest.mark.parametrize("script,flags", [("grpo.py", []), ("rloo.py", ["--kl_in_loss"])])
def test_the_kl_in_the_loss_stays_finite_at_low_temperatures(script, flags, temperature, tmp_path):
    rows, _ = run_main(
        script, tmp_path, *tiny_run(script, total_episodes=80, temperature=temperature, eval_every=0), *flags
    )
    assert len(rows) == 10  # 80 episodes of 8 responses an iteration (tiny_run)
    assert rows[-1]["health/skipped_steps"] == 0
    assert all(r["policy/kl_term"] >= 0 and r["policy/kl_term"] < float("inf") for r in rows)


# ---------------------------------------------------------------- --mask_truncated


def test_a_truncated_responses_gradient_is_exactly_zero():
    """grpo's training loss as main builds it, on two responses of the tiny policy, the second cut off without a
    stop token: with --mask_truncated its tokens get exactly no gradient (at the input embeddings), the first's do."""
    path = os.path.join(ROOT, "assets", "tiny-sft")
    policy = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = tokenizer.eos_token_id
    input_ids = torch.tensor([[5, 6, 7, 8, eos, 0], [5, 6, 9, 10, 11, 12]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    P = 2
    response_mask = attention_mask[:, P:]
    has_eos = torch.isin(input_ids[:, P:], torch.tensor([eos])).any(1)
    embedded = []

    def keep(module, inputs, output):
        output.retain_grad()
        embedded.append(output)

    policy.get_input_embeddings().register_forward_hook(keep)
    for mask_truncated, expected in ((True, [True, False]), (False, [True, True])):
        train_mask = response_mask * (has_eos | (not mask_truncated))[:, None]  # as in the scripts' step 3
        logprobs = grpo.response_logprobs(policy, input_ids, attention_mask, P, 1.0)
        pg_loss, _, _ = grpo.policy_loss(
            "clip", logprobs, logprobs.detach() - 0.01, torch.tensor([[1.0], [-1.0]]), train_mask.float(), 0.2, 0.2
        )
        weights = grpo.loss_weights(train_mask.float(), "token_mean", 4, 2, train_mask.sum().item())
        (pg_loss * weights).sum().backward()
        grad = embedded[-1].grad  # (2, 6, H)
        assert [bool((grad[b] != 0).any()) for b in range(2)] == expected
        policy.zero_grad()


def moved(out):
    trained = AutoModelForCausalLM.from_pretrained(out)
    start = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
    return sum((a - b).abs().sum().item() for a, b in zip(trained.parameters(), start.parameters()))


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "rloo.py"])
def test_a_rollout_cut_off_everywhere_takes_no_step_and_says_so(script, tmp_path):
    """One token per response: none of these reaches its stop token. With --mask_truncated nothing is left in the
    loss, so no optimiser step is taken (the policy does not move) and the line says so; without it the same run
    moves the policy (the entropy bonus alone would)."""
    sizes = (
        ["--rollout_batch_size=8", "--minibatch_size=8", "--micro_batch_size=8"]
        if script == "ppo.py"
        else ["--rollout_batch_size=2", "--num_generations=4", "--minibatch_size=8"]
    )
    common = [
        *sizes,
        "--total_episodes=8",
        "--response_length=1",
        "--ent_coef=0.01",
        "--eval_every=0",
        "--num_epochs=1",
    ]
    rows, printed = run_main(script, tmp_path / "masked", *common, "--mask_truncated")
    assert rows[-1]["response/eos_rate"] == 0.0
    assert rows[-1]["response/truncated_left_out"] == 1.0
    assert "no optimiser step: every response was left out of the loss" in printed
    assert moved(tmp_path / "masked") == 0
    assert "grad_norm/policy" not in rows[-1]
    rows, printed = run_main(script, tmp_path / "kept", *common)
    assert "no optimiser step" not in printed
    assert "response/truncated_left_out" not in rows[-1]
    assert moved(tmp_path / "kept") > 0
