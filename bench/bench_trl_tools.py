"""grpo_tools.py against TRL 1.16's tool-calling GRPOTrainer, on the CPU, on the embedded tool task.

Both sides train assets/tiny-tools on assets/multiply (products the policy copies from a multiply tool) with the
same tool (assets/tools.py:multiply), the same reward (assets/tools.py:final_answer, on the text of every token after
the prompt), group size, prompts per iteration, response length (the policy's and the tools' tokens together),
minibatches, learning rate, KL coefficient and number of policy turns, in fp32, one thread per process. The TRL side
is bench/trl_tools_runner.py in the peer environment venv-trl116 (made as bench/bench_trl.py's docstring says;
elsewhere: --peer_venvs or RLHF_BENCH_VENVS). The sides alternate (ours first, then TRL's first in the next repeat),
because the machine's speed drifts. Reported:
- the median time per iteration (one rollout, with its tool calls, and all its updates): our metrics.jsonl's
  `time/elapsed` from the end of one iteration to the end of the next, TRL's from one iteration's last
  `on_step_end` to the next. Model loading, the first iteration of every run (warm-up) and our last (which holds
  the held-out evaluation and the final save, done outside TRL's timed steps) are left out;
- the held-out score on assets/multiply/test.jsonl before training and after the same iterations, each prompt
  answered once at temperature 1 (ours: `eval/score`, fixed draws; TRL: its evaluate with one generation per
  prompt), the tool calls per response while training (ours `tools/calls_per_response`, TRL's
  `tools/call_frequency`), the mean training score, and the peak resident memory of each process (wait4).

Commands (from the repository root):

    python bench/bench_trl_tools.py --out bench/trl_tools.md     # 3 runs of each side, 10 iterations each
    python bench/bench_trl_tools.py --iterations 4 --repeats 1   # shorter
    python bench/bench_trl_tools.py --quick --sides ours         # a smoke test in seconds, without TRL
    python bench/bench_trl_tools.py --assets /tmp/t    # the task that assets/build.py --tools --out /tmp/t made
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_trl  # noqa: E402
from compare_algorithms import ROOT, measured, report  # noqa: E402

# grpo_tools.py's defaults, given to both sides by these names, plus --missing_eos_penalty 0: TRL has no such penalty.
SETTINGS = dict(
    model_name_or_path="assets/tiny-tools",
    dataset="assets/multiply/train.jsonl",
    eval_dataset="assets/multiply/test.jsonl",
    reward_fn="assets/tools.py:final_answer",
    tools="assets/tools.py:multiply",
    max_turns=3,
    rollout_batch_size=32,
    num_generations=8,
    minibatch_size=64,
    micro_batch_size=64,
    num_epochs=1,
    response_length=48,
    learning_rate=2e-4,
    kl_coef=0.04,
    missing_eos_penalty=0.0,
    temperature=1.0,
    eval_batch_size=100,
    model_dtype="float32",
    seed=1,
)
QUICK = dict(rollout_batch_size=4, minibatch_size=16, micro_batch_size=16)  # --quick's changes
QUICK_HELD_OUT = 20  # --quick evaluates the first rows of the held-out set only

# Where TRL's tool calling differs from grpo_tools.py's, and what was done about it: (what, ours, TRL, aligned how).
# Read from trl/trainer/grpo_trainer.py and trl/chat_template_utils.py of TRL 1.16.0.
DIFFERENCES = [
    (
        "reading a turn's calls",
        "Hermes `<tool_call>{json}</tool_call>` by regular expression (the tokenizer's parser where it has a response "
        "schema); an unclosed call at the end is read too",
        "transformers' tokenizer.parse_response with the tokenizer's response_template; add_response_schema sets one "
        "only for the chat templates TRL lists and raises 'Unrecognized chat template' for tiny-tools'",
        "TRL: bench/trl_tools_runner.py's response_template, Hermes calls, the turn anchored at the end of the "
        "prompt and closed by EOS",
    ),
    (
        "a call that cannot be read (not JSON, unclosed)",
        "a tool message saying so; the conversation goes on",
        "the turn falls back to plain text: no call, no tool message, the conversation ends",
        "not aligned (no setting)",
    ),
    (
        "a tool that raises, or a name that is no tool",
        "`error: Type: message` as the tool message; counted in tools/failed",
        "`str({'error': message})` as the tool message; counted in tools/failure_frequency",
        "not aligned (text differs)",
    ),
    (
        "where tools run",
        "each in a process of its own, with a timeout (--tool_timeout 10 s)",
        "in the trainer's process (async tools on an event loop), no timeout",
        "not aligned: ours pays a pipe round trip per call",
    ),
    (
        "turns",
        "--max_turns 3: at most 3 policy turns, the last runs no tools",
        "max_tool_calling_iterations: rounds of running calls and sampling again",
        "TRL: max_tool_calling_iterations = max_turns - 1 = 2",
    ),
    (
        "length limit",
        "--response_length 48 over the policy's and the tools' tokens; each turn samples at most what is left",
        "max_completion_length 48 over the same tokens; each later turn samples up to 48 and is cut after; a tool "
        "answer that would pass 48 is dropped and the sample stops",
        "both 48; TRL samples past the limit and discards",
    ),
    (
        "tokens of a tool's answer",
        "the chat template's text after an assistant's turn, tokenised alone",
        "the same, from a dummy conversation rendered with and without the tool message (_get_tool_suffix_ids)",
        "same tokens on this template",
    ),
    (
        "loss mask",
        "the policy's own tokens (train_mask): not the tools' messages",
        "completion_mask x tool_mask: not the tools' messages",
        "same",
    ),
    (
        "reward input",
        "final_answer on the decoded response: every token after the prompt, special tokens left out",
        "reward functions get completions as messages and completion_ids",
        "TRL: the runner decodes completion_ids as ours does and calls the same final_answer",
    ),
    (
        "prompts",
        "a text row rendered by the chat template as a user's turn, with the tools",
        "tools need a conversational dataset: with a text prompt the completion is a string and _tool_call_loop "
        "stops with AttributeError: 'str' object has no attribute 'get'",
        "TRL: each row's text as a user's message",
    ),
    (
        "held-out score",
        "eval/score: each prompt once at T = 1 with draws fixed by the seed (and eval/score_greedy)",
        "evaluate(): each prompt once (num_generations_eval=1) at T = 1, draws from torch's generator as the seed "
        "left it",
        "T = 1 on both; same prompts",
    ),
    (
        "missing-EOS penalty",
        "1.0 by default",
        "none",
        "ours: --missing_eos_penalty 0",
    ),
    (
        "optimiser, schedule, precision",
        "AdamW (fused), eps 1e-5, no weight decay, constant rate, fp32",
        "bf16, linear decay, eps 1e-8 by default",
        "TRL: bf16=False, lr_scheduler_type=constant, adam_epsilon=1e-5, weight_decay=0 (trl_runner's trl_config)",
    ),
    (
        "logprobs_old, group std, position ids",
        "as in bench/trl.md's GRPO rows",
        "as in bench/trl.md's GRPO rows",
        "not aligned (no settings): an extra forward, Bessel's std, positions counting pads",
    ),
]


def with_assets(settings, folder):
    """settings with the model and the data taken from folder; the tool and the reward stay assets/tools.py's."""
    moved = dict(settings)
    for key in ("model_name_or_path", "dataset", "eval_dataset"):
        moved[key] = os.path.join(os.path.abspath(folder), settings[key].removeprefix("assets/"))
    return moved


def flags(settings, iterations):
    """The flags both sides get, with the same names and values."""
    responses = settings["rollout_batch_size"] * settings["num_generations"]
    out = ["--total_episodes", str(iterations * responses)]
    for key, value in settings.items():
        out += [f"--{key}", str(value)]
    return out


def commands(settings, iterations, out, peer_venvs):
    """Our command and TRL's: the shared flags, then each side's own."""
    shared = flags(settings, iterations)
    ours = [
        sys.executable,
        os.path.join(ROOT, "grpo_tools.py"),
        "--output_dir",
        os.path.join(out, "ours"),
        *shared,
        f"--eval_every={iterations}",  # before training and after the last iteration only
        "--save_every=0",
    ]
    trl = [
        bench_trl.peer_python("grpo", peer_venvs),
        os.path.join(ROOT, "bench", "trl_tools_runner.py"),
        "--output_dir",
        os.path.join(out, "trl"),
        *shared,
    ]
    return {"ours": ours, "trl": trl}


def iteration_times(side, metrics_path):
    """Seconds of each timed iteration: bench_trl's (the first left out), and our last left out too, as it holds the
    held-out evaluation and the final save, which TRL does after its timed steps."""
    times = bench_trl.iteration_times(side, metrics_path)
    if side == "ours":
        return times[:-1]
    return times


def run_summary(side, out, settings):
    """One run's numbers: held-out score before and after, tool calls per response and training score (means over
    the iterations), optimiser steps per iteration (ours from the batch shape in settings)."""
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    trained = [r for r in rows if "tools/calls_per_response" in r and r["iteration"] >= 1]
    if side == "ours":
        held_out = [r["eval/score"] for r in rows if "eval/score" in r]
        steps = settings["num_epochs"] * settings["rollout_batch_size"] * settings["num_generations"]
        steps //= settings["minibatch_size"]  # every step is taken unless its gradient is not finite
    else:
        with open(os.path.join(out, "eval.json")) as f:
            held_out = [row["eval/score"] for row in json.load(f)]
        steps = round(statistics.median(r["optimizer_steps"] for r in trained))
    return {
        "before": held_out[0],
        "after": held_out[-1],
        "calls": statistics.mean(r["tools/calls_per_response"] for r in trained),
        "score": statistics.mean(r["objective/score"] for r in trained),
        "steps": steps,
    }


def cell(values, spec, join=" / "):
    """Numbers of the runs in one cell, or n/a."""
    if not values:
        return "n/a"
    return join.join(format(v, spec) for v in values)


def table(times, peaks, summaries, sides, iterations):
    """The markdown table: one row per measure, a column per side and their ratio."""

    def median(side, values):
        return statistics.median(values[side]) if side in sides and values[side] else None

    t = {s: median(s, {k: [x for run in v for x in run] for k, v in times.items()}) for s in ("ours", "trl")}
    mb = {s: median(s, peaks) for s in ("ours", "trl")}
    per_run = {s: [statistics.median(run) for run in times[s]] for s in ("ours", "trl")}
    if len(sides) == 2:
        run_ratios = ", ".join(bench_trl.ratio_cell(o, q) for o, q in zip(per_run["ours"], per_run["trl"]))
    else:
        run_ratios = "n/a"

    def of(side, key):
        return [s[key] for s in summaries[side]]

    return [
        "| | grpo_tools.py | TRL 1.16 GRPOTrainer(tools=...) | ours / TRL |",
        "|---|---:|---:|---:|",
        f"| time per iteration, s (median) | {bench_trl.number_cell(t['ours'], '.2f')} | "
        f"{bench_trl.number_cell(t['trl'], '.2f')} | **{bench_trl.ratio_cell(t['ours'], t['trl'])}** |",
        f"| per-run medians, s | {cell(per_run['ours'], '.2f')} | {cell(per_run['trl'], '.2f')} | {run_ratios} |",
        f"| held-out score before training (runs) | {cell(of('ours', 'before'), '.3f')} | "
        f"{cell(of('trl', 'before'), '.3f')} | |",
        f"| held-out score after {iterations} iterations (runs) | {cell(of('ours', 'after'), '.3f')} | "
        f"{cell(of('trl', 'after'), '.3f')} | |",
        f"| training score, mean over iterations (runs) | {cell(of('ours', 'score'), '.3f')} | "
        f"{cell(of('trl', 'score'), '.3f')} | |",
        f"| tool calls per response, mean over iterations (runs) | {cell(of('ours', 'calls'), '.2f')} | "
        f"{cell(of('trl', 'calls'), '.2f')} | |",
        f"| peak resident memory, MB (median) | {bench_trl.number_cell(mb['ours'], ',.0f')} | "
        f"{bench_trl.number_cell(mb['trl'], ',.0f')} | **{bench_trl.ratio_cell(mb['ours'], mb['trl'])}** |",
        f"| optimiser steps per iteration | {cell(of('ours', 'steps')[:1], 'd')} | {cell(of('trl', 'steps')[:1], 'd')} "
        "| |",
    ]


def machine():
    """The CPU's name, its cores and memory, from /proc (Linux), else what platform says."""
    name = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    memory = ""
    if os.path.exists("/proc/meminfo"):
        kb = int(open("/proc/meminfo").readline().split()[1])
        memory = f", {kb / 2**20:.0f} GB"
    return f"{name}, {os.cpu_count()} cores{memory}"


def versions(python):
    """torch, transformers (and trl where installed) of an interpreter."""
    code = (
        "import importlib.metadata as m\n"
        "for name in ('torch', 'transformers', 'trl'):\n"
        "    try:\n"
        "        print(f'{name} {m.version(name)}', end=', ')\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
    )
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.rstrip(", ")


def commit():
    """The repository's commit, and whether files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError:
        return "unknown"
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=10, help="iterations per run (the first is not timed)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating")
    p.add_argument("--sides", default="ours,trl", help="ours,trl; 'ours' alone runs without TRL (a smoke test)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS / MKL_NUM_THREADS of every run")
    p.add_argument("--peer_venvs", default=bench_trl.PEER_VENVS, help="the folder that holds venv-trl116")
    p.add_argument("--runs", default="runs/bench_trl_tools", help="where the runs are written")
    p.add_argument(
        "--quick", action="store_true", help="smoke test: 4 prompts x 8, 3 iterations, 1 run, 20 held-out prompts"
    )
    p.add_argument(
        "--assets",
        help="a folder holding tiny-tools/ and multiply/ (assets/build.py --tools --out FOLDER) instead of assets/",
    )
    p.add_argument("--out", help="also write the tables (markdown) here")
    a = p.parse_args()
    sides = a.sides.split(",")
    if "trl" in sides:
        bench_trl.require_peer_pythons(["grpo"], a.peer_venvs)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    os.environ["MKL_NUM_THREADS"] = str(a.threads)
    settings = dict(SETTINGS)
    if a.assets:
        settings = with_assets(settings, a.assets)
    iterations, repeats = a.iterations, a.repeats
    if a.quick:
        iterations, repeats = 3, 1
        settings.update(QUICK)
        os.makedirs(a.runs, exist_ok=True)
        held_out = os.path.abspath(os.path.join(a.runs, "held_out.jsonl"))
        with open(os.path.join(ROOT, settings["eval_dataset"])) as f:
            rows = [line for line in f if line.strip()][:QUICK_HELD_OUT]
        with open(held_out, "w") as f:
            f.writelines(rows)
        settings["eval_dataset"] = held_out
    cmds = commands(settings, iterations, a.runs, a.peer_venvs)
    times = {s: [] for s in ("ours", "trl")}  # per run: its iteration times
    peaks = {s: [] for s in ("ours", "trl")}
    summaries = {s: [] for s in ("ours", "trl")}
    for r in range(repeats):
        order = sides if r % 2 == 0 else sides[::-1]  # ABBA: each side goes first in every other repeat
        for side in order:
            out = cmds[side][cmds[side].index("--output_dir") + 1]
            shutil.rmtree(out, ignore_errors=True)  # a new run each time (a folder with checkpoints is refused)
            os.makedirs(out, exist_ok=True)
            peaks[side].append(measured(cmds[side], os.path.join(out, "output.log")))
            times[side].append(iteration_times(side, os.path.join(out, "metrics.jsonl")))
            summaries[side].append(run_summary(side, out, settings))
            print(
                f"{side} run {r + 1}: median {statistics.median(times[side][-1]):.2f} s per iteration, "
                f"{peaks[side][-1]:,.0f} MB, held-out {summaries[side][-1]['before']:.3f} -> "
                f"{summaries[side][-1]['after']:.3f}",
                flush=True,
            )
    python = {"ours": sys.executable, "trl": bench_trl.peer_python("grpo", a.peer_venvs)}
    lines = [
        f"`python bench/bench_trl_tools.py {' '.join(sys.argv[1:])}`, {datetime.date.today().isoformat()}; "
        f"{machine()}; commit {commit()}; {a.threads} thread(s) per process; fp32.",
        "",
        *(f"- {side}: {versions(python[side])}" for side in sides),
        "",
        f"{repeats} run(s) of each side, alternating, {iterations} iterations each "
        f"({settings['rollout_batch_size']} prompts x {settings['num_generations']} responses of at most "
        f"{settings['response_length']} tokens, at most {settings['max_turns']} policy turns); time per iteration "
        "over runs x iterations, the first iteration of each run and our last left out.",
        "",
        *table(times, peaks, summaries, sides, iterations),
        "",
        "Where TRL's tool calling differs from grpo_tools.py's, and what was done about it:",
        "",
        "| what | grpo_tools.py | TRL 1.16 | aligned how |",
        "|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in DIFFERENCES),
    ]
    report(lines, a.out)


if __name__ == "__main__":
    main()
