"""Forwards on real tokens: each micro-batch cut to the columns its rows use (rows of similar lengths together), the
LM head run only where a loss reads its output, and a group's prompt encoded once when sampling.

The references are independent of the code under test: every row run alone, with no padding at all and the model's
own default positions, and the log-softmax taken in float64 here. Cutting must change nothing but rounding:
- in float64 the logits and a classifier's values at every real position equal the row alone within 1e-9, for the
  padded batch and for the cut one, on every family of the model matrix;
- in float32 the forwards the scripts run (the rollout's chunks and the reward model read at the last token, through
  rlhf_runtime; a training micro-batch with its entropy, through ppo.py's response_logprobs, the same in every script)
  equal the row alone within 1e-5 on the embedded models;
- a group's rows, their prompt prefilled once and its cache repeated, sample the tokens each row samples alone, with
  log-probs within 1e-5 on the embedded policy in float32 (and 1e-9 in float64 on every family: test_models).
"""

import os

import pytest
import torch
from helpers import FAMILIES, PAD, ROOT, TOKENIZER, assert_group_prompts_prefilled_once
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import ppo
import rlhf_runtime as runtime
from rlhf_runtime.batches import by_length, cut_padding, head_outputs, in_chunks, position_ids_from

# real lengths; rows padded to 7 prompt and 8 response columns
PROMPTS = [2, 5, 3, 1, 4]
RESPONSES = [1, 4, 2, 6, 3]
P = 7
T = 8


def padded_batch(vocab, seed=0):
    """Five rows: prompts left-padded to P (two columns more than the longest), responses right-padded to T (two
    more), the layout the scripts' rollouts have. Returns input_ids, attention_mask (5, P + T) and each row's tokens."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.full((5, P + T), PAD)
    attention_mask = torch.zeros(5, P + T, dtype=torch.long)
    rows = []
    for b, (n, m) in enumerate(zip(PROMPTS, RESPONSES)):
        tokens = torch.randint(2, vocab, (n + m,), generator=g)
        input_ids[b, P - n : P + m] = tokens
        attention_mask[b, P - n : P + m] = 1
        rows.append(tokens)
    return input_ids, attention_mask, rows


def test_cut_padding_keeps_the_columns_some_row_uses_by_hand():
    """A worked example: prompts of 1 and 2 tokens in 4 columns, responses of 1 and 2 in 4; the first column any row
    uses is 2 and the last is 5, so the batch keeps columns 2..5, its prompt width becomes 2 and its response
    columns 2; per-response tensors lose their last 2 columns and per-row ones stay."""
    mask = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 0, 0]])
    ids = torch.arange(16).view(2, 8)
    per_token = torch.arange(8.0).view(2, 4)
    cut, p = cut_padding(
        dict(input_ids=ids, attention_mask=mask, logprobs_old=per_token, advantages=torch.tensor([0.5, -0.5])), 4
    )
    assert p == 2
    assert cut["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert cut["attention_mask"].tolist() == [[0, 1, 1, 0], [1, 1, 1, 1]]
    assert cut["logprobs_old"].tolist() == [[0.0, 1.0], [4.0, 5.0]]
    assert cut["advantages"].tolist() == [0.5, -0.5]


def test_by_length_puts_similar_lengths_together():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    assert by_length(torch.tensor([4, 3, 2, 1, 0]), mask).tolist() == [4, 1, 3, 0, 2]  # ties keep their order


@pytest.mark.parametrize("name", list(FAMILIES))
def test_cut_forwards_equal_each_row_alone_in_float64(name):
    """Logits and a classifier's values at every real position: the padded batch, the batch cut to its used columns
    and each row alone without padding agree within 1e-9 (float64), for every family (learned absolute positions,
    a scaled embedding, a routed MLP among them)."""
    torch.manual_seed(0)
    eager = dict(experts_implementation="eager") if name == "qwen3_moe" else {}  # grouped_mm has no float64 on CPU
    policy = AutoModelForCausalLM.from_config(FAMILIES[name](), **eager).double().eval()
    critic = AutoModelForSequenceClassification.from_config(FAMILIES[name](num_labels=1), **eager).double().eval()
    input_ids, attention_mask, rows = padded_batch(len(TOKENIZER))
    cut, p = cut_padding(dict(input_ids=input_ids, attention_mask=attention_mask), P)
    assert p == max(PROMPTS)
    assert cut["input_ids"].shape[1] == max(PROMPTS) + max(RESPONSES)
    values = []

    def record_values(module, inputs, output):
        values.append(output[..., 0])

    hook = critic.score.register_forward_hook(record_values)
    with torch.no_grad():
        outputs = []
        for ids, mask, start in ((input_ids, attention_mask, P), (cut["input_ids"], cut["attention_mask"], p)):
            positions = position_ids_from(mask)
            logits = policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            critic(input_ids=ids, attention_mask=mask, position_ids=positions)
            outputs.append((logits, values.pop(), start))
        for b, tokens in enumerate(rows):
            alone_logits = policy(input_ids=tokens[None]).logits[0]  # (n + m, V), positions 0.. by default
            critic(input_ids=tokens[None])
            alone_values = values.pop()[0]
            for logits, row_values, start in outputs:
                real = slice(start - PROMPTS[b], start + RESPONSES[b])
                torch.testing.assert_close(logits[b, real], alone_logits, atol=1e-9, rtol=1e-9)
                torch.testing.assert_close(row_values[b, real], alone_values, atol=1e-9, rtol=1e-9)
    hook.remove()


def alone_logprobs(policy, tokens, n, temperature):
    """A row's response log-probs and entropies (m,) run alone, the log-softmax in float64."""
    logp = torch.log_softmax(policy(input_ids=tokens[None]).logits[0, n - 1 : -1].double() / temperature, -1)
    return logp.gather(-1, tokens[n:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.fixture(scope="module")
def embedded():
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft")).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(os.path.join(ROOT, "assets", "tiny-rm")).eval()
    return policy, rm


def test_the_rollouts_chunks_equal_each_row_alone(embedded):
    """in_chunks (2 rows at a time, sorted by length, each chunk cut): the reference's log-probs, the critic's values
    before each token and the reward model's score at the last token equal each row alone within 1e-5 (the log-probs 0
    past each response); the LM head runs on the response's positions (and the one before) alone."""
    policy, rm = embedded
    input_ids, attention_mask, rows = padded_batch(len(TOKENIZER), seed=1)
    head_positions = []

    def record_positions(module, inputs, output):
        head_positions.append(inputs[0].shape[1])

    hook = policy.get_output_embeddings().register_forward_hook(record_positions)
    with torch.no_grad():
        logprobs = in_chunks(
            lambda i, m, p: ppo.response_logprobs(policy, i, m, p, 0.7), 2, input_ids, attention_mask, P
        )
        values = in_chunks(lambda i, m, p: head_outputs(rm, i, m)[:, p - 1 : -1], 2, input_ids, attention_mask, P)
        scorer = runtime.Scorer([(rm, None)], [], TOKENIZER, runtime.new_state(), ppo.combine_scores)
        args = ppo.Args(micro_batch_size=2)
        scores = runtime.score_responses(scorer, input_ids, attention_mask, P, [{}] * 5, args).raw
        hook.remove()
        assert logprobs.shape == values.shape == (5, T)
        # Sorted by length (3, 9, 5, 7, 7 tokens) the chunks are rows (0, 2), (3, 4), (1,): the LM head runs on each
        # one's longest response and the position before it
        assert head_positions == [2 + 1, 6 + 1, 4 + 1]
        for b, tokens in enumerate(rows):
            n = PROMPTS[b]
            m = RESPONSES[b]
            expected, _ = alone_logprobs(policy, tokens, n, 0.7)
            torch.testing.assert_close(logprobs[b, :m].double(), expected, atol=1e-5, rtol=1e-6)
            assert (logprobs[b, m:] == 0).all()  # the values there are the scripts' to mask (values_old is)
            alone_values = head_outputs(rm, tokens[None], torch.ones_like(tokens[None]))[0]  # (n + m,)
            torch.testing.assert_close(values[b, :m], alone_values[n - 1 : -1], atol=1e-5, rtol=0)
            torch.testing.assert_close(scores[b], alone_values[-1], atol=1e-5, rtol=0)


def test_a_training_micro_batch_cut_equals_each_row_alone(embedded):
    """The training loop's path: rows ordered by length, a micro-batch of 3 cut, log-probs and entropies with their
    gradient; each equals the row alone within 1e-5, and so does the gradient of a token-mean loss over all rows."""
    policy, _ = embedded
    input_ids, attention_mask, rows = padded_batch(len(TOKENIZER), seed=2)
    rollout = dict(input_ids=input_ids, attention_mask=attention_mask, advantages=torch.arange(5.0))
    order = by_length(torch.arange(5), attention_mask)
    assert order.tolist() == [0, 2, 3, 4, 1]  # rows of 3, 9, 5, 7 and 7 tokens; ties keep their order
    loss = 0.0
    for micro_idx in order.split(3):
        micro, p = cut_padding({k: v[micro_idx] for k, v in rollout.items()}, P)
        logprobs, entropy = ppo.response_logprobs(
            policy, micro["input_ids"], micro["attention_mask"], p, 1.0, return_entropy=True
        )
        assert logprobs.shape[1] == max(RESPONSES[b] for b in micro_idx.tolist())
        for row, b in enumerate(micro_idx.tolist()):
            expected, expected_entropy = alone_logprobs(policy, rows[b], PROMPTS[b], 1.0)
            torch.testing.assert_close(logprobs[row, : RESPONSES[b]].double(), expected.detach(), atol=1e-5, rtol=1e-6)
            torch.testing.assert_close(
                entropy[row, : RESPONSES[b]].double(), expected_entropy.detach(), atol=1e-5, rtol=0
            )
        loss = loss + (logprobs * micro["advantages"][:, None]).sum()
    loss.backward()
    cut_grad = policy.model.layers[0].mlp.up_proj.weight.grad.clone()
    policy.zero_grad()
    sum(alone_logprobs(policy, tokens, PROMPTS[b], 1.0)[0].sum() * b for b, tokens in enumerate(rows)).backward()
    torch.testing.assert_close(cut_grad, policy.model.layers[0].mlp.up_proj.weight.grad.float(), atol=1e-5, rtol=1e-4)
    policy.zero_grad()


@pytest.mark.parametrize("kernel_decode", [False, True])
def test_a_groups_prompt_is_encoded_once_on_the_embedded_policy(kernel_decode):
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft")).eval()
    assert_group_prompts_prefilled_once(
        policy, TOKENIZER.pad_token_id, torch.tensor([TOKENIZER.eos_token_id]), len(TOKENIZER), 1e-5, kernel_decode
    )
