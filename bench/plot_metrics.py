"""Render training curves from metrics.jsonl files and print a markdown summary table.

  python bench/plot_metrics.py runs/ppo/metrics.jsonl runs/ppo_kl_off/metrics.jsonl \\
      --labels "PPO (adaptive KL)" "PPO, KL off" --out bench/ppo_curves.png

The table compares the first iteration with the mean of the last five, and counts the iterations on
which each alarm fired.
"""

import argparse
import json

PANELS = [
    ("objective/score", "reward-model score"),
    ("objective/kl", "KL to reference (nats / response)"),
    ("response/distinct2", "distinct-2"),
    ("policy/entropy", "entropy (nats / token)"),
    ("response/length", "response length (tokens)"),
    ("response/eos_rate", "EOS rate"),
]


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary_table(runs, labels):
    keys = [k for k, _ in PANELS]
    lines = ["| run | iterations | minutes | " + " | ".join(f"{k} first → last 5" for k in keys) + " | alarms fired (iterations) |",
             "|---" * (len(keys) + 4) + "|"]
    for rows, label in zip(runs, labels):
        tail = rows[-5:]
        cells = [f"{rows[0][k]:.2f} → {sum(r[k] for r in tail) / len(tail):.2f}" for k in keys]
        minutes = sum(r["time/iteration"] for r in rows) / 60
        alarms = {k.split("/", 1)[1]: int(sum(r[k] for r in rows)) for k in rows[-1] if k.startswith("alarm/")}
        fired = ", ".join(f"{k} ({n})" for k, n in alarms.items() if n) or "none"
        lines.append(f"| {label} | {len(rows)} | {minutes:.1f} | " + " | ".join(cells) + f" | {fired} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files")
    parser.add_argument("--labels", nargs="+", help="one label per file (default: the paths)")
    parser.add_argument("--out", default="curves.png", help="where the PNG goes")
    args = parser.parse_args()
    labels = args.labels or args.metrics
    if len(labels) != len(args.metrics):
        raise SystemExit(f"{len(args.metrics)} metrics files but {len(labels)} labels; give one label per file.")
    runs = [read(p) for p in args.metrics]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, title) in zip(axes.flat, PANELS):
        for rows, label in zip(runs, labels):
            ax.plot([r["episodes"] for r in rows], [r[key] for r in rows], label=label)
        ax.set_title(title)
        ax.set_xlabel("episodes")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(summary_table(runs, labels))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
