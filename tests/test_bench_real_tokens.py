"""bench/real_tokens.py: the positions each layout computes against a hand count, and its packed and fused-head
layouts computing the log-probs of the padded one (the bench times them only because they do)."""

import os
import sys

import pytest
import torch
from helpers import tiny_llama_config
from transformers import LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import real_tokens  # noqa: E402

# 8 + 8 = 16 real tokens in rows 3 + 3 wide
PROMPTS = [2, 3, 1, 2]
RESPONSES = [1, 3, 2, 2]


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(pad_token_id=1, eos_token_id=2)).eval()


def test_the_positions_of_each_layout_by_hand(policy):
    input_ids, attention_mask, P = real_tokens.rows_of(PROMPTS, RESPONSES, 40)
    assert P == 3
    assert attention_mask.sum(1).tolist() == [3, 6, 3, 4]
    # one micro-batch of all four rows: padded and cut alike are 4 x 6 wide; packed computes the 16 real tokens
    rollout = real_tokens.Rollout(input_ids, attention_mask, P, minibatch=4, micro=4)
    counts = {x: real_tokens.epoch(x, policy, rollout) for x in real_tokens.LAYOUTS}
    assert counts == {
        "padded, full head": 24,
        "padded": 24,
        "sorted and cut": 24,
        "sorted and cut, fused head": 24,
        "packed": 16,
    }
    # micro-batches of one row: a cut row is its own tokens alone, 16 in all
    rollout = real_tokens.Rollout(input_ids, attention_mask, P, minibatch=4, micro=1)
    counts = {x: real_tokens.epoch(x, policy, rollout) for x in real_tokens.LAYOUTS}
    assert counts == {
        "padded, full head": 24,
        "padded": 24,
        "sorted and cut": 16,
        "sorted and cut, fused head": 16,
        "packed": 16,
    }
    # sorted, micro-batches of two: rows of 3, 3 tokens (0, 2: prompts 2 and 1, responses 1 and 2: 2 + 2 wide) and
    # 4, 6 (3, 1: prompts 2 and 3, responses 2 and 3: 3 + 3 wide): 2 x 4 + 2 x 6 = 20
    rollout = real_tokens.Rollout(input_ids, attention_mask, P, minibatch=4, micro=2)
    assert real_tokens.epoch("sorted and cut", policy, rollout) == 20


def test_packed_and_fused_log_probs_equal_the_padded_ones(policy):
    input_ids, attention_mask, P = real_tokens.rows_of(PROMPTS, RESPONSES, 40, seed=3)
    with torch.no_grad():
        padded = real_tokens.full_head_logprobs(policy, input_ids, attention_mask, P)
        for other in (real_tokens.packed_logprobs, real_tokens.fused_head_logprobs):
            got = other(policy, input_ids, attention_mask, P)
            assert (got[attention_mask[:, P:] == 0] == 0).all()
            torch.testing.assert_close(got, padded, atol=1e-5, rtol=1e-5)


def test_the_prefill_parts_before_side_encodes_every_row(policy):
    """The part's "every row" side stands for generate before the sharing: with the grouping replaced, the prefill
    runs on all 6 rows of 2 groups of 3 (not 2), and both sides sample the same tokens with the same log-probs."""
    from unittest import mock

    prompt_ids, prompt_mask = real_tokens.ppo.left_pad([[5, 6, 7]] * 3 + [[8, 9]] * 3, 1, "cpu")
    uniforms = torch.rand(6, 4, generator=torch.Generator().manual_seed(0))
    sampling = real_tokens.ppo.Sampling(4, 1.0, torch.tensor([0]), 1)
    batches = []

    def record_batch(module, args, kwargs):
        batches.append(kwargs["input_ids"].shape[0])

    hook = policy.register_forward_pre_hook(record_batch, with_kwargs=True)
    with mock.patch.object(torch, "unique_consecutive", real_tokens.every_row_alone):
        before = real_tokens.ppo.generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
    first = batches[0]
    batches.clear()
    now = real_tokens.ppo.generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
    hook.remove()
    assert (first, batches[0]) == (6, 2)
    assert torch.equal(before[0], now[0])
    torch.testing.assert_close(before[1], now[1], atol=1e-6, rtol=0)
