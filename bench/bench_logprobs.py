"""Benchmark rlhf_kernels.token_logprobs against the naive fp32 log_softmax and TRL / Liger-Kernel.

Every (method, shape, dtype, temperature, mode) cell runs in a fresh subprocess so that peak memory is
measured cleanly: on CPU as ru_maxrss minus the baseline taken after the inputs are allocated, on CUDA
as torch.cuda.max_memory_allocated minus the allocation after the inputs. All methods compute both the
log-probs and the entropy (Liger: log-probs only); forward+backward differentiates
sum(w1 * logp) + sum(w2 * entropy). "extra" memory therefore includes the outputs and, for fwd+bwd,
the logits-sized gradient every method has to produce.

    python bench/bench_logprobs.py          # CPU default subset (4k tokens x {32k,128k} x {fp32,bf16} x T in {1,0.7})
    python bench/bench_logprobs.py --quick  # 4k x 32k only
    python bench/bench_logprobs.py --full --out bench/logprobs.md
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ["kernels", "kernels-inplace", "naive", "trl", "liger"]


# ----------------------------------------------------------------------------------------------- methods
def _method(name, device):
    """Returns f(logits, tokens, T) -> (logp, entropy or None), or raises ImportError / RuntimeError to skip."""
    import torch

    if name == "kernels":
        sys.path.insert(0, ROOT)
        from rlhf_kernels import token_logprobs

        return lambda x, y, T: token_logprobs(x, y, T, return_entropy=True)
    if name == "kernels-inplace":  # fwd+bwd only: the gradient overwrites the logits buffer
        sys.path.insert(0, ROOT)
        from rlhf_kernels import token_logprobs

        return lambda x, y, T: token_logprobs(x, y, T, return_entropy=True, inplace_backward=True)
    if name == "naive":

        def naive(x, y, T):
            z = x.float() / T
            lsm = torch.log_softmax(z, dim=-1)
            logp = lsm.gather(-1, y.unsqueeze(-1)).squeeze(-1)
            ent = -(torch.softmax(z, dim=-1) * lsm).sum(-1)
            return logp, ent

        return naive
    if name == "trl":
        import trl.trainer.utils as tu

        if hasattr(tu, "selective_log_softmax_and_entropy"):  # fused Triton kernel on CUDA, torch loops otherwise
            return lambda x, y, T: tu.selective_log_softmax_and_entropy(x, y, temperature=T)

        def trl_old(x, y, T):
            x = x / T
            return tu.selective_log_softmax(x, y), tu.entropy_from_logits(x)

        return trl_old
    if name == "liger":
        if device != "cuda":
            raise RuntimeError("CUDA only")
        from liger_kernel.transformers import LigerCrossEntropyLoss

        ce = LigerCrossEntropyLoss(reduction="none")
        return lambda x, y, T: (-ce((x / T if T != 1.0 else x).reshape(-1, x.shape[-1]), y.reshape(-1)), None)
    raise ValueError(name)


# ------------------------------------------------------------------------------------------------ worker
def _rss_mb():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def worker(a):
    import torch

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dev = a.device
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    try:
        fn = _method(a.method, dev)
    except (ImportError, RuntimeError) as e:
        print(json.dumps({"skip": f"{type(e).__name__}: {e}".splitlines()[0][:80]}))
        return
    N = a.tokens
    V = a.vocab
    if a.method == "kernels-inplace" and a.mode == "fwd":
        print(json.dumps({"skip": "same as kernels"}))
        return
    x = torch.randn(N, V, device=dev, dtype=dtype).mul_(2).requires_grad_(a.mode == "fwdbwd")
    y = torch.randint(0, V, (N,), device=dev)
    w1 = torch.randn(N, device=dev)
    w2 = torch.randn(N, device=dev)

    def step():
        if a.mode == "fwd":
            with torch.no_grad():
                out = fn(x, y, a.temperature)
        else:
            lp, ent = fn(x, y, a.temperature)
            loss = (lp * w1).sum() + ((ent * w2).sum() if ent is not None else 0.0)
            loss.backward()
            x.grad = None
            out = None
        return out

    if dev == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()  # warm-up (compiles Triton kernels), also counted in the peak
        torch.cuda.synchronize()
        times = []
        for _ in range(a.repeats):
            s = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        base = _rss_mb()
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        peak = _rss_mb() - base
    print(json.dumps({"time_s": statistics.median(times), "peak_mb": peak}))


def copy_bandwidth():
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    import torch

    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")  # 256 MiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True)
    e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        dst.copy_(src)
    e.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 20 / (s.elapsed_time(e) / 1e3)


# ------------------------------------------------------------------------------------------------ driver
def ms(r):
    """A cell's time in ms, or why it was skipped."""
    if "time_s" not in r:
        return f"skip ({r['skip']})"
    return f"{r['time_s'] * 1e3:.{2 if r['time_s'] < 0.1 else 0}f}"


def ratio(r, n):
    """A cell's time over the naive method's."""
    return f"{r['time_s'] / n['time_s']:.2f}" if "time_s" in r and "time_s" in n else "-"


def mb(r):
    return f"{r['peak_mb']:.0f}" if "peak_mb" in r else "-"


def percent_of_bandwidth(r, passes, nbytes, bandwidth):
    """The least traffic (``passes`` times the logits' ``nbytes``) over the time, as a share of the copy bandwidth."""
    return f"{100 * passes * nbytes / r['time_s'] / bandwidth:.0f}%" if "time_s" in r else "-"


def naive_peak_bytes(N, V, mode):
    """Rough upper estimate of the naive method's extra memory: fp32 z, log_softmax, softmax and product
    forward; plus the gradient and autograd temporaries backward."""
    return N * V * 4 * (4 if mode == "fwd" else 7)


def run_cell(a, method, N, V, dtype, T, mode):
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--method",
        method,
        "--tokens",
        str(N),
        "--vocab",
        str(V),
        "--dtype",
        dtype,
        "--temperature",
        str(T),
        "--mode",
        mode,
        "--device",
        a.device,
        "--repeats",
        str(a.repeats),
        "--threads",
        str(a.threads),
    ]
    try:
        # TRL's CPU fallback loops over rows in Python (very slow for fp32): give it a shorter leash
        tmo = a.trl_timeout if (method == "trl" and a.device == "cpu") else a.cell_timeout
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=tmo)
    except subprocess.TimeoutExpired:
        return {"skip": f"timeout {tmo:.0f}s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        err = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"skip": f"failed: {err[:80]}"}
    return json.loads(lines[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default="kernels")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--mode", default="fwd")
    p.add_argument("--device", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="4k tokens x 32k vocab, fp32 and bf16, T=1")
    p.add_argument("--full", action="store_true", help="tokens {4k,16k} x V {32k,128k,152k} x {bf16,fp32} x T {1,0.7}")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--mem-limit-gb", type=float, default=16.0, help="skip cells whose naive version would not fit")
    p.add_argument("--cell-timeout", type=float, default=600)
    p.add_argument("--grid", default=None, help="explicit cells tokens:V:dtype:T, comma-separated")
    p.add_argument("--trl-timeout", type=float, default=60)
    p.add_argument("--out", default=None, help="also write the markdown table here")
    a = p.parse_args()
    import torch

    if a.device is None:
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.worker:
        worker(a)
        return

    if a.quick:
        grid = [(4096, 32768, d, 1.0) for d in ("fp32", "bf16")]
    elif a.full:
        grid = [
            (n, v, d, t)
            for n in (4096, 16384)
            for v in (32768, 131072, 152064)
            for d in ("bf16", "fp32")
            for t in (1.0, 0.7)
        ]
    else:
        grid = [(4096, v, d, t) for v in (32768, 131072) for d in ("fp32", "bf16") for t in (1.0, 0.7)]
    if a.grid:
        grid = [(int(n), int(v), d, float(t)) for n, v, d, t in (c.split(":") for c in a.grid.split(","))]
    methods = [m for m in a.methods.split(",") if m]
    cuda = a.device == "cuda"
    bw = copy_bandwidth() if cuda else None
    limit = a.mem_limit_gb * 2**30
    if cuda:
        limit = min(limit, torch.cuda.get_device_properties(0).total_memory * 0.8)

    head = (
        "# token_logprobs benchmark "
        f"({'CUDA: ' + torch.cuda.get_device_name(0) if cuda else f'CPU, {a.threads} threads'})\n\n"
    )
    head += (
        f"torch {torch.__version__}; median of {a.repeats} repeats; each cell in a fresh process. "
        "Extra memory = peak minus the baseline after allocating the inputs (includes outputs and, for fwd+bwd, "
        "the logits-sized gradient). All methods return log-probs and entropy (Liger: log-probs only). "
        "Ratios are vs naive in the same run.\n\n"
    )
    if cuda:
        head += (
            f"Device-to-device copy bandwidth: {bw / 1e9:.0f} GB/s; `%bw` = minimum traffic "
            "(fwd: 1 read of the logits; bwd: 1 read + 1 write) / time / copy bandwidth.\n\n"
        )
    cols = [
        "tokens",
        "V",
        "dtype",
        "T",
        "method",
        "fwd ms",
        "fwd x naive",
        "fwd extra MB",
        "fwd+bwd ms",
        "fwd+bwd x naive",
        "fwd+bwd extra MB",
        "mem vs naive (fwd+bwd)",
    ]
    if cuda:
        cols += ["fwd %bw", "fwd+bwd %bw"]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    print(head + "\n".join(rows), flush=True)
    for N, V, d, T in grid:
        fits = {m: naive_peak_bytes(N, V, m) < limit for m in ("fwd", "fwdbwd")}
        res = {}
        for m in methods:
            for mode in ("fwd", "fwdbwd"):
                if m in ("naive", "trl") and not fits[mode]:
                    res[m, mode] = {"skip": "naive would not fit"}
                else:
                    res[m, mode] = run_cell(a, m, N, V, d, T, mode)
        for m in methods:
            f = res[m, "fwd"]
            b = res[m, "fwdbwd"]
            nf = res.get(("naive", "fwd"), {})
            nb = res.get(("naive", "fwdbwd"), {})
            if "peak_mb" in b and "peak_mb" in nb and b["peak_mb"] > 0 and m != "naive":
                memr = f"{nb['peak_mb'] / b['peak_mb']:.1f}x less"
            else:
                memr = "-"
            cells = [
                f"{N // 1024}k",
                f"{V // 1024}k",
                d,
                f"{T:g}",
                m,
                ms(f),
                ratio(f, nf),
                mb(f),
                ms(b),
                ratio(b, nb),
                mb(b),
                memr,
            ]
            if cuda:
                nbytes = N * V * {"fp32": 4, "bf16": 2, "fp16": 2}[d]
                cells += [percent_of_bandwidth(f, 1, nbytes, bw), percent_of_bandwidth(b, 3, nbytes, bw)]
            line = "| " + " | ".join(cells) + " |"
            rows.append(line)
            print(line, flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(head + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
