"""Computing on real tokens: what each layout of the training forward costs, what the change did to each
default's iteration time, and what encoding a group's prompt once saves in generation, on the CPU.

    python bench/real_tokens.py --out bench/real_tokens.md                # all three parts, about 12 minutes
    python bench/real_tokens.py --part layouts                             # the first part alone
    python bench/real_tokens.py --part scripts --before 741bf69 --repeats 3
    python bench/real_tokens.py --part layouts --settings gsm8k --device cuda --policy <folder> --dtype bfloat16
                                                                            # bench/gpu_check.py's real-tokens row
    python bench/real_tokens.py --part prefill --settings grpo,rloo,gsm8k     # the third part alone

Part 1, layouts: the policy's training forward and backward (log-probs of the response tokens, summed) over one epoch
of a rollout, micro-batch by micro-batch as the scripts split it, in four layouts of the same rows:
- padded, full head: every micro-batch padded to the rollout's widest prompt and longest response, the LM head over
  every position (the scripts before this change);
- padded: the same with the LM head on the response's positions only (`logits_to_keep`);
- sorted and cut: each minibatch's rows sorted by length, each micro-batch cut to the columns its rows use (the
  scripts now);
- sorted and cut, fused head: the same with the LM head and the log-softmax fused
  (`rlhf_kernels.linear_token_logprobs` on the trunk's output at the response's positions): the (tokens x
  vocabulary) logits never exist;
- packed: each micro-batch's real tokens in one row, positions restarting at every sequence, no attention mask, so
  that transformers builds a block-diagonal causal mask from the positions (`sdpa` on the CPU computes it whole).
The rows have the lengths of real rollouts of each default (bench/padding.py samples them as the scripts do) and of
the long-tailed GSM8K-like shape (prompts of 100 to 300 tokens, responses of 20 to 1,024, one minibatch of 40 rows in
micro-batches of 8) on a random Llama of 4.2M parameters with a 32k vocabulary. Reported: positions computed per real
token and the median time over the repeats, the layouts alternating within each repeat.

Part 2, scripts: each default run for a few iterations from a checkout of --before (the code before this change)
and from this tree, alternating, with evaluation off; the median of `time/iteration` (the first iteration left out),
and of its three phases. One thread per process (--threads), as bench/bench_trl.py does: two OpenMP threads on the
shared 2-core machine swing by 8x from one second to the next.

Part 3, prefill: generate on a rollout of groups (each prompt repeated for its group, as grpo.py and rloo.py sample),
every row's prompt encoded (generate before the sharing: the grouping it finds replaced by "no two rows alike") and
each group's prompt encoded once, its keys and values repeated, alternating. Timed: the prefill with the first token
(max_new_tokens 1) and the whole generate, at the defaults' prompt lengths and group sizes (the embedded policy) and
at the GSM8K-like shape (8 prompts x 5, responses up to the longest drawn or --new-tokens; the random Llama never
stops early), with --decode's loop (plain: generate's own; static: rlhf_kernels' static_decode, CUDA graphs on CUDA).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from padding import ROOT, long_tailed, rollout_lengths  # noqa: E402

import ppo  # noqa: E402  (ROOT is on sys.path through padding)
import rlhf_runtime as runtime  # noqa: E402

LAYOUTS = ["padded, full head", "padded", "sorted and cut", "sorted and cut, fused head", "packed"]


@dataclass
class Rollout:
    """A rollout's rows in the scripts' layout (rows_of) and how training splits them."""

    input_ids: torch.Tensor  # (B, P + T)
    attention_mask: torch.Tensor  # (B, P + T)
    P: int  # the prompts' width
    minibatch: int  # rows per minibatch
    micro: int  # rows per micro-batch


def rows_of(prompt_lens, response_lens, vocab, seed=0, device="cpu"):
    """Random tokens in the scripts' layout: prompts left-padded, responses right-padded (B, P + T); and P."""
    g = torch.Generator().manual_seed(seed)
    P = max(prompt_lens)
    T = max(response_lens)
    B = len(prompt_lens)
    input_ids = torch.ones(B, P + T, dtype=torch.long)
    attention_mask = torch.zeros(B, P + T, dtype=torch.long)
    for b, (n, m) in enumerate(zip(prompt_lens, response_lens)):
        input_ids[b, P - n : P + m] = torch.randint(2, vocab, (n + m,), generator=g)
        attention_mask[b, P - n : P + m] = 1
    return input_ids.to(device), attention_mask.to(device), P


def full_head_logprobs(policy, input_ids, attention_mask, P):
    """The log-prob forward before this change: the LM head over every position, the prompt's sliced off after."""
    logits = policy(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=runtime.position_ids_from(attention_mask)
    ).logits[:, P - 1 : -1]
    return ppo.token_logprobs(logits, input_ids[:, P:]) * attention_mask[:, P:]


def packed_logprobs(policy, input_ids, attention_mask, P):
    """The rows' real tokens in one row (1, N), positions restarting at each sequence; the head on the positions
    that predict a response token alone. Returns the log-probs (B, T), 0 past each response."""
    real = attention_mask.bool()
    at = (real.flatten().cumsum(0) - 1).view(real.shape)  # each real token's index in the packed row
    valid = real[:, P:]  # (B, T)
    keep = at[:, P - 1 : -1][valid]  # the packed positions whose logits predict a response token
    logits = policy(
        input_ids=input_ids[real][None],
        position_ids=runtime.position_ids_from(attention_mask)[real][None],
        logits_to_keep=keep,
        use_cache=False,
    ).logits[0]  # (response tokens, V); no cache: packed
    out = torch.zeros(valid.shape, device=input_ids.device)
    out[valid] = ppo.token_logprobs(logits, input_ids[:, P:][valid])
    return out


def fused_head_logprobs(policy, input_ids, attention_mask, P):
    """The trunk's output at the positions that predict a response token, through the fused head and log-softmax."""
    from rlhf_kernels import linear_token_logprobs

    hidden = policy.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=runtime.position_ids_from(attention_mask),
        use_cache=False,
    ).last_hidden_state
    valid = attention_mask[:, P:].bool()
    return linear_token_logprobs(hidden[:, P - 1 : -1], policy.lm_head.weight, input_ids[:, P:], mask=valid)


def epoch(layout, policy, rollout, seed=0):
    """One epoch of training forwards and backwards over the rollout in the layout; returns positions computed."""
    input_ids = rollout.input_ids
    perm = torch.randperm(len(input_ids), generator=torch.Generator().manual_seed(seed)).to(input_ids.device)
    computed = 0
    for mb in perm.split(rollout.minibatch):
        parts = mb
        if layout.startswith("sorted"):
            parts = runtime.by_length(mb, rollout.attention_mask)
        for idx in parts.split(rollout.micro):
            ids = input_ids[idx]
            mask = rollout.attention_mask[idx]
            p = rollout.P
            if layout.startswith("sorted"):
                cut, p = runtime.cut_padding(dict(input_ids=ids, attention_mask=mask), rollout.P)
                ids = cut["input_ids"]
                mask = cut["attention_mask"]
            if layout == "packed":
                logprobs = packed_logprobs(policy, ids, mask, p)
                computed += int(mask.sum())
            elif layout == "sorted and cut, fused head":
                logprobs = fused_head_logprobs(policy, ids, mask, p)
                computed += ids.numel()
            elif layout == "padded, full head":
                logprobs = full_head_logprobs(policy, ids, mask, p)
                computed += ids.numel()
            else:
                logprobs = ppo.response_logprobs(policy, ids, mask, p, 1.0)
                computed += ids.numel()
            logprobs.sum().backward()
    policy.zero_grad(set_to_none=True)
    return computed


def check_layouts_agree(policy, rollout, tolerance):
    """A layout is only worth timing if it computes the same log-probs: packed and fused checked on each setting."""
    input_ids = rollout.input_ids[:8]
    attention_mask = rollout.attention_mask[:8]
    with torch.no_grad():
        b = ppo.response_logprobs(policy, input_ids, attention_mask, rollout.P, 1.0)
        for other in (packed_logprobs, fused_head_logprobs):
            a = other(policy, input_ids, attention_mask, rollout.P)
            assert torch.allclose(a, b, atol=tolerance), (other.__name__, (a - b).abs().max())


def gsm8k_lengths(a):
    """The GSM8K-like setting's prompt and response lengths, times --length-scale (at least 1 token each)."""
    prompt_lens, response_lens = long_tailed()
    prompts = [max(1, round(x * a.length_scale)) for x in prompt_lens]
    responses = [max(1, round(x * a.length_scale)) for x in response_lens]
    return prompts, responses


def layouts_part(a):
    from transformers import AutoModelForCausalLM

    settings = []
    for script in [f"{x}.py" for x in ("ppo", "grpo", "rloo") if x in a.settings]:
        args, G, prompt_lens, response_lens = rollout_lengths(script, None, 1)
        policy = AutoModelForCausalLM.from_pretrained(args.run.model_name_or_path)
        settings.append(
            (
                f"`{script}` default, a rollout of {len(prompt_lens[0])}",
                policy,
                prompt_lens[0],
                response_lens[0],
                args.minibatch_size,
                args.micro_batch_size,
            )
        )
    if "gsm8k" in a.settings:
        p, r = gsm8k_lengths(a)
        policy, name = gsm8k_policy(a)
        settings.append(
            (
                f"GSM8K-like, {a.gsm8k_rows // 5} prompts x 5 ({name})",
                policy,
                p[: a.gsm8k_rows],
                r[: a.gsm8k_rows],
                a.gsm8k_rows,
                8,
            )
        )
    lines = [
        "| setting | "
        + " | ".join(f"{x}: positions per real token, seconds" for x in LAYOUTS)
        + " | sorted and cut / padded, full head | packed / padded, full head |",
        "|---|" + "---|" * 7,
    ]
    for name, policy, prompt_lens, response_lens, minibatch, micro in settings:
        policy = policy.to(a.device, getattr(torch, a.dtype)).train(False)
        input_ids, attention_mask, P = rows_of(prompt_lens, response_lens, policy.config.vocab_size, device=a.device)
        rollout = Rollout(input_ids, attention_mask, P, minibatch, micro)
        check_layouts_agree(policy, rollout, 1e-4 if a.dtype == "float32" else 0.1)
        real = int(attention_mask.sum())
        times = {x: [] for x in LAYOUTS}
        computed = {}
        epoch("padded", policy, rollout)  # warm-up
        for repeat in range(a.repeats):
            order = LAYOUTS if repeat % 2 == 0 else LAYOUTS[::-1]  # each layout first in turn
            for layout in order:
                synchronize(a.device)
                t0 = time.perf_counter()
                computed[layout] = epoch(layout, policy, rollout)
                synchronize(a.device)
                times[layout].append(time.perf_counter() - t0)
        median = {x: statistics.median(times[x]) for x in LAYOUTS}
        cells = " | ".join(f"{computed[x] / real:.2f}, {median[x]:.3f} s" for x in LAYOUTS)
        base = median["padded, full head"]
        line = f"| {name} | {cells} | **{median['sorted and cut'] / base:.2f}x** | {median['packed'] / base:.2f}x |"
        print(line, flush=True)
        lines.append(line)
    return lines


def every_row_alone(rows, dim, return_inverse):
    """torch.unique_consecutive as generate calls it, finding no two rows alike: every row's prompt prefilled."""
    return rows, torch.arange(len(rows), device=rows.device)


def sample(side, policy, ids, mask, sampling, uniforms):
    """generate on the side's prefill: "every row" (the grouping replaced by every_row_alone) or "once" (as it is)."""
    if side == "every row":
        with mock.patch.object(torch, "unique_consecutive", every_row_alone):
            return ppo.generate(policy, ids, mask, sampling, uniforms)
    return ppo.generate(policy, ids, mask, sampling, uniforms)


def prefill_part(a):
    from transformers import AutoModelForCausalLM

    settings = []
    for script in [f"{x}.py" for x in ("grpo", "rloo") if x in a.settings]:
        args, G, prompt_lens, _ = rollout_lengths(script, None, 1)
        policy = AutoModelForCausalLM.from_pretrained(args.run.model_name_or_path)
        settings.append(
            (
                f"`{script}` default, {len(prompt_lens[0]) // G} prompts x {G}",
                policy,
                prompt_lens[0],
                args.response_length,
                G,
            )
        )
    if "gsm8k" in a.settings:
        p, r = gsm8k_lengths(a)
        policy, name = gsm8k_policy(a)
        settings.append(
            (
                f"GSM8K-like, {a.gsm8k_rows // 5} prompts x 5 ({name})",
                policy,
                p[: a.gsm8k_rows],
                a.new_tokens or max(r[: a.gsm8k_rows]),
                5,
            )
        )
    lines = [
        "| setting | prompt positions prefilled, every row / once per group | prefill, every row | prefill, once "
        "| once / every row | generate, every row | generate, once | once / every row | same tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, policy, prompt_lens, T, G in settings:
        policy = policy.to(a.device, getattr(torch, a.dtype)).train(False)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(2, policy.config.vocab_size, (n,), generator=g).tolist() for n in prompt_lens[::G]]
        pad = policy.config.pad_token_id or 0
        ids, mask = runtime.left_pad([x for x in prompts for _ in range(G)], pad, a.device)
        uniforms = torch.rand(len(ids), T, generator=g).to(a.device)
        stop = torch.tensor([0], device=a.device)
        sampling_of = {steps: ppo.Sampling(steps, 1.0, stop, pad, a.decode == "static") for steps in (1, T)}
        times = {(side, steps): [] for side in ("every row", "once") for steps in (1, T)}
        warm = {}  # the tokens of a first call of each (CUDA graphs captured, kernels compiled)
        for side, steps in times:
            warm[side, steps] = sample(side, policy, ids, mask, sampling_of[steps], uniforms[:, :steps])[0]
        same = torch.equal(warm["every row", T], warm["once", T])
        for repeat in range(a.repeats):
            order = list(times) if repeat % 2 == 0 else list(times)[::-1]  # each first in turn
            for side, steps in order:
                synchronize(a.device)
                t0 = time.perf_counter()
                sample(side, policy, ids, mask, sampling_of[steps], uniforms[:, :steps])
                synchronize(a.device)
                times[side, steps].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        line = (
            f"| {name} | {int(mask.sum())} / {int(mask[::G].sum())} | {med['every row', 1]:.3f} s | "
            f"{med['once', 1]:.3f} s | {med['once', 1] / med['every row', 1]:.2f}x | {med['every row', T]:.3f} s | "
            f"{med['once', T]:.3f} s | **{med['once', T] / med['every row', T]:.2f}x** | "
            f"{'yes' if same else 'no'} |"
        )
        print(line, flush=True)
        lines.append(line)
    return lines


def gsm8k_policy(a):
    """The GSM8K-like setting's model: --policy, or a random Llama of 4.2M parameters with a 32k vocabulary."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    small = LlamaConfig(
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1536,
        pad_token_id=1,
    )
    if a.policy:
        return AutoModelForCausalLM.from_pretrained(a.policy), a.policy
    return AutoModelForCausalLM.from_config(small), "random Llama, 4.2M parameters, 32k vocabulary"


def synchronize(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def run_script(tree, script, episodes, out, threads, env=None):
    """Phase times (the first iteration left out) of a default run of tree's script for episodes, evaluation off, with
    OMP_NUM_THREADS=threads (None: unset, torch's default) and any other variables env names."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")} | (env or {})
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=tree)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(
        [
            sys.executable,
            os.path.join(tree, script),
            "--total_episodes",
            str(episodes),
            "--eval_every=0",
            "--output_dir",
            out,
        ],
        env=env,
        check=True,
        capture_output=True,
        cwd=tree,
    )
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][1:]  # the first iteration warms up
    return {k: [r[f"time/{k}"] for r in rows] for k in ("iteration", "generate", "score", "optimize")}


EPISODES_PER_ITERATION = {"ppo.py": 64, "grpo.py": 256, "rloo.py": 64}  # each default's responses per iteration


def scripts_part(before, repeats, iterations, threads):
    episodes = EPISODES_PER_ITERATION
    work = tempfile.mkdtemp()
    old = os.path.join(work, "before")
    subprocess.run(["git", "worktree", "add", "--detach", old, before], cwd=ROOT, check=True, capture_output=True)
    lines = [
        "| default | iteration, before | iteration, now | now / before | generate | score | optimise |",
        "|---|---|---|---|---|---|---|",
    ]
    try:
        for script, per_iteration in episodes.items():
            times = {"before": {}, "now": {}}
            for repeat in range(repeats):
                order = ("before", "now") if repeat % 2 == 0 else ("now", "before")
                for side in order:
                    got = run_script(
                        old if side == "before" else ROOT,
                        script,
                        per_iteration * (iterations + 1),
                        os.path.join(work, "runs", side),
                        threads,
                    )
                    for k, v in got.items():
                        times[side].setdefault(k, []).extend(v)
            med = {s: {k: statistics.median(v) for k, v in t.items()} for s, t in times.items()}
            ratio = {k: med["now"][k] / med["before"][k] for k in med["now"]}
            line = (
                f"| `{script}` | {med['before']['iteration']:.3f} s | {med['now']['iteration']:.3f} s | "
                f"**{ratio['iteration']:.2f}x** | {ratio['generate']:.2f}x | {ratio['score']:.2f}x | "
                f"{ratio['optimize']:.2f}x |"
            )
            print(line, flush=True)
            lines.append(line)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", old], cwd=ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["layouts", "scripts", "prefill", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", default="741bf69", help="the commit before the forwards were cut")
    parser.add_argument("--iterations", type=int, default=8, help="iterations timed per script run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--settings", default="ppo,grpo,rloo,gsm8k", help="layouts: the defaults' and GSM8K-like rows")
    parser.add_argument("--gsm8k-rows", type=int, default=40, help="rows of the GSM8K-like setting (groups of 5)")
    parser.add_argument("--length-scale", type=float, default=1.0, help="GSM8K-like lengths times this (dry runs)")
    parser.add_argument("--policy", default=None, help="the GSM8K-like setting's model (default: a random small Llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=None, help="prefill: the GSM8K-like responses' length")
    parser.add_argument("--decode", default="plain", choices=["plain", "static"], help="prefill")
    parser.add_argument("--out", default=None)
    a = parser.parse_args(argv)
    torch.set_num_threads(a.threads)
    text = [
        __doc__.split("\n\n")[0],
        "",
        f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {a.threads} "
        f"thread(s), {a.repeats} repeats, {a.device}, `python bench/real_tokens.py {' '.join(sys.argv[1:])}`.",
        "",
    ]
    if a.part in ("layouts", "all"):
        text += ["Part 1: the policy's training forward and backward over one epoch, per layout.", ""]
        text += layouts_part(a) + [""]
    if a.part in ("scripts", "all"):
        text += [f"Part 2: each default's time per iteration, {a.before} against this tree, alternating.", ""]
        text += scripts_part(a.before, a.repeats, a.iterations, a.threads) + [""]
    if a.part in ("prefill", "all"):
        text += ["Part 3: generate on a rollout of groups, every row's prompt prefilled against each group's once.", ""]
        text += prefill_part(a) + [""]
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(text))


if __name__ == "__main__":
    main()
