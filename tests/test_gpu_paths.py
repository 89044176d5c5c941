"""The GPU-only paths, shown on the CPU: the keys cached in bf16 under --mixed_precision (autocast on the CPU as on
a GPU), a failed CUDA-graph capture handing back the stream it found (torch.cuda made to fail the capture), a run
saved with --decode auto (CUDA graphs on one GPU) resumed with --decode plain, and the collectives' timeout against
--reward_timeout (NCCL's rule, shown on gloo)."""

import contextlib
import datetime
import os
import shutil
import sys
import time

import pytest
import torch
from helpers import ROOT, run_script, tiny_run, torchrun
from safetensors.torch import load_file
from test_real_use import hangs_on_rank_1
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config, Qwen2ForCausalLM

import ppo
from rlhf_kernels import decode

sys.path.insert(0, os.path.join(ROOT, "bench"))
from memory_accounting import kv_cache_bytes  # noqa: E402

TINY_LLAMA = os.path.join(ROOT, "assets", "tiny-sft")


def prompts():
    """Three left-padded prompts of the embedded tokenizer's ids (pad 1)."""
    return ppo.left_pad([[5, 9, 14, 30, 41, 7, 8], [12, 50, 60, 3], [70, 71, 72, 73, 74, 75]], 1, "cpu")


def tiny_qwen2(folder):
    """A random two-layer Qwen2 (Qwen2.5's family: biased q, k, v) of the embedded vocabulary, saved in folder."""
    config = Qwen2Config(
        vocab_size=784,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=1,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return str(folder)


def prefill(policy, prompt_ids, prompt_mask):
    """generate's prefill: its cache and the last position's logits."""
    cache = DynamicCache()
    out = policy(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=ppo.position_ids_from(prompt_mask),
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
    policy = ppo.load_model(AutoModelForCausalLM, path, ppo.Args(mixed_precision=True), "cpu", trained=True)
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
        next_position = ppo.position_ids_from(prompt_mask)[:, -1:] + 1
        decoder = decode.StaticDecoder(policy, logits, 64, sampling, ppo.sample_token, capture=True)  # as on a GPU
        with pytest.warns(UserWarning, match="could not be captured as a CUDA graph"):
            got = decoder.run(policy, cache, logits, prompt_mask, next_position, uniforms, 1.0)
    assert current[0].name == "found"
    assert decoder.graphs == {(1.0, False): None}  # not tried again
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[2], expected[2])


def test_a_run_saved_with_decode_auto_goes_on_with_the_plain_loop(tmp_path):
    """A one-GPU run (--decode auto: CUDA graphs) goes on under torchrun or on a CPU, where only the plain loop runs:
    its checkpoint after iteration 2, resumed with --decode plain, ends as the run never stopped, bitwise (on the CPU
    auto is the plain loop too; what is shown is that --decode is an option a resume may change)."""
    run = tiny_run("ppo.py", total_episodes=24, response_length=8, eval_every=0, save_every=1)  # three iterations
    full_rows, _ = run_script("ppo.py", tmp_path / "full", *run, "--decode=auto")
    checkpoint = tmp_path / "full" / "checkpoint-2"
    rows, printed = run_script("ppo.py", tmp_path / "resumed", *run, "--decode=plain", f"--resume={checkpoint}")
    assert "other values of" not in printed
    assert [r["iteration"] for r in rows] == [r["iteration"] for r in full_rows] == [1, 2, 3]
    timing = ("time/", "memory/")
    for got, expected in zip(rows, full_rows):  # the checkpoint's rows, then iteration 3 run again
        assert {k: v for k, v in got.items() if not k.startswith(timing)} == {
            k: v for k, v in expected.items() if not k.startswith(timing)
        }
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    for name, weight in load_file(tmp_path / "full" / "model.safetensors").items():
        assert torch.equal(resumed[name], weight), name


def test_the_collectives_wait_twice_the_reward_timeout_and_a_checkpoint(monkeypatch):
    """Under torchrun the process group's timeout is 2 x --reward_timeout + CHECKPOINT_S (NCCL's default of 10
    minutes is the default --reward_timeout itself), on gloo as on NCCL; with no reward timeout, a week."""
    seen = []

    def init_process_group(backend, timeout):
        seen.append((backend, timeout))

    monkeypatch.setattr(ppo.dist, "init_process_group", init_process_group)
    monkeypatch.setenv("WORLD_SIZE", "1")
    for reward_timeout in (600.0, 3.0, 0.0):
        ppo.start_processes(ppo.Args(reward_timeout=reward_timeout))
    assert ppo.CHECKPOINT_S >= 600
    assert seen == [
        ("gloo", datetime.timedelta(seconds=1200 + ppo.CHECKPOINT_S)),
        ("gloo", datetime.timedelta(seconds=6 + ppo.CHECKPOINT_S)),
        ("gloo", datetime.timedelta(days=7)),
    ]


def test_a_hung_rank_saves_on_both_within_the_collective_timeout(tmp_path):
    """The rule with a checkpoint allowed 30 s (grpo.py copied with CHECKPOINT_S = 30): rank 1's grader hangs, rank 0
    waits in the stop check's all_reduce for about --reward_timeout (3 s); the group's 36 s outlast that wait, both
    processes save checkpoint-1 and the run ends with the command that goes on, not with gloo's timeout."""
    project = tmp_path / "project"  # grpo.py beside the repository's assets and kernels
    project.mkdir()
    for name in ("assets", "rlhf_kernels"):
        os.symlink(os.path.join(ROOT, name), project / name)
    script = str(project / "grpo.py")
    shutil.copy(os.path.join(ROOT, "grpo.py"), script)
    text = open(script).read()
    assert "\nCHECKPOINT_S = 1200 " in text
    with open(script, "w") as f:
        f.write(text.replace("\nCHECKPOINT_S = 1200 ", "\nCHECKPOINT_S = 30 "))
    out = tmp_path / "run"
    started = time.time()
    result = torchrun(script, out, *hangs_on_rank_1(tmp_path), "--reward_timeout=3")
    assert result.returncode != 0
    assert "stopped after iteration 1; to go on:\n  torchrun --nproc_per_node=2 " in result.stdout, result.stderr[
        -3000:
    ]
    assert "no answer within --reward_timeout 3 s" in result.stderr
    assert "Timed out" not in result.stderr
    assert os.listdir(out / "checkpoint-1")
    assert time.time() - started < 120
