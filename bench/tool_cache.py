"""The KV cache of a conversation with tools: rebuilt each turn (grpo_tools.converse) against kept across turns
(converse_kept, here), on the embedded default, and the cost of a turn's prefill on a wider random Llama.

Methods:
  rebuilt  grpo_tools.converse: each turn is grpo_tools.generate with the whole conversation so far (the prompt, the
           earlier turns, the tool messages) as its prompt, encoded again from an empty cache.
  kept     converse_kept: one DynamicCache for the whole rollout. After a turn, the rows that go on keep their keys
           and values (the others are dropped from the cache), each row's tool message is prefilled onto it as one
           block (rows of different lengths left-padded in the block), and decoding goes on. The attention mask hides
           every position a row did not really write: the pads of a block, and the steps at which a row had ended its
           turn while others still decoded (generate gives those mask 1, harmless in one turn, wrong in a cache that
           outlives it). Position ids go on counting each row's real tokens.
Both draw token t of a row's response by uniforms[b, t], so both sample the same conversations: "same" checks the
tokens, the masks, the messages and the counts exactly, and gives the log-probs' largest difference. Those differ only
by rounding: the kept cache's attention sums over its holes (weight exactly 0) and in another order than a compact
cache's: a few 1e-6 in float32.

The embedded default is grpo_tools.py's first iteration: 32 prompts x 8 responses of assets/multiply/train.jsonl,
assets/tiny-tools with the multiply tool in a process of its own, --response_length 48, --max_turns 3, T = 1, the draws
of seed 1. The methods alternate, a warm-up call each first; "tools s" is the part of a rollout spent in the tools'
processes (the same calls in both). The wider model (hidden 512, 8 layers, 2k positions, random weights) cannot be made
to call a tool, so for it the table gives a turn's prefill alone: a conversation of L + k tokens encoded from nothing
(rebuilt) against a block of k tokens prefilled onto a cache of L (kept), with a turn's decode of k tokens for scale,
on one thread unless --wide_threads says more (what it shows is a ratio of work, not the machine's best time).

    python bench/tool_cache.py --quick                                  # smoke test, seconds
    python bench/tool_cache.py --repeats 7 --threads 1,2 --out bench/tool_cache.md
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

import grpo_tools  # noqa: E402
import rlhf_runtime as runtime  # noqa: E402
from grpo_tools import Turns, sample_token  # noqa: E402

WIDE = dict(
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=2048,
)


# ------------------------------------------------------------------------------ the rollout with a kept cache
def append_block(policy, cache, cache_mask, next_position, blocks, pad_token_id):
    """Each row's block of tokens (lists, one per row of the cache) prefilled onto the cache, left-padded to the
    longest. Returns the logits after each row's last token (R, V), and the cache's mask (R, L + K) and next
    positions (R, 1) grown by the block."""
    ids, mask = runtime.left_pad(blocks, pad_token_id, cache_mask.device)  # (R, K)
    positions = next_position + (mask.cumsum(1) - 1).clamp(min=0)  # (R, K): each row's count of real tokens goes on
    attention_mask = torch.cat([cache_mask, mask], 1)  # (R, L + K): the block's pads hidden like the cache's holes
    logits = policy(
        input_ids=ids,
        attention_mask=attention_mask,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]  # left-padded: every row's last token is in the last column
    return logits, attention_mask, next_position + mask.sum(1, keepdim=True)


@torch.no_grad()
def converse_kept(policy, prompt_ids, prompt_mask, sampling, uniforms=None):
    """grpo_tools.converse with its KV cache kept across turns: the same inputs, the same outputs (up to the rounding
    of the log-probs). The prompts are prefilled once; after a turn the rows that go on keep their cache, their tool
    message is prefilled onto it, and they decode on; the rows that are done leave the cache."""
    tools, tokenizer, device, T = sampling.tools, sampling.tokenizer, prompt_ids.device, sampling.max_new_tokens
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
    limit = [min(T, sampling.max_total_length - len(p)) if sampling.max_total_length else T for p in prompts]
    tokens, logprobs, own, messages = ([[] for _ in prompts] for _ in range(4))  # each row's response so far
    counts = {k: torch.zeros(len(prompts)) for k in ("turns", "calls", "parsed", "failed", "timed_out", "unanswered")}
    finished = torch.zeros(len(prompts), dtype=torch.bool)
    stop_ids = set(sampling.stop_ids.tolist())
    runtime.hold_full_parameters(policy, hold=True)

    # The prompts, a group's prompt encoded once and repeated for its rows, as generate does.
    cache = DynamicCache()
    unique, copies = torch.unique_consecutive(torch.cat([prompt_ids, prompt_mask], 1), dim=0, return_inverse=True)
    ids, mask = unique.tensor_split([prompt_ids.shape[1]], 1)  # (U, P) each
    logits = policy(
        input_ids=ids,
        attention_mask=mask,
        position_ids=runtime.position_ids_from(mask),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[copies, -1]  # (B, V)
    cache.reorder_cache(copies)
    cache_mask = prompt_mask  # (R, L): 1 where the row wrote a real token; R, the rows in the cache, is B here
    next_position = prompt_mask.sum(1, keepdim=True)  # (R, 1) each row's count of real tokens
    in_cache = [0] * len(prompts)  # each row's response tokens in the cache
    active = list(range(len(prompts)))  # the rows whose conversation goes on, in the cache's order
    for turn in range(1, sampling.max_turns + 1):
        # --- the turn: every row of the cache decodes until its stop token or its length limit ---
        rows = torch.tensor(active, device=device)  # (R,)
        start = torch.tensor([len(tokens[b]) for b in active], device=device)  # (R,) where its turn starts
        room = torch.tensor([limit[b] - len(tokens[b]) for b in active], device=device)  # (R,) at least 1
        done = torch.zeros(len(active), dtype=torch.bool, device=device)  # (R,)
        written = torch.zeros(len(active), dtype=torch.long, device=device)  # (R,) the turn's tokens in the cache
        new = []  # each step's tokens (R,), pads for the rows that were done
        new_logprobs = []
        new_mask = []
        for step in range(int(room.max())):
            step_uniforms = None  # greedy
            if uniforms is not None:  # (R,) token t of a row's response drawn by uniforms[b, t]
                step_uniforms = uniforms[rows, (start + step).clamp(max=T - 1)]
            token, logprob = sample_token(logits, step_uniforms, sampling.temperature)
            drew = ~done  # (R,) the rows whose turn goes on: their token is theirs, and enters the cache
            new_mask.append(drew)
            new.append(torch.where(done, sampling.pad_token_id, token))
            new_logprobs.append(torch.where(done, 0.0, logprob))
            done = done | torch.isin(token, sampling.stop_ids) | (step + 1 >= room)
            if done.all():  # the last tokens drawn are not in the cache yet: a row that goes on prefills them
                break
            cache_mask = torch.cat([cache_mask, drew[:, None].long()], 1)  # (R, L + 1): a row that was done, a hole
            logits = policy(
                input_ids=new[-1][:, None],
                attention_mask=cache_mask,
                position_ids=next_position,
                cache=cache,
                use_cache=True,
            ).logits[:, -1]
            next_position = next_position + drew[:, None]
            written = written + drew
        new = torch.stack(new, 1).tolist()
        new_logprobs = torch.stack(new_logprobs, 1).tolist()
        n_new = torch.stack(new_mask, 1).sum(1).tolist()
        written = written.tolist()

        # --- the turn's end, as converse: the calls run and their answers appended, or the conversation is done ---
        going_on = []
        for row, b in enumerate(active):
            n = n_new[row]
            turn_ids = new[row][:n]
            in_cache[b] += written[row]
            tokens[b] += turn_ids
            logprobs[b] += new_logprobs[row][:n]
            own[b] += [1] * n
            text = tokenizer.decode(turn_ids, skip_special_tokens=True)
            calls = runtime.parse_tool_calls(text, tokenizer)
            messages[b].append(runtime.assistant_message(text, calls))
            counts["turns"][b] += 1
            ended = n > 0 and turn_ids[-1] in stop_ids
            finished[b] = ended
            if not ended or not calls:  # cut by the length limit, or its answer
                continue
            if turn == sampling.max_turns:  # the last turn runs no tools: its calls stay unanswered
                counts["unanswered"][b] += len(calls)
                continue
            answers, called = runtime.run_tool_calls(tools, calls)
            for key, value in called.items():
                counts[key][b] += value
            counts["calls"][b] += len(calls)
            message = runtime.tool_message_ids(tokenizer, tools.schemas, answers, tokenizer.decode(turn_ids[-1]))
            if len(tokens[b]) + len(message) >= limit[b]:  # no room for the answer and a turn after it: cut
                finished[b] = False
                continue
            tokens[b] += message
            logprobs[b] += [0.0] * len(message)
            own[b] += [0] * len(message)
            messages[b] += answers
            going_on.append(row)
        if not going_on:
            break

        # --- the rows that go on keep their cache and prefill what it lacks: their last token and the tool message ---
        keep = torch.tensor(going_on, device=device)  # (R',) their rows in the cache
        cache.reorder_cache(keep)  # the rows that are done leave the cache
        active = [active[row] for row in going_on]
        blocks = [tokens[b][in_cache[b] :] for b in active]
        logits, cache_mask, next_position = append_block(
            policy, cache, cache_mask[keep], next_position[keep], blocks, sampling.pad_token_id
        )
        for b, block in zip(active, blocks):
            in_cache[b] += len(block)
    runtime.hold_full_parameters(policy, hold=False)
    pad = [[sampling.pad_token_id] * (T - len(t)) for t in tokens]
    responses = torch.tensor([t + p for t, p in zip(tokens, pad)], device=device)  # (B, T)
    logprobs = torch.tensor([x + [0.0] * len(p) for x, p in zip(logprobs, pad)], device=device)  # (B, T)
    response_mask = torch.tensor([[1] * len(t) + [0] * len(p) for t, p in zip(tokens, pad)], device=device)
    policy_mask = torch.tensor([x + [0] * len(p) for x, p in zip(own, pad)], device=device)  # (B, T)
    return responses, logprobs, response_mask, messages, Turns(policy_mask, finished.to(device), counts)


# ------------------------------------------------------------------------------ the embedded default
def embedded_default(model, dataset, prompts_per_rollout, generations):
    """grpo_tools.py's first iteration on its defaults (model and dataset may be changed): the policy, the left-padded
    prompts (B, P) and mask, the Conversing it samples with (the tools' processes started) and the draws (B, T)."""
    args = grpo_tools.Args(dataset=dataset, rollout_batch_size=prompts_per_rollout, num_generations=generations)
    args.run.model_name_or_path = model
    args.run.eval_every = 0  # no held-out set: nothing to warn about
    device = torch.device("cpu")
    tools = runtime.load_tools(args.tools, args.tool_timeout)
    tokenizer, prompts, _, _, stop_ids = runtime.load_task(args, device, (), tools.schemas)
    policy, _, _ = grpo_tools.build_models(replace(args, kl_coef=0.0), tokenizer, device)  # no reference
    sampling = grpo_tools.Conversing(args.response_length, args.temperature, stop_ids, tokenizer.pad_token_id)
    sampling = replace(sampling, tools=tools, tokenizer=tokenizer, max_turns=args.max_turns)
    idx, width, _ = runtime.next_prompts(prompts, (0, 0), args.rollout_batch_size, args.run.seed, 1, 0)
    idx = [i for i in idx for _ in range(generations)]
    prompt_ids, prompt_mask = runtime.left_pad([prompts[i] for i in idx], tokenizer.pad_token_id, device, width)
    rng = torch.Generator().manual_seed(args.run.seed * 1_000_000 + 1)  # main's draws of iteration 1
    uniforms = runtime.row_uniforms(rng, len(idx), args.response_length, 1, 0)
    return policy, prompt_ids, prompt_mask, sampling, uniforms


def differences(rebuilt, kept):
    """What differs between two rollouts: the names of the outputs that are not equal, and the log-probs' largest
    difference."""
    responses, logprobs, response_mask, messages, turns = rebuilt
    unequal = []
    if not torch.equal(responses, kept[0]):
        unequal.append("tokens")
    if not torch.equal(response_mask, kept[2]):
        unequal.append("response mask")
    if not torch.equal(turns.policy_mask, kept[4].policy_mask):
        unequal.append("policy mask")
    if not torch.equal(turns.finished, kept[4].finished):
        unequal.append("finished")
    if messages != kept[3]:
        unequal.append("messages")
    for key, value in turns.counts.items():
        if not torch.equal(value, kept[4].counts[key]):
            unequal.append(f"counts[{key}]")
    return unequal, (logprobs - kept[1]).abs().max().item()


def time_rollouts(setup, repeats):
    """converse and converse_kept alternating, a warm-up call each first: their outputs, and each one's seconds per
    rollout and seconds in the tools' processes, per repeat."""
    policy, prompt_ids, prompt_mask, sampling, uniforms = setup
    methods = {"rebuilt": grpo_tools.converse, "kept": converse_kept}
    seconds = {name: [] for name in methods}
    tool_seconds = {name: [] for name in methods}
    outputs = {}
    in_tools = [0.0]
    run_tool_calls = runtime.run_tool_calls

    def timed_tool_calls(tools, calls):
        t0 = time.perf_counter()
        got = run_tool_calls(tools, calls)
        in_tools[0] += time.perf_counter() - t0
        return got

    with mock.patch.object(runtime, "run_tool_calls", timed_tool_calls):  # both call it as runtime.run_tool_calls
        for repeat in range(repeats + 1):
            for name, converse in methods.items():
                in_tools[0] = 0.0
                t0 = time.perf_counter()
                outputs[name] = converse(policy, prompt_ids, prompt_mask, sampling, uniforms)
                if repeat > 0:  # repeat 0 warms up
                    seconds[name].append(time.perf_counter() - t0)
                    tool_seconds[name].append(in_tools[0])
    return outputs, seconds, tool_seconds


# ------------------------------------------------------------------------------ the wider model: a turn's prefill
def wide_model(seed=0):
    """A random Llama of hidden 512, 8 layers, 2k positions, float32, in eval mode."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**WIDE), dtype=torch.float32).eval()


@torch.no_grad()
def prefill(model, ids, cache=None, cache_mask=None):
    """ids (R, n) encoded onto the cache (a new one when None; every token real): the logits of the last (R, V), the
    cache and its mask (R, L + n)."""
    if cache is None:
        cache = DynamicCache()
        cache_mask = ids.new_zeros(ids.shape[0], 0)
    start = cache_mask.shape[1]
    mask = torch.cat([cache_mask, torch.ones_like(ids)], 1)
    positions = torch.arange(start, start + ids.shape[1])[None].expand_as(ids)  # (R, n)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
    )
    return out.logits[:, -1], cache, mask


@torch.no_grad()
def decode(model, ids, cache, cache_mask, steps):
    """steps greedy tokens decoded onto the cache, one forward each: a turn's decode, for scale."""
    logits, _, mask = prefill(model, ids, cache, cache_mask)
    for _ in range(steps):
        logits, _, mask = prefill(model, logits.argmax(-1)[:, None], cache, mask)


def time_prefills(model, L, k, rows, repeats):
    """Seconds per repeat of a turn's prefill: L + k tokens from nothing (rebuilt), k onto a cache of L (kept, the
    cache of L built untimed before each), k decode steps on a cache of L (a turn's decode, for scale); alternating,
    a warm-up each first. Also the largest difference of the last logits between rebuilt and kept."""
    g = torch.Generator().manual_seed(L)
    ids = torch.randint(WIDE["vocab_size"], (rows, L + k), generator=g)
    seconds = {"rebuilt": [], "kept": [], "decode": []}
    gap = 0.0
    for repeat in range(repeats + 1):
        t0 = time.perf_counter()
        rebuilt, _, _ = prefill(model, ids)
        t1 = time.perf_counter()
        _, cache, cache_mask = prefill(model, ids[:, :L])
        t2 = time.perf_counter()
        kept, _, _ = prefill(model, ids[:, L:], cache, cache_mask)
        t3 = time.perf_counter()
        _, cache, cache_mask = prefill(model, ids[:, :L])
        t4 = time.perf_counter()
        decode(model, ids[:, L : L + 1], cache, cache_mask, k - 1)
        t5 = time.perf_counter()
        gap = max(gap, (rebuilt - kept).abs().max().item())
        if repeat > 0:
            seconds["rebuilt"].append(t1 - t0)
            seconds["kept"].append(t3 - t2)
            seconds["decode"].append(t5 - t4)
    return seconds, gap


# ------------------------------------------------------------------------------ the tables
def rollout_table(results):
    """The markdown table of the embedded default: a row per thread count."""
    lines = [
        "| threads | rebuilt s | kept s | kept / rebuilt | tools s (rebuilt, kept) | rows with turn 2 "
        "| rows with turn 3 | same tokens, masks, messages, counts | max abs logp diff |",
        "|---:|---:|---:|---:|---|---:|---:|---|---:|",
    ]
    for threads, (outputs, seconds, tool_seconds) in results.items():
        rebuilt = statistics.median(seconds["rebuilt"])
        kept = statistics.median(seconds["kept"])
        tools = f"{statistics.median(tool_seconds['rebuilt']):.3f}, {statistics.median(tool_seconds['kept']):.3f}"
        turns = outputs["rebuilt"][4].counts["turns"]  # (B,)
        unequal, gap = differences(outputs["rebuilt"], outputs["kept"])
        same = "yes"
        if unequal:
            same = "no: " + ", ".join(unequal)
        lines.append(
            f"| {threads} | {rebuilt:.3f} | {kept:.3f} | {kept / rebuilt:.2f} | {tools} | "
            f"{(turns >= 2).float().mean():.1%} | {(turns >= 3).float().mean():.1%} | {same} | {gap:.1e} |"
        )
    return "\n".join(lines)


def prefill_table(results, rows, k):
    """The markdown table of the wider model: a row per (threads, L)."""
    lines = [
        f"| threads | L | rebuilt s ({rows} x (L + {k}) from nothing) | kept s ({rows} x {k} onto L) | kept / rebuilt "
        f"| rebuilt - kept, ms per row | a turn's decode of {k} s | max abs logit diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (threads, L), (seconds, gap) in results.items():
        rebuilt = statistics.median(seconds["rebuilt"])
        kept = statistics.median(seconds["kept"])
        decoded = statistics.median(seconds["decode"])
        lines.append(
            f"| {threads} | {L} | {rebuilt:.3f} | {kept:.3f} | {kept / rebuilt:.3f} | "
            f"{(rebuilt - kept) / rows * 1000:.1f} | {decoded:.3f} | {gap:.1e} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.join(ROOT, "assets", "tiny-tools"))
    parser.add_argument("--dataset", default=os.path.join(ROOT, "assets", "multiply", "train.jsonl"))
    parser.add_argument("--prompts", type=int, default=32, help="prompts per rollout, each sampled --generations times")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", default="1,2", help="torch CPU thread counts, comma-separated")
    parser.add_argument("--lengths", default="256,1024", help="the wider model's cached lengths L")
    parser.add_argument("--block", type=int, default=32, help="k, the tokens a turn prefills onto the cache")
    parser.add_argument("--rows", type=int, default=4, help="the wider model's rows")
    parser.add_argument("--wide_threads", default="1", help="the wider model's thread counts, comma-separated")
    parser.add_argument("--quick", action="store_true", help="4 prompts x 4, 1 repeat, 1 thread, L 64: seconds")
    parser.add_argument("--out", default=None, help="also write the tables as markdown here")
    args = parser.parse_args()
    if args.quick:
        args.prompts = 4
        args.generations = 4
        args.repeats = 1
        args.threads = "1"
        args.lengths = "64"
    threads = [int(t) for t in args.threads.split(",")]
    wide_threads = [int(t) for t in args.wide_threads.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]

    setup = embedded_default(args.model, args.dataset, args.prompts, args.generations)
    _, prompt_ids, _, sampling, _ = setup
    rollouts = {}
    for n in threads:
        torch.set_num_threads(n)
        rollouts[n] = time_rollouts(setup, args.repeats)
    for process in sampling.tools.processes.values():  # the tools' processes end with this one
        if process.process is not None:
            process.kill()
    model = wide_model()
    prefills = {}
    for n in wide_threads:
        torch.set_num_threads(n)
        for L in lengths:
            prefills[(n, L)] = time_prefills(model, L, args.block, args.rows, args.repeats)

    command = "python bench/tool_cache.py " + " ".join(sys.argv[1:])
    machine = f"{platform.machine()}, {os.cpu_count()} cores seen"
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    text = "\n".join(
        [
            "# The KV cache across a conversation's turns: rebuilt against kept",
            "",
            f"Command: `{command}`",
            "",
            f"{versions}, CPU ({machine}, load average {load} at the end), float32, {date}",
            "",
            f"## The embedded default: {len(prompt_ids)} rows (prompts up to {prompt_ids.shape[1]} tokens), response "
            f"{sampling.max_new_tokens}, max turns {sampling.max_turns}, median of {args.repeats} rollouts",
            "",
            rollout_table(rollouts),
            "",
            f"## A turn's prefill on a random Llama (hidden 512, 8 layers, vocab 32000), {args.rows} rows, "
            f"median of {args.repeats}",
            "",
            prefill_table(prefills, args.rows, args.block),
            "",
        ]
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
