"""Sampling throughput: the loops ppo.py's `generate` runs (its plain loop, and rlhf_kernels' static_decode that it
hands over to on one GPU) against transformers' `model.generate` and a loop without a KV cache.

Methods (the same distribution in each: softmax(logits / T); left-padded prompts):
  scripts      `generate` of ppo.py (shared with grpo.py and rloo.py) with its plain loop (--decode plain, and auto
               off one GPU): a KV cache grown by a token a step, sampling by inverse CDF from uniforms drawn beforehand
               (one row per sequence), and the log-prob of each sampled token (token_logprobs), which hf-generate and
               no-cache do not compute.
  static       `generate` handing its decode steps to rlhf_kernels' static_decode, the same steps over buffers of
               fixed shape (StaticDecoder), run op by op (never captured, on any device).
  cuda-graph   `generate` handing over to static_decode as --decode auto does on one GPU: static, each decode step
               replayed as a CUDA graph (CUDA only).
  compiled     static, with the decode step compiled by torch.compile (mode "reduce-overhead" on CUDA, which captures
               CUDA graphs itself; inductor's default on the CPU). Not run by default: each shape compiles for tens of
               seconds (its first call, the warm-up, is left out of the timing and printed under the table).
  hf-generate  model.generate(do_sample=True, temperature=T, top_k=0, top_p=1.0, use_cache=True). top_k=0 turns
               off transformers' default top-k of 50; with T = 1 no logits processor runs at all, otherwise only
               TemperatureLogitsWarper (the division by T that the others do too).
  no-cache     the full forward over the whole sequence at every step (logits of the last position only).
The other two sample with torch.multinomial, so their tokens differ from the scripts' for the same seed.
Every method generates exactly N tokens for every row: EOS is never sampled. `generate` gets stop_ids=-1 (no
token equals it), model.generate gets eos_token_id=None, which in transformers 5.x leaves only the max-length
stopping criterion (no min_new_tokens, which would add a processor that masks the EOS logit); no-cache has no stop.
Tokens/s counts generated positions: batch x new tokens / seconds (the prefill is inside the timing). The static
loops test the stop every 8 steps on CUDA, so they may run up to 7 steps past the last stop; with no stop token
they run exactly N, like the others.

"same tokens" checks static, cuda-graph and compiled against scripts in the cell, from the same uniforms and
greedy (T -> 0), with the log-probs' largest difference: the static cache's attention also reads its unused columns
(weight 0), which reorders the sums, so in fp32 the log-probs differ by ~1e-5 and a token can flip where two are that
close (a near tie, or a uniform that close to a boundary of the cumulative distribution): 256 x 64 on the CPU had
one. "same as static, op by op" checks cuda-graph and compiled against the static loop run op by op, the same kernels
on the same shapes: there the tokens must be the same, and the log-probs equal to the bit unless compiled code fuses
them otherwise.

Prompts are random token ids (ids >= 2, so never the tiny model's EOS 0 or pad 1), the same for every method of a
cell: row 0 has --prompt-len real tokens, the others between half and all of it, left-padded. Models: `tiny` is
assets/tiny-sft; `qwen0.5b-shape` has Qwen2.5-0.5B's shape with random weights (no hub access). Hub kernels are
off, as in ppo.py (use_kernels=False; from_config applies none). Within a cell the methods alternate (one warm-up
call each first), so machine noise hits all.

On CUDA the "decode limit" is the time the N decode steps need at least if each step only reads the weights and
the KV cache at the mean context length (prompt + N / 2) once, at the measured device-to-device copy bandwidth;
"of limit" is that time over the measured one. "peak GB" is torch.cuda.max_memory_allocated over a method's calls in
the cell, weights included; "held GB" is what the static loops keep between calls (their StaticDecoder: the cache,
the buffers and the CUDA graph's memory pool), the growth of torch.cuda.memory_reserved over their first call.

    python bench/bench_generate.py --quick --device cpu                # smoke test, seconds
    python bench/bench_generate.py --models tiny --batches 64,256 --new-tokens 24,64 --repeats 3 --out /tmp/gen_cpu.md
    python bench/bench_generate.py --dtype bfloat16 --out bench/generate.md   # CUDA: both models, the full grid
    python bench/bench_generate.py --device cpu --models tiny --batches 64,256 --new-tokens 24,64 \
        --methods scripts,static,compiled,hf-generate --repeats 5        # the CPU's choice of loop (bench/generate.md)
"""

import argparse
import dataclasses
import datetime
import functools
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402

import ppo  # noqa: E402
from ppo import generate  # noqa: E402
from rlhf_kernels import decode  # noqa: E402
from rlhf_runtime.batches import position_ids_from  # noqa: E402

NEVER = -1  # a stop token id no sampled token can equal
QWEN05B_SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)


# ----------------------------------------------------------------------------------------- models, prompts
def load_model(name, dtype, device):
    """The policy for a --models entry, in eval mode, and its pad token id."""
    if name == "tiny":
        model = AutoModelForCausalLM.from_pretrained(
            os.path.join(ROOT, "assets/tiny-sft"), dtype=dtype, use_kernels=False
        )
    elif name == "qwen0.5b-shape":
        with torch.device(device):  # random init straight on the device
            model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN05B_SHAPE), dtype=dtype)
    else:
        raise SystemExit(f"unknown model '{name}': choose tiny or qwen0.5b-shape")
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    return model.to(device).eval(), pad


def make_prompts(batch, prompt_len, vocab_size, pad, device, seed=0):
    """Random left-padded prompts (B, P) and their mask; row 0 is full, the rest hold P/2..P real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab_size, (batch, prompt_len), generator=g)
    lengths = torch.randint((prompt_len + 1) // 2, prompt_len + 1, (batch,), generator=g)
    lengths[0] = prompt_len
    mask = (torch.arange(prompt_len)[None, :] >= prompt_len - lengths[:, None]).long()
    return torch.where(mask.bool(), ids, pad).to(device), mask.to(device)


# ----------------------------------------------------------------------------------------------- methods
# Every method takes (model, ids, mask, sampling, greedy=False), sampling a ppo.Sampling (its max_new_tokens,
# temperature and pad_token_id; its stop_ids are NEVER), and returns (tokens, log-probs or None). The scripts' loops
# also take the uniforms to draw from.
def run_scripts(model, ids, mask, sampling, greedy=False, uniforms=None):
    """`generate` with the loop sampling.kernel_decode says: its (tokens, log-probs); greedy, else from the uniforms
    given or fresh."""
    if greedy:
        uniforms = None
    elif uniforms is None:
        uniforms = torch.rand(ids.shape[0], sampling.max_new_tokens, device=ids.device)
    return generate(model, ids, mask, sampling, uniforms)[:2]


def run_cuda_graph(model, ids, mask, sampling, greedy=False, uniforms=None):
    """`generate` handing its decode steps to rlhf_kernels' static_decode, as --decode auto does on one GPU."""
    return run_scripts(model, ids, mask, dataclasses.replace(sampling, kernel_decode=True), greedy, uniforms)


class EagerDecoder(decode.StaticDecoder):
    """rlhf_kernels' StaticDecoder never capturing: every step op by op, the kernels a captured step replays."""

    def __init__(self, policy, logits, width, sampling, sample_token, capture):
        super().__init__(policy, logits, width, sampling, sample_token, capture=False)


class CompiledDecoder(EagerDecoder):
    """A StaticDecoder whose decode step is compiled by torch.compile, once per shape (at its first step). Its buffers
    are marked as static addresses, as transformers marks the StaticCache's, so that reduce-overhead may capture."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for buffer in vars(self).values():
            if isinstance(buffer, torch.Tensor):
                torch._dynamo.mark_static_address(buffer)
        self.step_once = torch.compile(self.step_once, mode="reduce-overhead" if self.logits.is_cuda else None)


# each method's own decoders (cuda-graph keeps rlhf_kernels' decode.DECODERS)
DECODERS = {EagerDecoder: {}, CompiledDecoder: {}}


def run_with_decoder(decoder_class, model, ids, mask, sampling, greedy, uniforms):
    """generate handing over to static_decode, with rlhf_kernels' decoder class and table swapped for the call."""
    with (
        mock.patch.object(decode, "DECODERS", DECODERS[decoder_class]),
        mock.patch.object(decode, "StaticDecoder", decoder_class),
    ):
        return run_cuda_graph(model, ids, mask, sampling, greedy, uniforms)


def run_static(model, ids, mask, sampling, greedy=False, uniforms=None):
    return run_with_decoder(EagerDecoder, model, ids, mask, sampling, greedy, uniforms)


def run_compiled(model, ids, mask, sampling, greedy=False, uniforms=None):
    return run_with_decoder(CompiledDecoder, model, ids, mask, sampling, greedy, uniforms)


def run_hf(model, ids, mask, sampling, greedy=False):
    if greedy:
        options = dict(do_sample=False)
    else:
        options = dict(do_sample=True, temperature=sampling.temperature, top_k=0, top_p=1.0)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=None,
        pad_token_id=sampling.pad_token_id,
        use_cache=True,
        **options,
    )
    return out[:, ids.shape[1] :], None


@torch.no_grad()
def run_no_cache(model, ids, mask, sampling, greedy=False):
    n = sampling.max_new_tokens
    for _ in range(n):
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from(mask), use_cache=False, logits_to_keep=1
        ).logits[:, -1]
        probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
        token = probs.argmax(-1) if greedy else torch.multinomial(probs, 1).squeeze(-1)
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids[:, -n:], None


METHODS = {
    "scripts": run_scripts,
    "static": run_static,
    "cuda-graph": run_cuda_graph,
    "compiled": run_compiled,
    "hf-generate": run_hf,
    "no-cache": run_no_cache,
}
DECODE_LOOPS = ("static", "cuda-graph", "compiled")  # checked against scripts: same uniforms, same tokens


@dataclasses.dataclass
class Cell:
    """One cell of the table: a model (its --models name), its prompts, and how every method samples."""

    model_name: str
    model: torch.nn.Module
    ids: torch.Tensor  # (B, P) left-padded prompts
    mask: torch.Tensor  # (B, P)
    sampling: ppo.Sampling  # N new tokens at T, never stopping (stop_ids NEVER), the model's pad


# ---------------------------------------------------------------------------------------------- timing
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def copy_bandwidth(device):
    """Bytes read + written per second by a 1 GiB device-to-device copy (best of 10)."""
    x = torch.empty(2**28, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    copy = functools.partial(y.copy_, x)
    best = min(timed(copy, device) for _ in range(10))
    return 2 * x.nbytes / best


def decode_bytes(model, batch, context):
    """Bytes one decode step must read at least: every weight once, and the KV cache at this context length."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied lm_head is counted once
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    element = next(model.parameters()).element_size()
    return weights + 2 * c.num_hidden_layers * batch * c.num_key_value_heads * head_dim * context * element


# ------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,qwen0.5b-shape")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--new-tokens", default="128,512")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads on CPU")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per method and cell (the median is reported)")
    p.add_argument(
        "--methods",
        default="scripts,static,cuda-graph,hf-generate,no-cache",
        help=f"some of {','.join(METHODS)} (cuda-graph: CUDA only, left out elsewhere)",
    )
    p.add_argument("--skip-no-cache-above", type=int, default=128, help="skip no-cache when new tokens > this")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model, batch 4, 8 new tokens, 1 repeat")
    p.add_argument("--out", help="also write the tables (markdown) to this file")
    a = p.parse_args(argv)
    if a.quick:
        a.models = "tiny"
        a.batches = "4"
        a.new_tokens = "8"
        a.repeats = 1
    a.models = a.models.split(",")
    a.methods = a.methods.split(",")
    a.batches = [int(x) for x in a.batches.split(",")]
    a.new_tokens = [int(x) for x in a.new_tokens.split(",")]
    unknown = set(a.methods) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; choose from {list(METHODS)}")
    return a


def main(argv=None):
    a = parse_args(argv)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    cuda = device.type == "cuda"
    if cuda:
        name = torch.cuda.get_device_name(device)
    else:
        torch.set_num_threads(a.threads)
        name = f"CPU ({platform.processor() or platform.machine()}, {a.threads} threads)"
    lines = [
        f"torch {torch.__version__}, transformers {transformers.__version__}, {name}, {a.dtype}, "
        f"T={a.temperature}, prompt {a.prompt_len} (left-padded), {datetime.datetime.now():%Y-%m-%d %H:%M}"
    ]
    bandwidth = copy_bandwidth(device) if cuda else None
    if cuda:
        lines.append(f"device-to-device copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + written)")
    lines += [
        "",
        "| model | batch | new tokens | method | median s | tokens/s | vs scripts | vs hf-generate | "
        "same tokens (sampled, greedy) | max abs logp diff | same as static, op by op | its max abs logp diff | "
        + ("peak GB | held GB | " if cuda else "")
        + "decode limit s | of limit |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|---:|---|---:|" + ("---:|---:|" if cuda else "") + "---:|---:|",
    ]
    print("\n".join(lines), flush=True)

    def emit(*new):
        """Print lines and rewrite --out with everything so far (a run stopped by a time limit keeps its rows)."""
        lines.extend(new)
        print("\n".join(new), flush=True)
        if a.out:
            with open(a.out, "w") as f:
                f.write("\n".join(lines) + "\n")

    notes = []
    for model_name in a.models:
        model, pad = load_model(model_name, dtype, device)
        for batch in a.batches:
            for n in a.new_tokens:
                ids, mask = make_prompts(batch, a.prompt_len, model.config.vocab_size, pad, device)
                cell = Cell(model_name, model, ids, mask, ppo.Sampling(n, a.temperature, NEVER, pad))
                methods = [
                    m
                    for m in a.methods
                    if not (m == "no-cache" and n > a.skip_no_cache_above) and not (m == "cuda-graph" and not cuda)
                ]
                seconds = defaultdict(list)
                peak = {}
                held = {}
                for m in methods:  # warm-up: the static loops set up (capture, compile) and keep their decoders
                    reserved = torch.cuda.memory_reserved(device) if cuda else 0
                    first = timed(functools.partial(METHODS[m], model, ids, mask, cell.sampling), device)
                    held[m] = (torch.cuda.memory_reserved(device) - reserved) / 2**30 if cuda else 0
                    if m == "compiled":
                        notes.append(f"compiled, {model_name} {batch} x {n}: first call (compilation) {first:.1f} s")
                same = agreement(cell, methods, device)
                for _ in range(a.repeats):
                    for m in methods:
                        if cuda:
                            torch.cuda.reset_peak_memory_stats(device)
                        seconds[m].append(timed(functools.partial(METHODS[m], model, ids, mask, cell.sampling), device))
                        if cuda:
                            peak[m] = max(peak.get(m, 0), torch.cuda.max_memory_allocated(device) / 2**30)
                median = {m: statistics.median(s) for m, s in seconds.items()}
                limit = n * decode_bytes(model, batch, a.prompt_len + n / 2) / bandwidth if cuda else None
                for m in methods:
                    ratios = [
                        f"{median[ref] / median[m]:.2f}x" if ref in median else "n/a"
                        for ref in ("scripts", "hf-generate")
                    ]
                    row = (
                        f"| {model_name} | {batch} | {n} | {m} | {median[m]:.3f} | {batch * n / median[m]:,.0f} | "
                        f"{' | '.join(ratios)} | {' | '.join(same.get(m, ('-',) * 4))} | "
                    )
                    if cuda:
                        row += f"{peak[m]:.2f} | {held[m]:.2f} | "
                        row += f"{limit:.3f} | {100 * limit / median[m]:.0f}% |"
                    else:
                        row += "n/a | n/a |"
                    emit(row)
                forget_decoders(cuda)
        model = None  # free it before the next one loads
        if cuda:
            torch.cuda.empty_cache()
    if notes:
        emit("", *notes)


def agreement(cell, methods, device):
    """For each decode loop among methods: whether its tokens equal those of scripts (the plain loop) from the same
    uniforms and greedily ("yes"/"no" for each), with the largest |log-prob difference| where they agree; and for
    cuda-graph and compiled, whether they equal the static loop's run op by op ("the eager path": the same kernels on
    the same shapes, so the same tokens and log-probs to the bit, where the dynamic loop's attention sums over fewer
    columns)."""
    n = cell.sampling.max_new_tokens
    uniforms = torch.rand(cell.ids.shape[0], n, generator=torch.Generator().manual_seed(1)).to(device)
    calls = {}

    def tokens(method, greedy):
        if (method, greedy) not in calls:
            calls[method, greedy] = METHODS[method](cell.model, cell.ids, cell.mask, cell.sampling, greedy, uniforms)
        return calls[method, greedy]

    def compare(method, reference):
        verdicts = []
        worst = 0.0
        for greedy in (False, True):
            got = tokens(method, greedy)
            expected = tokens(reference, greedy)
            equal = got[0].shape == expected[0].shape and torch.equal(got[0], expected[0])
            verdicts.append("yes" if equal else "no")
            if equal:
                worst = max(worst, (got[1] - expected[1]).abs().max().item())
        return ", ".join(verdicts), f"{worst:.1e}"

    same = {}
    if "scripts" not in methods:
        return same
    for m in methods:
        if m not in DECODE_LOOPS:
            continue
        against_scripts = compare(m, "scripts")
        if m == "static":
            against_static = ("-", "-")
        else:
            against_static = compare(m, "static")
        same[m] = (*against_scripts, *against_static)
    return same


def forget_decoders(cuda):
    """Drop the static loops' decoders (their caches, buffers and graphs) and compiled code before the next cell."""
    decode.DECODERS.clear()
    DECODERS[EagerDecoder].clear()
    if DECODERS[CompiledDecoder]:
        DECODERS[CompiledDecoder].clear()
        torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
