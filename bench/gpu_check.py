"""Everything GPU-specific in one command: a session that is lent a GPU runs it once (at most 9 minutes) and gets
one markdown report. Rows, in this order, each with its own cap (ROWS; bench/gpu_check_times.md has each row's
expected time and how it was estimated); the caps of one call add up to less than its budget. A row stopped at its
cap reads "not finished in N s" (a measurement not made, not a failure); the report is appended to as each row
starts and ends, flushed, so a check killed at any point leaves every finished row on disk:

  kernels      the compiled Triton kernel against its fp64 reference (tests/test_kernels.py -k cuda)
  generation   bench_generate.py on the tiny model and the Qwen2.5-0.5B shape (random weights, bf16), 64 and 256
               prompts x 128 new tokens: the old loop (--decode plain), the new one (rlhf_kernels' CUDA-graph step,
               --decode auto on one GPU) and model.generate, alternating; the same tokens from the same uniforms and
               greedily; the memory the new loop keeps
  recipe-mem   the new loop alone at the GRPO GSM8K recipe's shape (320 x 1,024): its time and memory
  ppo          two PPO iterations at the 0.5B shape (random weights, bf16, 64 prompts x 128 tokens), old and new loop
  grpo-gsm8k   GRPO at the GSM8K recipe's shapes (0.5B shape, --mixed_precision, LoRA r 32, 64 prompts x 5, 1,024 new
               tokens): two iterations with the new loop, one with the old (its 1,024 launch-bound steps)
  real-tokens  bench/real_tokens.py's layouts of the training forward at the GSM8K recipe's lengths (the 0.5B shape,
               random weights, bf16; 40 rows in micro-batches of 8): padded with the LM head over every position,
               padded, sorted and cut (what the scripts do), the same with the fused head, packed into one row
  prefill      bench/real_tokens.py's prefill part at the same lengths (8 prompts x 5, 128 new tokens, the CUDA-graph
               loop): generate with every row's prompt encoded against each group's encoded once
  torchrun     (a call of its own: --rows=torchrun) each script under torchrun --nproc_per_node=1 (NCCL, FSDP2,
               --decode auto: the plain loop under torchrun) with --mixed_precision for three iterations saving a
               checkpoint each (DCP on CUDA), then resumed from the second: the resumed third iteration against the
               uninterrupted one
and the targets of the issue that asked for them (new loop >= 10x / 5x the old one's tokens per second at the 0.5B
shape, 256 / 64 x 128; >= 10x on the tiny model; the same tokens; a PPO iteration <= 0.6x of the old one's time).

The GPU machine's own torch, transformers and triton may be older than the lock's: the wheels it needs beyond its
image are listed, with the command that fetches them, in bench/gpu_check_wheels.txt; gpu_check.sh installs them.

    bash bench/gpu_check.sh --stamp                           # here, before the tree is copied: the commit
    bash bench/gpu_check.sh                                   # on the GPU machine: the report to $OUT/gpu_check.md
    bash bench/gpu_check.sh --rows=torchrun --out $OUT/gpu_check_torchrun.md   # then, with 4 minutes left
    python bench/gpu_check.py --device cpu --out /tmp/gpu_check_cpu.md   # the rows on tiny shapes, a few minutes

With --device cpu every row runs on tiny shapes (the 0.5B shape becomes memory_accounting.py's small one, 2 layers
of width 64; --decode auto is the plain loop there, as CUDA graphs need CUDA, and bench_generate.py runs
rlhf_kernels' step op by op; torchrun uses gloo): it checks that each step of the script runs, not any number.
tests/test_bench.py runs parts of it, a row cut by its cap, no `git`, and a check killed in the middle. Exit
status: 1 when a row failed, 2 when the check was stopped (SIGTERM, as gpu_check.sh's `timeout` sends), else 0.
"""

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from memory_accounting import SHAPE, SMALL  # noqa: E402

BUDGET_S = 530  # the whole check, under the 9 minutes a GPU session gives it (the wheels' install comes first)
SCRIPTS = ("ppo.py", "grpo.py", "rloo.py", "dapo.py")
# What the report names the versions of (the lock's versions beside any that differ)
PACKAGES = ("torch", "triton", "transformers", "tokenizers", "huggingface_hub", "accelerate", "peft", "kernels", "tyro")


def sizes(device):
    """The shapes of every row: the issue's on CUDA, tiny ones elsewhere."""
    if device == "cuda":
        return dict(
            kernels=["-k", "cuda"],
            generation=[
                "--dtype=bfloat16",
                "--models=tiny,qwen0.5b-shape",
                "--batches=64,256",
                "--new-tokens=128",
                "--methods=scripts,cuda-graph,hf-generate",
                "--repeats=2",
            ],
            recipe_mem=[
                "--dtype=bfloat16",
                "--models=qwen0.5b-shape",
                "--batches=320",
                "--new-tokens=1024",
                "--methods=cuda-graph",
                "--repeats=1",
            ],
            shape=SHAPE,
            old="plain",
            new="auto",
            prompts=64,
            tokens=128,
            recipe_tokens=1024,
            lora_r=32,
            generations=5,
            micro=8,
            real_tokens=["--dtype=bfloat16", "--gsm8k-rows=40", "--repeats=2"],
            prefill=["--dtype=bfloat16", "--gsm8k-rows=40", "--repeats=2", "--new-tokens=128", "--decode=static"],
        )
    return dict(
        kernels=["-k", "check_range"],
        generation=[
            "--models=tiny",
            "--batches=8",
            "--new-tokens=8",
            "--threads=1",
            "--methods=scripts,static,hf-generate",
            "--repeats=1",
        ],
        recipe_mem=[
            "--models=tiny",
            "--batches=8",
            "--new-tokens=16",
            "--threads=1",
            "--methods=static",
            "--repeats=1",
        ],
        shape=SMALL,
        old="plain",
        new="auto",
        prompts=4,
        tokens=8,
        recipe_tokens=16,
        lora_r=4,
        generations=2,
        micro=4,
        real_tokens=["--gsm8k-rows=10", "--length-scale=0.05", "--repeats=1"],
        prefill=["--gsm8k-rows=10", "--length-scale=0.05", "--repeats=1", "--new-tokens=8", "--decode=static"],
    )


# ------------------------------------------------------------------------------------------------ running
class Stopped(BaseException):
    """The check was sent SIGTERM (gpu_check.sh's timeout): the row running is left, the report closed."""


def stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def call(ctx, cmd, timeout, env=None):
    """Run a command from the repository root in a process group of its own: (return code, its output). Past timeout
    the group is killed, ctx["cut"] is set (the row is not finished, not failed) and the code is 124; a check
    stopped meanwhile kills it too."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # torchrun's workers too
    )
    try:
        output = proc.communicate(timeout=max(timeout, 0.1))[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        ctx["cut"] = True
        return 124, proc.communicate()[0] + f"\n(not finished in {timeout:.0f} s)"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc.returncode, output


def tail(output, n=15):
    return ["```", *output.strip().splitlines()[-n:], "```"]


def script_run(ctx, script, out, timeout, *args, torchrun=False):
    """One run of a script: (return code, output, rows of its metrics.jsonl)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1"] if torchrun else [sys.executable]
    code, output = call(ctx, [*launcher, os.path.join(ROOT, script), "--output_dir", out, *args], timeout)
    path = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return code, output, rows


def bench_table(path):
    """The rows of a bench_generate.py table: {(model, batch, new tokens, method): {column: text}}."""
    header = None
    rows = {}
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "model":
            header = cells
        elif header and line.startswith("|") and not line.startswith("|---"):
            row = dict(zip(header, cells))
            rows[row["model"], int(row["batch"]), int(row["new tokens"]), row["method"]] = row
    return rows


def ratio(text):
    """A ratio cell such as '12.31x' as a number (nan when missing)."""
    try:
        return float(text.rstrip("x"))
    except (AttributeError, ValueError):
        return math.nan


# ----------------------------------------------------------------------------------------------- the rows
def row_kernels(ctx, timeout):
    env = {"TRITON_INTERPRET": "0" if ctx["device"] == "cuda" else "1"}
    code, output = call(
        ctx,
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            os.path.join(ROOT, "tests", "test_kernels.py"),
            *ctx["sizes"]["kernels"],
        ],
        timeout,
        env,
    )
    last = output.strip().splitlines()[-1] if output.strip() else "no output"
    return code == 0 and " passed" in last, last, tail(output, 5)


def row_generation(ctx, timeout, key="generation"):
    """bench_generate.py's table; it passes when the run does and the new loop makes the tokens of the static loop run
    op by op (the eager path). The tokens against the old loop are reported: bf16 rounding may flip a near tie."""
    out = os.path.join(ctx["tmp"], f"{key}.md")
    code, output = call(
        ctx,
        [
            sys.executable,
            os.path.join(HERE, "bench_generate.py"),
            "--device",
            ctx["device"],
            *ctx["sizes"][key],
            "--out",
            out,
        ],
        timeout,
    )
    ctx[key] = bench_table(out)
    table = open(out).read().splitlines() if os.path.exists(out) else []
    old = sorted({r["same tokens (sampled, greedy)"] for r in ctx[key].values()} - {"-"})
    eager = [r["same as static, op by op"] for r in ctx[key].values() if r["same as static, op by op"] != "-"]
    summary = (
        f"{len(ctx[key])} rows; same tokens as the old loop: {', '.join(old) or '-'}; as the eager path: "
        f"{', '.join(sorted(set(eager))) or '-'}"
    )
    passed = code == 0 and bool(ctx[key]) and all(s == "yes, yes" for s in eager)
    return passed, summary, table or tail(output)


def row_recipe_memory(ctx, timeout):
    return row_generation(ctx, timeout, "recipe_mem")


def random_models(ctx, timeout):
    """The random policy and reward model of the 0.5B shape (the small one on the CPU), built once, by a child under
    the row's time: (their two folders, or None where they were not built; the child's output)."""
    folder = os.path.join(ctx["tmp"], "models")
    if not os.path.exists(folder):
        code = [
            "import os, sys",
            f"sys.path.insert(0, {HERE!r})",
            "from memory_accounting import build",
            f"build({folder + '.part'!r}, {ctx['sizes']['shape']!r}, 'bfloat16')",
            f"os.rename({folder + '.part'!r}, {folder!r})",  # whole or not at all
        ]
        output = call(ctx, [sys.executable, "-c", "\n".join(code)], timeout)[1]
        if not os.path.exists(folder):
            return None, output
    return (os.path.join(folder, "policy"), os.path.join(folder, "rm")), ""


def old_and_new(ctx, timeout, script, new_args, old_args):
    """A short run with the new loop, then the same with the old one: a table of seconds per iteration and of
    generation; the new loop's last iteration (past its capture) over the old one's goes to ctx[script]. The new loop
    gets 0.45 of the time, the old one what is left: if it is cut, the iterations it finished still count."""
    s = ctx["sizes"]
    seconds = {}
    started = time.time()
    notes = []
    lines = ["| loop | iteration | time/iteration s | time/generate s | response length |", "|---|---:|---:|---:|---:|"]
    for decode, args in ((s["new"], new_args), (s["old"], old_args)):
        out = os.path.join(ctx["tmp"], f"{script}-{decode}")
        left = timeout - (time.time() - started)
        if decode == s["new"]:
            left = 0.45 * left
        code, output, rows = script_run(ctx, script, out, left, *args, "--decode", decode)
        rows = [r for r in rows if "time/iteration" in r]
        if not rows:
            return False, f"--decode {decode} failed ({code})", lines + tail(output)
        if code != 0:
            notes.append(f"--decode {decode} stopped ({code}) after {len(rows)} iterations")
        for r in rows:
            lines.append(
                f"| {decode} | {r['iteration']} | {r['time/iteration']:.2f} | {r['time/generate']:.2f} | "
                f"{r['response/length']:.0f} |"
            )
        seconds[decode] = [r["time/iteration"] for r in rows]
    new = seconds[s["new"]][-1]  # the first iteration holds the capture and warm-ups
    old = seconds[s["old"]][-1]
    ctx[script] = new / old
    summary = (
        f"iteration {len(seconds[s['old']])} old {old:.2f} s, iteration {len(seconds[s['new']])} new {new:.2f} s "
        f"({ctx[script]:.2f}x)"
    )
    return not notes, "; ".join([summary, *notes]), lines


def ppo_args(s, policy, rm, iterations=2):
    """PPO at the 0.5B shape: 64 prompts x 128 tokens in bf16 (a tiny rollout on the CPU)."""
    args = [
        "--model_name_or_path",
        policy,
        "--reward_model_path",
        rm,
        "--model_dtype=bfloat16",
        "--total_episodes",
        str(iterations * s["prompts"]),
        "--rollout_batch_size",
        str(s["prompts"]),
        "--response_length",
        str(s["tokens"]),
        "--eval_every=0",
        "--save_every=0",
    ]
    if s["shape"] is SMALL:
        args += ["--minibatch_size=4", "--micro_batch_size=4", "--num_epochs=1"]
    return args


def grpo_args(s, policy, iterations=2):
    """The GRPO GSM8K recipe of docs/recipes.md with its shapes (the arithmetic prompts and rule stand in for GSM8K's,
    which need the hub): --mixed_precision, LoRA rank 32, 64 prompts x 5, 1,024 new tokens, one step per rollout."""
    responses = s["prompts"] * s["generations"]
    return [
        "--model_name_or_path",
        policy,
        "--mixed_precision",
        "--dataset=assets/arithmetic/train.jsonl",
        "--reward_model_path",
        "--reward_fn",
        "arithmetic",
        "--num_generations",
        str(s["generations"]),
        "--rollout_batch_size",
        str(s["prompts"]),
        "--minibatch_size",
        str(responses),
        "--micro_batch_size",
        str(s["micro"]),
        "--num_epochs=1",
        "--total_episodes",
        str(iterations * responses),
        "--learning_rate=3e-5",
        "--lora_r",
        str(s["lora_r"]),
        "--lora_alpha",
        str(s["lora_r"]),
        "--kl_coef=0.001",
        "--ent_coef=0.001",
        "--response_length",
        str(s["recipe_tokens"]),
        "--max_prompt_length=512",
        "--eval_every=0",
        "--save_every=0",
    ]


def torchrun_args(script):
    """Three iterations of the embedded task, a checkpoint each, evaluation at the end; --decode auto, which is the
    plain loop under torchrun (FSDP2's hooks cannot be captured in a CUDA graph)."""
    group = ["--rollout_batch_size=4", "--num_generations=4", "--minibatch_size=16", "--micro_batch_size=8"]
    sizes = ["--rollout_batch_size=16", "--minibatch_size=8", "--micro_batch_size=4"]
    return [
        *(sizes if script == "ppo.py" else group),
        "--total_episodes=48",
        "--response_length=16",
        "--mixed_precision",
        "--decode=auto",
        "--save_every=1",
        "--eval_every=3",
        "--eval_batch_size=32",
    ]


def row_ppo(ctx, timeout):
    """Two iterations with each loop (the random models are built here, once for every row that needs them)."""
    started = time.time()
    models, output = random_models(ctx, timeout)
    if models is None:
        return False, "the random 0.5B-shape models were not built", tail(output)
    args = ppo_args(ctx["sizes"], *models)
    return old_and_new(ctx, timeout - (time.time() - started), "ppo.py", args, args)


def row_grpo_gsm8k(ctx, timeout):
    """Two iterations with the new loop, one with the old one (2 x 1,024 launch-bound steps would not fit its cap):
    the new loop's second iteration against the old one's first, which has no capture to hold."""
    started = time.time()
    models, output = random_models(ctx, timeout)
    if models is None:
        return False, "the random 0.5B-shape models were not built", tail(output)
    s = ctx["sizes"]
    left = timeout - (time.time() - started)
    return old_and_new(ctx, left, "grpo.py", grpo_args(s, models[0]), grpo_args(s, models[0], iterations=1))


def real_tokens_part(ctx, timeout, part):
    """A part of bench/real_tokens.py at the recipe's lengths on the random 0.5B-shape policy: (return code, the
    table's lines, the output)."""
    started = time.time()
    models, output = random_models(ctx, timeout)
    if models is None:
        return 1, [], output
    timeout = timeout - (time.time() - started)
    out = os.path.join(ctx["tmp"], f"real_tokens_{part}.md")
    code, output = call(
        ctx,
        [
            sys.executable,
            os.path.join(HERE, "real_tokens.py"),
            "--part",
            part,
            "--settings=gsm8k",
            "--policy",
            models[0],
            "--device",
            ctx["device"],
            *ctx["sizes"]["real_tokens" if part == "layouts" else part],
            "--out",
            out,
        ],
        timeout,
    )
    table = [line for line in open(out).read().splitlines() if line.startswith("|")] if os.path.exists(out) else []
    return code, table, output


def row_real_tokens(ctx, timeout):
    """The training forward's layouts at the recipe's lengths; passes when the packed and fused layouts' log-probs
    equal the padded ones (the bench checks them before timing) and every layout was timed."""
    code, table, output = real_tokens_part(ctx, timeout, "layouts")
    summary = "sorted and cut, packed / padded with the full head: " + (
        ", ".join(table[-1].strip("| ").split(" | ")[-2:]) if len(table) > 2 else "-"
    )
    return code == 0 and len(table) > 2, summary, table or tail(output)


def row_prefill(ctx, timeout):
    """generate at the recipe's lengths, each group's prompt encoded once against every row's; passes when both were
    timed (whether they sampled the same tokens is reported: in bf16 a batch of other size may round otherwise)."""
    code, table, output = real_tokens_part(ctx, timeout, "prefill")
    cells = table[-1].strip("| ").split(" | ") if len(table) > 2 else []
    summary = f"once / every row: prefill {cells[4]}, generate {cells[7]}; same tokens: {cells[8]}" if cells else "-"
    return code == 0 and len(table) > 2, summary, table or tail(output)


def row_torchrun(ctx, timeout):
    """Each script on the embedded models: three iterations under torchrun with --mixed_precision, a checkpoint each,
    then the third again from the second's checkpoint; compared: every logged number of the third iteration."""
    lines = [
        "| script | three iterations | resumed from checkpoint-2 | largest relative difference, iteration 3 |",
        "|---|---|---|---:|",
    ]
    ok = True
    started = time.time()
    for script in SCRIPTS:
        args = torchrun_args(script)
        full = os.path.join(ctx["tmp"], f"torchrun-{script}-full")
        resumed = os.path.join(ctx["tmp"], f"torchrun-{script}-resumed")
        left = timeout - (time.time() - started)
        code, output, rows = script_run(ctx, script, full, left / 2, *args, torchrun=True)
        if code == 0:
            left = timeout - (time.time() - started)
            code, output, again = script_run(
                ctx, script, resumed, left, *args, "--resume", os.path.join(full, "checkpoint-2"), torchrun=True
            )
        if code != 0:
            lines.append(f"| {script} | failed ({code}) | | |")
            return False, f"{script} failed", lines + tail(output)
        last = rows[-1]
        last_again = again[-1]
        numbers = [k for k in last if not k.startswith(("time/", "memory/")) and isinstance(last[k], (int, float))]
        worst = max(abs(last[k] - last_again.get(k, math.nan)) / max(abs(last[k]), 1e-6) for k in numbers)
        finite = all(math.isfinite(r[k]) for r in rows + again for k in numbers if isinstance(r.get(k), float))
        right = [r["iteration"] for r in rows] == [0, 1, 2, 3] and again[-1]["iteration"] == 3 and finite
        ok = ok and right
        lines.append(
            f"| {script} | iterations {[r['iteration'] for r in rows]} | iteration {last_again['iteration']}, "
            f"{'finite' if finite else 'NOT finite'} | {worst:.1e} |"
        )
    return ok, "four scripts, NCCL/gloo, FSDP2, --mixed_precision, DCP checkpoint and resume", lines


# (name, row, its cap: the most seconds it may take). bench/gpu_check_times.md gives each row's expected time on one
# H100 or H200 and how it was estimated (no GPU has run it yet); a cap is its estimate with about a quarter more.
# One call runs every row but torchrun: 480 s of caps against the 530 s budget, 50 s for starting Python, reading
# versions and between rows. torchrun is a call of its own (its cap alone), for a session with 4 minutes left.
ROWS = [
    ("kernels", row_kernels, 45),
    ("generation", row_generation, 120),
    ("recipe-mem", row_recipe_memory, 35),
    ("ppo", row_ppo, 90),
    ("grpo-gsm8k", row_grpo_gsm8k, 120),
    ("real-tokens", row_real_tokens, 40),
    ("prefill", row_prefill, 30),
    ("torchrun", row_torchrun, 200),
]
ONE_CALL = [name for name, _, _ in ROWS if name != "torchrun"]  # the default rows: one call, inside the budget
MARGIN_S = 50  # what the caps of one call leave of its budget


# ---------------------------------------------------------------------------------------------- the report
def targets(ctx):
    """The issue's targets against what the rows measured: (what, measured, met)."""
    if ctx["device"] != "cuda":
        return []
    table = ctx.get("generation", {})

    def speedup(model, batch):
        return ratio(table.get((model, batch, 128, "cuda-graph"), {}).get("vs scripts"))

    found = [
        (
            "0.5B shape, bf16, 256 x 128: the new loop's tokens/s >= 10x the old one's",
            speedup("qwen0.5b-shape", 256),
            10,
        ),
        ("0.5B shape, bf16, 64 x 128: >= 5x", speedup("qwen0.5b-shape", 64), 5),
        ("tiny model, 256 x 128: >= 10x", speedup("tiny", 256), 10),
    ]
    rows = [(what, f"{x:.2f}x", x >= goal) for what, x, goal in found]
    graph = [r for r in table.values() if r["method"] == "cuda-graph"]
    eager = [r["same as static, op by op"] for r in graph]
    rows.append(
        (
            "the same tokens as the eager path (the static loop op by op), from the same uniforms and greedy",
            ", ".join(eager) or "-",
            bool(eager) and all(s == "yes, yes" for s in eager),
        )
    )
    rows.append(
        (
            "(not a target) the same tokens as the old loop; its largest log-prob difference",
            "; ".join(f"{r['same tokens (sampled, greedy)']} ({r['max abs logp diff']})" for r in graph) or "-",
            None,
        )
    )
    if "ppo.py" in ctx:
        rows.append(
            (
                "a PPO iteration at the 0.5B shape <= 0.6x of the old one's time",
                f"{ctx['ppo.py']:.2f}x",
                ctx["ppo.py"] <= 0.6,
            )
        )
    if "grpo.py" in ctx:
        rows.append(
            (
                "(not a target) the GSM8K recipe's shapes: seconds per iteration, new over old",
                f"{ctx['grpo.py']:.2f}x",
                None,
            )
        )
    return rows


def verdict_cell(ok, cut, seconds):
    """A row's result: True passed, False failed, None skipped; one cut by its cap was not finished, whatever else."""
    if cut:
        return f"not finished in {seconds:.0f} s"
    if ok is None:
        return "skipped"
    if ok:
        return "pass"
    return "FAIL"


def met_cell(met):
    """A target's: None is no target, else whether it was met."""
    if met is None:
        return "-"
    if met:
        return "yes"
    return "NO"


def append(path, lines):
    """Add lines to the report and put them on disk at once: a check killed later keeps them."""
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
        f.flush()
        os.fsync(f.fileno())


def commit_of(root):
    """The commit the check runs: $GPU_CHECK_COMMIT, else bench/gpu_check.commit (`gpu_check.sh --stamp` writes it in
    the caller's tree, before it is copied to a machine without .git or git), else git's; never an error."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    stamp = os.path.join(root, "bench", "gpu_check.commit")
    if os.path.exists(stamp):
        return open(stamp).read().strip() + " (from bench/gpu_check.commit)"
    try:
        done = subprocess.run(
            ["git", "-C", root, "describe", "--always", "--dirty", "--abbrev=7"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown (git could not run: {type(e).__name__}; run `bash bench/gpu_check.sh --stamp` before copying)"
    if done.returncode != 0:
        return "unknown (no .git here; run `bash bench/gpu_check.sh --stamp` before copying)"
    return done.stdout.strip()


def versions():
    """Python's and each package's version as installed, the lock's beside any that differs: one line."""
    lock = {}
    for line in open(os.path.join(ROOT, "requirements.lock")):
        name, _, version = line.split(";")[0].strip().partition("==")
        if version and not name.startswith("#"):
            lock[name.lower().replace("_", "-")] = version
    found = [f"Python {platform.python_version()}"]
    for package in PACKAGES:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "missing"
        wanted = lock.get(package.replace("_", "-"))
        if wanted and not version.startswith(wanted):  # torch's local suffix (+cu128, +cpu) is the same version
            version += f" (the lock: {wanted})"
        found.append(f"{package} {version}")
    return ", ".join(found)


def header(ctx, argv, caps):
    """The report's first lines: the device, the command, the commit, the versions, the rows and their caps."""
    import torch

    device = torch.cuda.get_device_name() if ctx["device"] == "cuda" else f"CPU ({platform.machine()})"
    command = " ".join(["python bench/gpu_check.py", *argv])
    return [
        f"# gpu_check: {device}, {datetime.datetime.now():%Y-%m-%d %H:%M}",
        "",
        f"`{command}`" + ("" if ctx["device"] == "cuda" else " (tiny shapes: a dry run, no number counts)"),
        "",
        f"- commit: {commit_of(ROOT)}",
        f"- versions: {versions()}",
        f"- rows and their caps (s): {', '.join(f'{name} {cap:g}' for name, cap in caps)}; budget {ctx['budget']:g} s",
        "",
        "Each row's section is written as it starts and ends; a section with no result is the row the check was in",
        "when it was killed.",
    ]


def summary(ctx, results):
    """The last lines: every row's result in a table, then the issue's targets against what the rows measured."""
    lines = ["", "## summary", "", "| row | result | seconds | summary |", "|---|---|---:|---|"]
    for name, verdict, seconds, text in results:
        lines.append(f"| {name} | {verdict} | {seconds:.0f} | {text} |")
    found = targets(ctx)
    if found:
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        for what, x, met in found:
            lines.append(f"| {what} | {x} | {met_cell(met)} |")
    return lines


def run_row(ctx, name, row, timeout):
    """One row, its section of the report written as it starts and as it ends: (result, seconds, summary)."""
    append(ctx["out"], ["", f"## {name}", "", f"started, {timeout:.0f} s given"])
    ctx["cut"] = False
    t0 = time.time()
    try:
        ok, text, details = row(ctx, timeout)
    except Exception as e:  # a broken row is reported, and the next one runs
        ok = False
        text = f"{type(e).__name__}: {e}"
        details = []
    seconds = time.time() - t0
    verdict = verdict_cell(ok, ctx["cut"], timeout)
    append(ctx["out"], ["", f"**{verdict}** ({seconds:.0f} s): {text}", "", *details])
    print(f"{name}: {verdict} ({seconds:.0f} s) {text}", flush=True)
    return verdict, seconds, text


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda where there is one")
    p.add_argument("--out", default=None, help="the report (default: $OUT/gpu_check.md, else bench/gpu_check.md)")
    p.add_argument("--rows", default=",".join(ONE_CALL), help="rows, comma-separated (default: all but torchrun)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all rows")
    p.add_argument("--caps", default="", help="other caps than ROWS' for some rows: name=seconds,...")
    a = p.parse_args(argv)
    caps = {name: cap for name, _, cap in ROWS}
    for item in a.caps.split(","):
        if item:
            name, _, seconds = item.partition("=")
            caps[name] = float(seconds)
    unknown = (set(a.rows.split(",")) | set(caps)) - {name for name, _, _ in ROWS}
    if unknown:
        p.error(f"no row named {', '.join(sorted(unknown))}; the rows are {', '.join(n for n, _, _ in ROWS)}")
    chosen = [(name, row) for name, row, _ in ROWS if name in a.rows.split(",")]
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = a.out or os.path.join(os.environ.get("OUT") or HERE, "gpu_check.md")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    started = time.time()
    results = []
    stopped = None
    previous = signal.signal(signal.SIGTERM, stop)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = dict(device=device, sizes=sizes(device), tmp=tmp, out=out, budget=a.budget)
        open(out, "w").close()
        try:
            append(out, header(ctx, argv, [(name, caps[name]) for name, _ in chosen]))
            for name, row in chosen:
                left = a.budget - (time.time() - started)
                if left < min(caps[name], 30):
                    results.append((name, "skipped", 0.0, f"no time left ({left:.0f} s)"))
                    append(out, ["", f"## {name}", "", f"**skipped**: no time left ({left:.0f} s)"])
                    continue
                results.append((name, *run_row(ctx, name, row, min(caps[name], left))))
        except Stopped as e:
            stopped = str(e)
        finally:
            signal.signal(signal.SIGTERM, previous)
        if stopped:
            seconds = time.time() - started
            append(out, ["", f"**stopped** by {stopped} after {seconds:.0f} s of the check, in this row"])
            left_out = [name for name, _ in chosen[len(results) :]]
            for name in left_out:
                verdict = "not run"
                if name == left_out[0]:
                    verdict = f"stopped by {stopped}"
                results.append((name, verdict, 0.0, ""))
        append(out, summary(ctx, results))
    print(f"report: {out}")
    if stopped:
        return 2
    return 1 if any(verdict == "FAIL" for _, verdict, _, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
