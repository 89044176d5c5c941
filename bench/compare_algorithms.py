"""PPO, GRPO and RLOO on the same embedded task with the same budget of sampled responses: the held-out score,
the KL to the reference, the tokens generated, wall time and peak memory, as a markdown table, and one plot per
task of the held-out score against wall time (through bench/plot_metrics.py).

    python bench/compare_algorithms.py                          # both tasks, about 25 minutes on 2 CPU cores
    python bench/compare_algorithms.py --tasks reviews --quick  # a smoke test in seconds

Each script runs with its own defaults (batch sizes, learning rate, KL weight and where the KL goes) except
for the task: the dataset, the reward, and the number of responses, which is the same for the three. Runs go one
after the other, so that their wall times are comparable; peak memory is each process's maximum resident set.
"""

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_metrics import read  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"PPO": "ppo.py", "GRPO": "grpo.py", "RLOO": "rloo.py"}
RESPONSES_PER_ITERATION = {"PPO": 64, "GRPO": 256, "RLOO": 64}  # the scripts' defaults
TASKS = {
    "reviews": dict(
        responses=9600,
        args=["--dataset=assets/reviews/train.jsonl", "--reward_model_path", "assets/tiny-rm"],
        score="held-out reward-model score (T = 1)",
    ),
    "arithmetic": dict(
        responses=25600,
        args=["--dataset=assets/arithmetic/train.jsonl", "--reward_fn", "arithmetic", "--reward_model_path"],
        score="held-out accuracy (T = 1)",
    ),
}


def measured(cmd, log_path):
    """Run a command from the repository root, offline; return its peak resident memory in MB (this child's own,
    from wait4). Its output goes to log_path."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}, stdout=log, stderr=log
        )
        _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(cmd[1:3])} failed; see {log_path}")
    return usage.ru_maxrss / 1024


def report(lines, out):
    """Print the tables, and write them to out when given."""
    print("\n".join(lines))
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


def run(algorithm, task, out, responses, evaluations):
    """One training run in a subprocess; returns its metrics rows and its peak resident memory in MB."""
    iterations = responses // RESPONSES_PER_ITERATION[algorithm]
    cmd = [
        sys.executable,
        os.path.join(ROOT, SCRIPTS[algorithm]),
        "--output_dir",
        out,
        *TASKS[task]["args"],
        "--total_episodes",
        str(responses),
        "--eval_every",
        str(max(1, iterations // evaluations)),
        "--save_every=0",
    ]
    if task == "reviews" and algorithm == "GRPO":  # grpo.py's default task is arithmetic: no rule reward here
        cmd += ["--reward_fn"]
    shutil.rmtree(out, ignore_errors=True)  # a new run each time (a folder with checkpoints is refused)
    os.makedirs(out, exist_ok=True)
    peak_mb = measured(cmd, os.path.join(out, "output.log"))
    return read(os.path.join(out, "metrics.jsonl")), peak_mb


def generated_tokens(rows):
    """Sum over iterations of the responses sampled times their mean length."""
    total = 0.0
    episodes = 0
    for r in rows:
        if r["iteration"] > 0:
            total += (r["episodes"] - episodes) * r["response/length"]
            episodes = r["episodes"]
    return total


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="reviews,arithmetic")
    p.add_argument("--algorithms", default="PPO,GRPO,RLOO")
    p.add_argument("--runs", default="runs/compare", help="where the runs are written")
    p.add_argument(
        "--evaluations", type=int, default=10, help="held-out evaluations per run (plus one before training)"
    )
    p.add_argument("--quick", action="store_true", help="smoke test: 256 responses, 8-token responses, 2 evaluations")
    p.add_argument("--out", help="also write the tables (markdown) here")
    p.add_argument("--plots", default="bench", help="folder for the compare_<task>.png plots")
    a = p.parse_args()
    if a.quick:
        for task in TASKS.values():
            task["responses"] = 256
            task["args"] = task["args"] + ["--response_length=8"]
        a.evaluations = 1
    lines = []
    for task in a.tasks.split(","):
        lines += [
            f"### {task}: {TASKS[task]['responses']} responses each",
            "",
            f"| algorithm | {TASKS[task]['score']}: start → end (best) | KL to reference, end | "
            "tokens generated | minutes | peak memory MB |",
            "|---|---|---|---|---|---|",
        ]
        paths = []
        labels = []
        for algorithm in a.algorithms.split(","):
            out = os.path.join(a.runs, task, algorithm.lower())
            rows, peak_mb = run(algorithm, task, out, TASKS[task]["responses"], a.evaluations)
            held_out = [r["eval/score"] for r in rows if "eval/score" in r]
            kl = [r["objective/kl"] for r in rows if "objective/kl" in r]
            lines.append(
                f"| {algorithm} | {held_out[0]:.3f} → {held_out[-1]:.3f} ({max(held_out):.3f}) | "
                f"{kl[-1]:.2f} | {generated_tokens(rows):,.0f} | {rows[-1]['time/elapsed'] / 60:.1f} | "
                f"{peak_mb:,.0f} |"
            )
            print(lines[-1], flush=True)
            paths.append(os.path.join(out, "metrics.jsonl"))
            labels.append(algorithm)
        lines.append("")
        if importlib.util.find_spec("matplotlib") is None:
            print("matplotlib is not installed (pip install -r bench/requirements.txt): no plot")
            continue
        subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "bench", "plot_metrics.py"),
                *paths,
                "--labels",
                *labels,
                "--x=minutes",
                "--panels",
                "eval/score",
                "objective/kl",
                "response/length",
                "--out",
                os.path.join(a.plots, f"compare_{task}.png"),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    report(lines, a.out)


if __name__ == "__main__":
    main()
