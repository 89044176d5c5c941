"""Running an algorithm file the way a user does: a subprocess, offline, with transformers' own hub-kernel default;
and the check that rlhf_kernels' static decode loop samples what generate's plain loop samples."""

import json
import os
import re
import subprocess
import sys

import torch
from transformers import LlamaConfig

import ppo
from rlhf_kernels import decode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ENV = {k: v for k, v in os.environ.items() if k != "USE_HUB_KERNELS"}  # transformers' default must not matter
ENV.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]  # gloo on the CPU

# The sizes of a tiny run: 8 responses an iteration (ppo.py: 8 prompts; grpo.py and rloo.py: 2 prompts x 4 responses)
# in one minibatch and one micro-batch, so one optimiser step an iteration. --total_episodes is each test's own (16:
# two iterations).
GROUPS_OF_FOUR = dict(rollout_batch_size=2, num_generations=4, minibatch_size=8, micro_batch_size=8)
TINY_SIZES = {
    "ppo.py": dict(rollout_batch_size=8, minibatch_size=8, micro_batch_size=8, num_epochs=1),
    "grpo.py": GROUPS_OF_FOUR,
    "rloo.py": GROUPS_OF_FOUR,
    "dapo.py": GROUPS_OF_FOUR,
}
# grpo.py's and rloo.py's groups of 8: 4 prompts x 8 responses an iteration, in two minibatches of two micro-batches
GROUPS_OF_EIGHT = ["--rollout_batch_size=4", "--num_generations=8", "--minibatch_size=16", "--micro_batch_size=8"]


def tiny_llama_config(**changes):
    """The tests' tiny random Llama: 40 tokens, 2 layers of width 32, 4 heads over 2 key-value heads, pad 0, EOS 1 and
    no BOS, with the test's own changes (a vocabulary, a label count, ...)."""
    sizes = dict(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return LlamaConfig(**{**sizes, **changes})


def set_up(module, args):
    """main's set-up steps before any model loads, in its order: the checks, the lock, the reward functions, the
    checkpoint to go on from."""
    module.validate(args)
    module.lock_output_dir(args)
    module.load_reward_fns(args)
    module.find_checkpoint(args)


def options(**values):
    """Command-line options of one value each, as `--name=value` strings."""
    return [f"--{name}={value}" for name, value in values.items()]


def tiny_run(script, **changes):
    """The options of a tiny run of the script (TINY_SIZES), with the test's own options and changes."""
    return options(**{**TINY_SIZES[script], **changes})


def run_script(script, out, *args):
    """Run `python script --output_dir out args...` from the repository root; return the rows of its
    metrics.jsonl and everything it printed. Fails the test, with the end of stderr, if the run fails."""
    cmd = [sys.executable, os.path.join(ROOT, script), "--output_dir", str(out), *args]
    result = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return rows, result.stdout + result.stderr


def torchrun(script, out, *args, processes=2):
    """`torchrun --nproc_per_node=processes script --output_dir out args...` from the repository root, offline (gloo
    on the CPU); returns the finished process."""
    cmd = [*TORCHRUN[:-1], f"--nproc_per_node={processes}", os.path.join(ROOT, script), "--output_dir", str(out), *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def readme_files(folder, documents=None):
    """The files the documents show (their ```python blocks that open with `# name.py`), written into folder:
    {name: path}. documents: paths from the repository root; by default README.md, docs/*.md and bench/README.md,
    the documents tests/test_readme_commands.py parses."""
    if documents is None:
        docs = sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
        documents = ["README.md", *docs, "bench/README.md"]
    written = {}
    for document in documents:
        text = open(os.path.join(ROOT, document)).read()
        for name, code in re.findall(r"```python\n# ([\w.]+\.py)\n(.*?)```", text, re.S):
            written[name] = os.path.join(folder, name)
            with open(written[name], "w") as f:
                f.write(code)
    return written


def assert_static_decode_matches_dynamic(policy, pad_token_id, stop_ids, vocab_size):
    """generate with its decode steps handed to rlhf_kernels' static_decode (buffers of fixed shape; no CUDA graph on
    the CPU) gives the plain loop's tokens and response masks, and its log-probs within 1e-6, on left-padded prompts
    of different lengths, sampled at T = 0.7 and 1 (uniforms of 0 draw token 0, the EOS, so that rows stop at
    different steps) and greedily; the second batch (another prompt width, the same cache width) reuses the first's
    buffers, the third (prompts of 60 tokens) needs a wider cache, which replaces the first (one decoder per batch
    size). Run the policy in float64: in float32 the static cache's attention, which also reads its unused columns
    (each with a weight of exactly 0), sums in another order, and the log-probs differ by rounding, about 1e-5 (as a
    teacher-forced pass differs from them)."""
    g = torch.Generator().manual_seed(1)
    for lengths in ([1, 5, 3, 8, 2, 6], [4, 2, 9, 1, 3, 7], [60, 3, 5, 1, 2, 7]):
        prompts = [torch.randint(2, vocab_size, (n,), generator=g).tolist() for n in lengths]
        prompt_ids, prompt_mask = ppo.left_pad(prompts, pad_token_id, "cpu")
        uniforms = torch.rand(6, 10, generator=g)
        uniforms[0, 3] = 0.0
        uniforms[2, 0] = 0.0
        uniforms[3, 6] = 0.0
        for temperature in (0.7, 1.0):
            dynamic = ppo.Sampling(10, temperature, stop_ids, pad_token_id)
            static = ppo.Sampling(10, temperature, stop_ids, pad_token_id, kernel_decode=True)
            for draws in (uniforms, None):
                expected = ppo.generate(policy, prompt_ids, prompt_mask, dynamic, draws)
                got = ppo.generate(policy, prompt_ids, prompt_mask, static, draws)
                assert torch.equal(got[0], expected[0])
                assert torch.equal(got[2], expected[2])
                torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=0)
                if draws is not None:  # rows stop at different steps
                    assert len(set(expected[2].sum(1).tolist())) > 2
        widths = [decoder.width for key, decoder in decode.DECODERS.items() if key[0] is policy]
        assert widths == [64 if max(lengths) < 54 else 128]


def assert_group_prompts_prefilled_once(policy, pad_token_id, stop_ids, vocab_size, atol, kernel_decode=False):
    """grpo.py's and rloo.py's rollouts repeat each prompt for its group; generate encodes each run of equal rows once
    and repeats its keys and values. Against each row sampled alone (prefilled by itself, no padding: what generate
    did before the sharing), every row samples the same tokens, and their log-probs agree within atol. Groups of 3,
    2, 1 and 2 rows; the last repeats the first group's prompt, but not next to it, so it is encoded again: the policy
    is called on 4 rows for the prefill. Uniforms of 0 make rows stop at different steps."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3)]
    prompt_ids, prompt_mask = ppo.left_pad([prompts[i] for i in (0, 0, 0, 1, 1, 2, 0, 0)], pad_token_id, "cpu")
    uniforms = torch.rand(8, 10, generator=g)
    uniforms[0, 2] = 0.0
    uniforms[4, 5] = 0.0
    uniforms[6, 0] = 0.0
    sampling = ppo.Sampling(10, 0.7, stop_ids, pad_token_id, kernel_decode)
    batches = []

    def record_batch(module, args, kwargs):
        batches.append(kwargs["input_ids"].shape)

    hook = policy.register_forward_pre_hook(record_batch, with_kwargs=True)
    together = ppo.generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
    hook.remove()
    assert batches[0] == (4, 9)  # the prefill: one row per run of equal prompts
    assert all(shape[0] == 8 for shape in batches[1:])  # each decode step: every row
    assert len(set(together[2].sum(1).tolist())) > 2  # rows stop at different steps
    for b in range(8):
        width = int(prompt_mask[b].sum())
        alone = ppo.generate(
            policy, prompt_ids[b : b + 1, -width:], prompt_mask[b : b + 1, -width:], sampling, uniforms[b : b + 1]
        )
        n = alone[0].shape[1]
        assert torch.equal(alone[0][0], together[0][b, :n])
        assert (together[2][b, n:] == 0).all()
        torch.testing.assert_close(alone[1][0], together[1][b, :n], atol=atol, rtol=0)
