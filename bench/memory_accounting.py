"""The peak memory of PPO iterations against the seed's accounting of its four models.

Builds a random-weight policy and reward model with Qwen2.5-0.5B's shape (the embedded tokenizer, no hub
access), runs `ppo.py` for two iterations in a subprocess, and compares that process's peak resident memory with
the accounting: a trained model holds its weights, gradients and AdamW's two moments (4 x its weight bytes,
16 bytes per parameter in fp32), a frozen one its weights only. PPO trains the policy and the critic (initialised
from the reward model) and holds the reference and the reward model frozen.

    python bench/memory_accounting.py                    # fp32, about 20 GB: needs a machine with 24 GB or more
    python bench/memory_accounting.py --dtype bfloat16   # half of that
    python bench/memory_accounting.py --small            # a 2-layer, 64-wide model of the same vocabulary: a smoke test
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_algorithms import ROOT, measured, report  # noqa: E402

SHAPE = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def build(folder, shape, dtype):
    """Random policy and reward model, saved with the embedded tokenizer; returns their parameter counts."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
    config = Qwen2Config(
        **shape,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=True,
        num_labels=1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    counts = {}
    for name, model_class in (("policy", Qwen2ForCausalLM), ("rm", Qwen2ForSequenceClassification)):
        torch.manual_seed(0)
        model = model_class(config).to(getattr(torch, dtype))
        model.save_pretrained(os.path.join(folder, name))
        tokenizer.save_pretrained(os.path.join(folder, name))
        counts[name] = sum(p.numel() for p in model.parameters())
    return counts


def kv_cache_bytes(shape, batch, columns):
    """What a decode loop's KV cache holds for batch rows of columns positions: a key and a value per layer, KV head
    and position, in bf16 (with bf16 weights and with --mixed_precision alike: the rotary hook keeps its keys bf16)."""
    head_size = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    return batch * columns * shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head_size * 2


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--small", action="store_true")
    p.add_argument("--out", help="also write the table (markdown) here")
    a = p.parse_args()
    # first, while this process is small: a child's peak counts the parent's pages it was forked with
    baseline = measured([sys.executable, "-c", "import torch, transformers, tyro; import ppo"], os.devnull)
    with tempfile.TemporaryDirectory() as folder:
        counts = build(folder, SMALL if a.small else SHAPE, a.dtype)
        # two iterations of 8 prompts x 16 tokens (the second has AdamW's moments from the start and every gradient
        # at once), one minibatch, no evaluation: activations and logits stay small
        cmd = [
            sys.executable,
            os.path.join(ROOT, "ppo.py"),
            "--model_name_or_path",
            os.path.join(folder, "policy"),
            "--reward_model_path",
            os.path.join(folder, "rm"),
            "--output_dir",
            os.path.join(folder, "run"),
            "--model_dtype",
            a.dtype,
            "--total_episodes=16",
            "--rollout_batch_size=8",
            "--minibatch_size=8",
            "--micro_batch_size=8",
            "--num_epochs=1",
            "--response_length=16",
            "--eval_every=0",
            "--save_every=0",
        ]
        peak = measured(cmd, os.path.join(tempfile.gettempdir(), "memory_accounting.log"))  # kept when the run fails
    weight_bytes = 4 if a.dtype == "float32" else 2
    models = [
        ("policy (trained)", counts["policy"], 4),
        ("reference (frozen)", counts["policy"], 1),
        ("reward model (frozen)", counts["rm"], 1),
        ("critic (trained, from the reward model)", counts["rm"], 4),
    ]
    lines = [
        f"Qwen2.5-0.5B shape{' (small: 2 layers, width 64)' if a.small else ''}, random weights, "
        f"{a.dtype} weights and AdamW states, CPU",
        "",
        "| model | parameters | bytes per parameter | accounted MB |",
        "|---|---:|---:|---:|",
    ]
    total = 0.0
    for name, n, copies in models:
        mb = n * weight_bytes * copies / 2**20
        total += mb
        lines.append(f"| {name} | {n:,} | {weight_bytes * copies} | {mb:,.0f} |")
    lines += [
        f"| **the four models** | | | **{total:,.0f}** |",
        "",
        f"Measured peak of two PPO iterations (8 prompts x 16 tokens): {peak:,.0f} MB resident, "
        f"of which {baseline:,.0f} MB is the "
        f"Python process with torch and transformers imported; {peak - baseline:,.0f} MB above that, "
        f"{(peak - baseline) / total:.2f}x the accounting.",
        "",
        f"While sampling, the KV cache (bf16, --mixed_precision too): "
        f"{kv_cache_bytes(SMALL if a.small else SHAPE, 1, 1) / 2**10:g} KiB per token of each response.",
    ]
    report(lines, a.out)


if __name__ == "__main__":
    main()
