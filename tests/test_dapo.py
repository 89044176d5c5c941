"""dapo.py's soft overlong punishment (Yu et al. 2025, eq. 13) and dual-clip PPO (Ye et al. 2020, eq. 5, in every
script) against plain float64 loops written from the papers' equations (values, gradients per token, the clip
fractions, with padding); dynamic sampling's choice of groups against a plain loop; bad arguments refused in one
sentence; and dynamic sampling in runs: the groups it keeps, the episodes it counts, a stop in any round resumed
bitwise, and two processes computing what one computes."""

import math
import time

import pytest
import torch
from helpers import (
    ARITHMETIC,
    assert_bitwise_equal,
    assert_rows_agree,
    assert_same_model,
    cli,
    common,
    failing_reward,
    final_state,
    launch,
    read_rows,
    resume_as_printed,
    run_main,
    run_torchrun,
    without_timing,
)

import dapo
import grpo
import ppo
import rlhf_runtime as runtime
import rloo

SCRIPTS = [ppo, grpo, rloo, dapo]
LENGTHS = [7, 3, 5, 1, 6, 4]  # responses of a rollout, right-padded to 7
ADVANTAGES = [1.5, -0.7, 0.4, -2.0, 0.9, -0.3]


def ragged(seed):
    """log-probs (B, T) float64, 0 past each response's end, the rollout's, a mask, one advantage per response (B, 1);
    log-ratios of spread 0.8, so that some ratios pass 1.5 and others fall below 1 - 0.2."""
    g = torch.Generator().manual_seed(seed)
    T = max(LENGTHS)
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).double()
    old = -3 * torch.rand(len(LENGTHS), T, generator=g, dtype=torch.float64) * mask
    new = (old + 0.8 * torch.randn(len(LENGTHS), T, generator=g, dtype=torch.float64)) * mask
    return new, old, torch.tensor(ADVANTAGES, dtype=torch.float64)[:, None], mask


@pytest.mark.parametrize("module", SCRIPTS, ids=["ppo", "grpo", "rloo", "dapo"])
def test_dual_clip_matches_the_papers_bound_token_by_token(module):
    """Ye et al. eq. 5 as a loss to minimise: -min(rho A, clip(rho) A) for A >= 0; for A < 0, min(that, -c A). A token
    with A < 0 whose ratio passed c loses -c A, a constant: no gradient; elsewhere the clipped loss and its gradient."""
    new, old, adv, mask = ragged(seed=7)
    low = 0.2
    high = 0.28
    c = 1.5
    logprobs = new.clone().requires_grad_()
    weights = torch.rand(new.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * mask
    clipped_loss, ratio, clipped = module.clip_loss(logprobs, old, adv, low, high)
    loss, bounded = module.dual_clip_loss(clipped_loss, adv, c)
    (loss * weights).sum().backward()
    kinds = set()
    for i, n in enumerate(LENGTHS):
        a = ADVANTAGES[i]
        for t in range(n):
            rho = math.exp(new[i, t].item() - old[i, t].item())
            surrogate = min(rho * a, min(max(rho, 1 - low), 1 + high) * a)  # PPO's clipped objective
            objective = surrogate
            if a < 0:
                objective = max(surrogate, c * a)  # the dual clip: never below c A
            is_bounded = a < 0 and c * a > surrogate
            is_clipped = (a > 0 and rho > 1 + high) or (a < 0 and rho < 1 - low)
            kinds.add((a < 0, is_bounded, is_clipped))
            assert loss[i, t].item() == pytest.approx(-objective, rel=1e-12)
            assert bounded[i, t].item() == float(is_bounded)
            assert clipped[i, t].item() == float(is_clipped)
            # by hand: d/d log pi of -rho A is -rho A; 0 where the clip or the bound took a constant
            expected = 0.0 if is_bounded or is_clipped else -weights[i, t].item() * rho * a
            assert logprobs.grad[i, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert (logprobs.grad[i, n:] == 0).all()  # padding
    # every case: A > 0 inside and clipped, A < 0 inside, clipped low and bounded (ratio past c)
    assert kinds == {
        (False, False, False),
        (False, False, True),
        (True, False, False),
        (True, False, True),
        (True, True, False),
    }
    assert 0 < bounded[mask.bool()].mean().item() < 0.5


@pytest.mark.parametrize("module", SCRIPTS, ids=["ppo", "grpo", "rloo", "dapo"])
def test_dual_clip_off_is_the_clipped_loss_itself(module):
    new, old, adv, _ = ragged(seed=8)
    clipped_loss = module.clip_loss(new, old, adv, 0.2, 0.2)[0]
    loss, bounded = module.dual_clip_loss(clipped_loss, adv, 0.0)
    assert loss is clipped_loss  # untouched: the default runs stay bitwise what they were
    assert not bounded.any()


def eq13(length, cut_off, response_length, buffer, factor):
    """DAPO eq. 13 times f: 0 up to L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache up to L_max, -1 past it (a
    response cut off at the limit is past it: it would have gone on)."""
    if cut_off:
        return -factor
    if length <= response_length - buffer:
        return 0.0
    return factor * ((response_length - buffer) - length) / buffer


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_overlong_punishment_is_dapos_equation_13(mask_truncated):
    """Every length from 1 to the limit, ended or cut off (at the limit), for buffers of 1, 5 and the whole length;
    with --mask_truncated a cut-off response is left out of the loss and not punished."""
    L = 12
    for buffer in (1, 5, L):
        lengths = torch.tensor([*range(1, L + 1), L], dtype=torch.float64)
        has_eos = torch.tensor([True] * L + [False])
        got = dapo.overlong_penalty(lengths, has_eos, L, buffer, 0.7, mask_truncated)
        for n, ended, value in zip(lengths.tolist(), has_eos.tolist(), got.tolist()):
            expected = eq13(n, not ended, L, buffer, 0.7)
            if mask_truncated and not ended:
                expected = 0.0
            assert value == pytest.approx(expected, rel=1e-12, abs=1e-15), (buffer, n, ended)
        assert got[L - 1].item() == pytest.approx(-0.7)  # ended at the limit: the full punishment
    off = dapo.overlong_penalty(torch.tensor([3, L]), torch.tensor([True, False]), L, 0, 0.7, mask_truncated)
    assert off.tolist() == [0.0, 0.0]


def test_dynamic_sampling_keeps_the_first_groups_with_signal_in_the_order_drawn():
    """Three rounds of two processes' rows (groups of 2, 4 groups a round): the rollout is the first 4 groups with
    signal in the order drawn, then those without in the order drawn (dapo.py's rows_with_signal_first); each process
    takes its half (runtime.keep_rows); prompts of another width are padded on the left, responses on the right.
    Against a plain loop over the groups."""
    G = 2
    g = torch.Generator().manual_seed(3)
    rounds = []
    signals = [[0, 1, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]]  # per group: 3 with signal in all, then 9 without
    for r, signal in enumerate(signals):
        P = 3 + r  # another prompt width each round
        T = 5 - r
        rounds.append(
            dict(
                prompt_ids=torch.randint(2, 50, (8, P), generator=g),
                prompt_mask=torch.ones(8, P, dtype=torch.long),
                response_ids=torch.randint(2, 50, (8, T), generator=g),
                response_mask=torch.ones(8, T, dtype=torch.long),
                has_eos=torch.ones(8),
                signal=torch.tensor(signal).repeat_interleave(G).float(),
                raw=torch.arange(8).float() + 10 * r,
            )
        )
    order = []  # (round, group) with signal first, each kind in the order drawn
    for wanted in (1, 0):
        order += [(r, k) for r in range(3) for k in range(4) if signals[r][k] == wanted]
    expected_raw = [10 * r + G * k + j for r, k in order[:4] for j in range(G)]
    tokenizer = type("Tokenizer", (), {"pad_token_id": 0, "batch_decode": lambda self, ids, **kw: [""] * len(ids)})()
    # dapo.py's main: every round's rows, those of groups with signal first in the order drawn, one round's worth
    signal = torch.cat([rows["signal"] for rows in rounds])
    chosen = dapo.rows_with_signal_first(signal, len(rounds[0]["signal"]))
    kept = [runtime.keep_rows(rounds, chosen, {}, 0, tokenizer, 2, rank)[0] for rank in (0, 1)]
    assert torch.cat([k["raw"] for k in kept]).tolist() == expected_raw
    for k, rows in zip(kept, (order[:2], order[2:4])):
        assert k["input_ids"].shape == (4, 5 + 5)  # the widest prompt, then the longest response
        for b, (r, group) in enumerate(rows):
            for j in range(G):
                source = rounds[r]
                row = G * group + j
                P = source["prompt_ids"].shape[1]
                T = source["response_ids"].shape[1]
                assert k["prompt_ids"][G * b + j, 5 - P :].tolist() == source["prompt_ids"][row].tolist()
                assert k["prompt_mask"][G * b + j, : 5 - P].sum() == 0  # left padding
                assert k["response_ids"][G * b + j, :T].tolist() == source["response_ids"][row].tolist()
                assert k["response_mask"][G * b + j, T:].sum() == 0  # right padding


@pytest.mark.parametrize(
    "module,kw,message",
    [
        (ppo, dict(dual_clip=1.0), r"--dual_clip must be 0 \(off\) or more than 1"),
        (grpo, dict(dual_clip=3.0, policy_loss="gspo"), r"--dual_clip bounds the clipped loss .* --policy_loss gspo"),
        (rloo, dict(dual_clip=3.0, policy_loss="cispo", clip_range_low=1.0), r"--policy_loss cispo has no such"),
        (dapo, dict(overlong_buffer=30), r"--overlong_buffer must lie in \[0, --response_length\]"),
        (dapo, dict(overlong_penalty=-1.0), "--overlong_penalty must be zero or more"),
        (dapo, dict(max_sampling_rounds=0), "--max_sampling_rounds must be at least 1"),
    ],
)
def test_bad_combinations_stop_in_one_sentence_before_any_model_loads(module, kw, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        module.validate(module.Args(output_dir=str(tmp_path / "run"), **kw))
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- dynamic sampling in runs

DYNAMIC = ["--max_sampling_rounds=3", "--save_every=3"]


def rounds_of(rows):
    return [r["rollout/sampling_rounds"] for r in rows if "rollout/sampling_rounds" in r]


def test_a_stop_in_a_later_sampling_round_resumes_bitwise(tmp_path):
    """The tiny arithmetic run (groups of 4) of dapo.py: iterations take 1 to 3 rounds. The rollout holds
    only groups with signal unless 3 rounds ran out, and the episodes count every response generated. The reward
    then fails in the second round of an iteration: the run stops with the checkpoint before that iteration, and
    resumed it is the run whose reward never failed, to its Adam states."""
    script = "dapo.py"
    args = [*cli(script), *ARITHMETIC, *DYNAMIC]
    full, _ = run_main(script, tmp_path / "full", *args)
    rounds = rounds_of(full)
    assert len(rounds) == 6
    assert max(rounds) > 1  # a round drawn again
    for row in full:
        if row["rollout/groups_kept"] == 2:
            assert row["adv/zero_signal_fraction"] == 0
    assert [r["episodes"] for r in full] == [8 * sum(rounds[: i + 1]) for i in range(6)]
    # the reward fails in round 2 of the first iteration past the first that draws again
    later = next(i for i, n in enumerate(rounds) if n > 1 and i > 0)
    batch = sum(rounds[:later]) + 2  # counting rollouts from 1
    out = tmp_path / "run"
    proc = launch(script, out, args, prelude=failing_reward(tmp_path, batch, rank=0))
    printed = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1, printed[-3000:]
    assert f"stopped after iteration {later}; to go on:" in printed, printed[-3000:]
    resume_as_printed(printed, out / f"checkpoint-{later}")
    assert without_timing(read_rows(out)) == without_timing(full)
    assert_bitwise_equal(final_state(out), final_state(tmp_path / "full"))


def test_time_generate_counts_every_sampling_rounds_generation(tmp_path, monkeypatch):
    """Each sampling round generates (here 0.2 s longer than it would) and scores: time/generate holds every round's
    generation, time/score every round's scoring and what follows, and the phases add up to the iteration (before,
    each round's lap of generate replaced the last, and the earlier rounds were in no phase)."""
    generate = dapo.generate

    def slow_generate(*args, **kwargs):
        time.sleep(0.2)
        return generate(*args, **kwargs)

    monkeypatch.setattr(dapo, "generate", slow_generate)
    rows, _ = run_main("dapo.py", tmp_path, *cli("dapo.py"), *ARITHMETIC, *DYNAMIC)
    assert max(rounds_of(rows)) > 1  # a round drawn again
    for row in rows:
        assert row["time/generate"] >= 0.2 * row["rollout/sampling_rounds"]
        phases = row["time/generate"] + row["time/score"] + row["time/optimize"]
        assert phases == pytest.approx(row["time/iteration"], abs=0.1)


def test_two_processes_keep_the_groups_one_process_keeps(held_out, tmp_path):
    """dapo.py (clip-higher, token mean, dynamic sampling, the overlong punishment) with dual clip, on two processes
    and on one: the same rounds, groups and metrics (within 1e-5), and the same weights. Each process draws its slice
    of every round; the kept groups are chosen from all of them and dealt out again."""
    options = [
        "--max_sampling_rounds=3",
        "--dual_clip=3",
        "--temperature=0.3",  # groups that all score alike, often: rounds drawn again
    ]
    one = tmp_path / "one"
    two = tmp_path / "two"
    rows_one, _ = run_main("dapo.py", one, *common("dapo.py", held_out), *options)
    rows_two = run_torchrun("dapo.py", two, *common("dapo.py", held_out), *options)
    assert_rows_agree(rows_two, rows_one)
    assert_same_model(two, one)
    assert max(rounds_of(rows_one)) > 1  # a round drawn again
