"""bench/tool_cache.py's converse_kept, the KV cache kept across a conversation's turns, samples what
grpo_tools.converse samples with the cache rebuilt each turn: the same tokens, masks, messages and counts, and the
same log-probs up to float32 rounding (the kept cache's attention sums over its holes, each of weight 0, in another
order). On the shipped policy and tool, in turns 1 and 2; with a policy made to call the tool again after each answer,
in turn 3 too, where the cache holds rows that ended their turn early and blocks of different lengths."""

import os
import sys
from dataclasses import replace

import pytest
import torch
from helpers import ROOT

import grpo_tools

sys.path.insert(0, os.path.join(ROOT, "bench"))
import tool_cache  # noqa: E402

MODEL = os.path.join(ROOT, "assets", "tiny-tools")
TRAIN = os.path.join(ROOT, "assets", "multiply", "train.jsonl")
pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(MODEL, "model.safetensors")),
    reason="assets/tiny-tools is not built (python assets/build.py --tools)",
)


@pytest.fixture(scope="module")
def default():
    """grpo_tools.py's first iteration at 4 prompts x 4: the policy, the prompts, their mask, Conversing, the draws."""
    setup = tool_cache.embedded_default(MODEL, TRAIN, 4, 4)
    yield setup
    for process in setup[3].tools.processes.values():
        if process.process is not None:
            process.kill()


def assert_same_conversations(rebuilt, kept):
    """Every output equal, the log-probs within 1e-5."""
    responses, logprobs, response_mask, messages, turns = rebuilt
    assert torch.equal(responses, kept[0])
    assert torch.equal(response_mask, kept[2])
    assert torch.equal(turns.policy_mask, kept[4].policy_mask)
    assert torch.equal(turns.finished, kept[4].finished)
    assert messages == kept[3]
    for key, value in turns.counts.items():
        assert torch.equal(value, kept[4].counts[key]), key
    assert (logprobs - kept[1]).abs().max().item() <= 1e-5


def test_the_kept_cache_samples_the_rebuilt_caches_conversations(default):
    policy, prompt_ids, prompt_mask, sampling, uniforms = default
    rebuilt = grpo_tools.converse(policy, prompt_ids, prompt_mask, sampling, uniforms)
    kept = tool_cache.converse_kept(policy, prompt_ids, prompt_mask, sampling, uniforms)
    assert (rebuilt[4].counts["turns"] >= 2).sum() >= 2, "fewer than 2 of 16 rows had a tool turn: nothing checked"
    assert_same_conversations(rebuilt, kept)


class CallsAgain(torch.nn.Module):
    """The policy, made to call the tool in its first turn and again after about half of the answers: its logit of
    <tool_call> raised where the tokens read end with the prompt's "=", or with </tool_response> after a token of even
    id (for a number, about half of its last digits). A function of the last two tokens read, so both caches see the
    same policy; a decode step reads one token and is left alone."""

    def __init__(self, policy, tokenizer):
        super().__init__()
        self.policy = policy
        self.ends = tokenizer.convert_tokens_to_ids(["=", "</tool_response>", "<tool_call>"])

    def forward(self, input_ids, **kwargs):
        out = self.policy(input_ids=input_ids, **kwargs)
        equals, closing, opening = self.ends
        if input_ids.shape[1] >= 2:
            after_even = (input_ids[:, -1] == closing) & (input_ids[:, -2] % 2 == 0)  # (B,)
            out.logits[:, -1, opening] += 30.0 * ((input_ids[:, -1] == equals) | after_even)
        return out


def test_third_turns_with_rows_done_early_and_greedy(default):
    """A response of 128 tokens and a policy that calls again after some answers: rows reach turn 3 while others left
    the cache after turn 2; sampled, and greedy. At T = 2: the shipped policy copies a tool's answer with a
    probability so near 1 that its log-probs would not show a wrong mask; at T = 2 they do, and its turns vary in
    length, so that rows wait on others and the cache has holes."""
    policy, prompt_ids, prompt_mask, sampling, _ = default
    again = CallsAgain(policy, sampling.tokenizer)
    sampling = replace(sampling, max_new_tokens=128, temperature=2.0)
    uniforms = torch.rand(len(prompt_ids), 128, generator=torch.Generator().manual_seed(0))
    for draws in (uniforms, None):
        rebuilt = grpo_tools.converse(again, prompt_ids, prompt_mask, sampling, draws)
        kept = tool_cache.converse_kept(again, prompt_ids, prompt_mask, sampling, draws)
        turns = rebuilt[4].counts["turns"]  # (B,)
        assert (turns == 3).sum() >= 1, turns
        assert (turns == 2).sum() >= 1, turns  # a row that left the cache after its second turn
        assert_same_conversations(rebuilt, kept)
