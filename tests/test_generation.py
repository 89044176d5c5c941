"""Sampling and the log-probs it records (each script's own Sampling, generate and response_logprobs, identical in the
four and kept so by tests/test_code.py's drift test: ppo.py's copy stands for all; the positions and padding are
rlhf_runtime.batches'): the log-probs recorded while sampling equal a teacher-forced forward, the samples follow the
tempered softmax, a response does not depend on its batch, rlhf_kernels' static decode loop samples what the plain
loop samples, and the log-probs equal plain torch's and are 0 past each response's end. The GPU-only paths of that
loop, shown on the CPU: its cache holds bf16 keys under --mixed_precision (autocast on the CPU as on a GPU), and a
failed CUDA-graph capture (torch.cuda made to fail it) hands back the stream it found."""

import contextlib
import json
import os
import sys

import pytest
import torch
from helpers import (
    FAMILIES,
    ROOT,
    assert_rows_sample_as_alone,
    assert_static_decode_matches_dynamic,
    left_padded_prompts,
    tiny_llama_config,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaForCausalLM, Qwen2ForCausalLM

import ppo
import rlhf_runtime as runtime
from rlhf_kernels import decode
from rlhf_runtime.batches import left_pad, position_ids_from
from rlhf_runtime.loading import load_model
from rlhf_runtime.settings import RunSettings

sys.path.insert(0, os.path.join(ROOT, "bench"))
from memory_accounting import kv_cache_bytes  # noqa: E402

# the tiny Llama's (helpers.tiny_llama_config)
PAD = 0
EOS = 1


def test_sampled_logprobs_equal_teacher_forced():
    """logprobs_old recorded while sampling with a KV cache == one full forward over the finished sequences."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(tiny_llama_config()).eval()
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
    policy = LlamaForCausalLM(tiny_llama_config()).eval()
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
    policy = LlamaForCausalLM(tiny_llama_config()).eval()
    prompt_ids, prompt_mask = left_padded_prompts([1, 5, 3, 8, 2, 6], 40, seed=1)
    uniforms = torch.rand(6, 10, generator=torch.Generator().manual_seed(2))
    sampling = ppo.Sampling(10, 0.7, EOS, PAD, kernel_decode)
    together = ppo.generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
    assert_rows_sample_as_alone(policy, prompt_ids, prompt_mask, sampling, uniforms, together, atol=1e-5, rtol=1e-5)


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
    # main's Sampling takes its kernel_decode from runtime.graphs_decode (load_task no longer builds it)
    assert not runtime.graphs_decode(args.run.decode, torch.device("cpu"))
    runtime.Log(args, dict(elapsed=0.0, iteration=0), 0, None, ppo.PRINTED).file.close()
    assert json.load(open(out / "args.json"))["decode"] == "auto"


def test_response_logprobs_equal_plain_torch():
    """The scripts' log-probs, through rlhf_kernels/, equal log_softmax + gather on the same forward."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(tiny_llama_config()).eval()
    input_ids, attention_mask = left_padded_prompts([4, 9, 6], 40, seed=2)
    P = 3
    with torch.no_grad():
        logp, entropy = ppo.response_logprobs(policy, input_ids, attention_mask, P, 0.7, return_entropy=True)
        logits = policy(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask)
        ).logits.double()
        plain = torch.log_softmax(logits[:, P - 1 : -1] / 0.7, -1)
    valid = attention_mask[:, P:].bool()  # positions past a row's end (here: its left padding) are exactly 0
    expected = torch.where(valid, plain.gather(-1, input_ids[:, P:, None]).squeeze(-1), 0.0)
    torch.testing.assert_close(logp.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        entropy.double(), torch.where(valid, -(plain.exp() * plain).sum(-1), 0.0), atol=1e-5, rtol=1e-5
    )


def test_response_logprobs_are_zero_past_the_end_at_a_low_temperature():
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft")).eval()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 0, 0], [5, 6, 7, 10, 11, 12, 13]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        logprobs, entropy = ppo.response_logprobs(policy, input_ids, attention_mask, 3, 0.1, return_entropy=True)
        # the same rows one at a time, unpadded: the reference for the valid positions
        alone = ppo.response_logprobs(policy, input_ids[:1, :5], attention_mask[:1, :5], 3, 0.1)
    assert (logprobs[0, 2:] == 0).all()
    assert (entropy[0, 2:] == 0).all()
    assert torch.allclose(logprobs[0, :2], alone[0], atol=1e-5)
    assert torch.isfinite(logprobs).all()


# ---------------------------------------------------------------- the static decode loop's cache and capture


TINY_LLAMA = os.path.join(ROOT, "assets", "tiny-sft")


def tiny_qwen2(folder):
    """A random two-layer Qwen2 (Qwen2.5's family: biased q, k, v) of the embedded vocabulary, saved in folder."""
    torch.manual_seed(0)
    Qwen2ForCausalLM(FAMILIES["qwen2"]()).save_pretrained(folder)
    return str(folder)


def prompts():
    """Three left-padded prompts of the embedded tokenizer's ids (pad 1)."""
    return left_pad([[5, 9, 14, 30, 41, 7, 8], [12, 50, 60, 3], [70, 71, 72, 73, 74, 75]], 1, "cpu")


def prefill(policy, prompt_ids, prompt_mask):
    """generate's prefill: its cache and the last position's logits."""
    cache = DynamicCache()
    out = policy(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=position_ids_from(prompt_mask),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return cache, out.logits[:, -1]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_keys_are_cached_in_bf16_under_mixed_precision(family, tmp_path):
    """--mixed_precision in one process: float32 weights under bf16 autocast. The keys and values of the prefill's
    cache and of rlhf_kernels' static decode loop's are bf16, and the static cache holds what bench/memory_accounting.py
    accounts (layers x 2 x KV heads x head size x 2 bytes per position); the float32 trunk's rotary cos and sin made
    the keys float32 before."""
    path = TINY_LLAMA if family == "llama" else tiny_qwen2(tmp_path / "qwen2")
    policy = load_model(AutoModelForCausalLM, path, RunSettings(mixed_precision=True), "cpu", trained=True)
    assert policy.model.embed_tokens.weight.dtype == torch.float32  # the trunk is float32: autocast does the rest
    prompt_ids, prompt_mask = prompts()
    with torch.no_grad():
        cache = prefill(policy, prompt_ids, prompt_mask)[0]
    assert [(layer.keys.dtype, layer.values.dtype) for layer in cache.layers] == [(torch.bfloat16,) * 2] * len(
        cache.layers
    )
    sampling = ppo.Sampling(6, 1.0, torch.tensor([0]), 1, kernel_decode=True)
    ppo.generate(
        policy, prompt_ids, prompt_mask, sampling, torch.rand(3, 6, generator=torch.Generator().manual_seed(0))
    )
    decoder = next(d for key, d in decode.DECODERS.items() if key[0] is policy)
    layers = decoder.cache.layers
    assert {layer.keys.dtype for layer in layers} | {layer.values.dtype for layer in layers} == {torch.bfloat16}
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    assert held == kv_cache_bytes(policy.config.to_dict(), 3, decoder.width)


class FakeStream:
    def __init__(self, name):
        self.name = name

    def wait_stream(self, other):
        pass


def test_a_failed_capture_restores_the_stream_it_found(monkeypatch):
    """torch.cuda on the CPU, the capture made to fail as torch 2.13's torch.cuda.graph fails in capture_begin: its
    stream made current on entry, the error raised before the exit that would restore it. rlhf_kernels' decoder warns,
    runs every step op by op (the tokens of its steps uncaptured), and the stream current afterwards is the one it
    found."""
    current = [FakeStream("found")]

    def set_stream(stream):
        current[0] = stream

    @contextlib.contextmanager
    def using(stream):
        before = current[0]
        current[0] = stream
        try:
            yield
        finally:
            current[0] = before

    class FailingCapture:
        def __init__(self, graph, stream):
            self.stream = stream

        def __enter__(self):
            current[0] = self.stream
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

        def __exit__(self, *exc):
            return False

    policy = AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()
    prompt_ids, prompt_mask = prompts()
    uniforms = torch.rand(3, 6, generator=torch.Generator().manual_seed(1))
    sampling = ppo.Sampling(6, 1.0, torch.tensor([0]), 1, kernel_decode=True)
    expected = ppo.generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
    for name, value in [
        ("Stream", lambda: FakeStream("capture")),
        ("CUDAGraph", object),
        ("current_stream", lambda: current[0]),
        ("set_stream", set_stream),
        ("stream", using),
        ("graph", FailingCapture),
    ]:
        monkeypatch.setattr(torch.cuda, name, value)
    with torch.no_grad():
        cache, logits = prefill(policy, prompt_ids, prompt_mask)
        next_position = position_ids_from(prompt_mask)[:, -1:] + 1
        decoder = decode.StaticDecoder(policy, logits, 64, sampling, ppo.sample_token, capture=True)  # as on a GPU
        with pytest.warns(UserWarning, match="could not be captured as a CUDA graph"):
            got = decoder.run(policy, cache, logits, prompt_mask, next_position, uniforms, 1.0)
    assert current[0].name == "found"
    assert decoder.graphs == {(1.0, False): None}  # not tried again
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[2], expected[2])
