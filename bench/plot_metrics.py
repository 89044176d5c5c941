"""Render training curves from metrics.jsonl files and print a markdown summary table.

  python bench/plot_metrics.py runs/ppo/metrics.jsonl runs/ppo_kl_off/metrics.jsonl \\
      --labels "PPO (adaptive KL)" "PPO, KL off" --out bench/ppo_curves.png
  python bench/plot_metrics.py runs/grpo/metrics.jsonl --x minutes --panels eval/score objective/kl ...

A panel plots every row that holds its key: held-out scores (eval/...) exist only on evaluation rows,
iteration 0 being the starting policy. The table compares the first value with the mean of the last five
(held-out scores: with the last one), and counts the iterations on which each alarm fired.
"""

import argparse
import json

TITLES = {
    "objective/score": "reward-model score",
    "objective/rule_reward": "rule reward on training prompts (T = 1)",
    "objective/kl": "KL to reference (nats / response)",
    "response/distinct2": "distinct-2",
    "policy/entropy": "entropy (nats / token)",
    "response/length": "response length (tokens)",
    "response/eos_rate": "EOS rate",
    "eval/score": "held-out score, sampled (T = 1)",
    "eval/score_greedy": "held-out score, greedy",
    "policy/clipfrac": "clip fraction",
}
DEFAULT_PANELS = [
    "objective/score",
    "objective/kl",
    "response/distinct2",
    "policy/entropy",
    "response/length",
    "response/eos_rate",
]


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def x_of(row, axis):
    return row["time/elapsed"] / 60 if axis == "minutes" else row["episodes"]


def summary_table(runs, labels, keys):
    lines = [
        "| run | iterations | minutes | "
        + " | ".join(f"{k} first → last" for k in keys)
        + " | alarms fired (iterations) |",
        "|---" * (len(keys) + 4) + "|",
    ]
    for rows, label in zip(runs, labels):
        cells = []
        for k in keys:
            values = [r[k] for r in rows if k in r]
            tail = values[-1:] if k.startswith("eval/") else values[-5:]
            cells.append(f"{values[0]:.2f} → {sum(tail) / len(tail):.2f}" if values else "-")
        trained = [r for r in rows if r["iteration"] > 0]
        if "time/elapsed" in rows[-1]:
            minutes = rows[-1]["time/elapsed"] / 60
        else:
            minutes = sum(r["time/iteration"] for r in trained) / 60
        alarms = {
            k.split("/", 1)[1]: int(sum(r.get(k, 0) for r in trained)) for k in trained[-1] if k.startswith("alarm/")
        }
        fired = ", ".join(f"{k} ({n})" for k, n in alarms.items() if n) or "none"
        lines.append(f"| {label} | {len(trained)} | {minutes:.1f} | " + " | ".join(cells) + f" | {fired} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files")
    parser.add_argument("--labels", nargs="+", help="one label per file (default: the paths)")
    parser.add_argument("--panels", nargs="+", default=DEFAULT_PANELS, help="metric keys, one panel each (six fit)")
    parser.add_argument(
        "--x",
        choices=["episodes", "minutes"],
        default="episodes",
        help="the horizontal axis: episodes, or wall-clock minutes",
    )
    parser.add_argument("--out", default="curves.png", help="where the PNG goes")
    args = parser.parse_args()
    labels = args.labels or args.metrics
    if len(labels) != len(args.metrics):
        raise SystemExit(f"{len(args.metrics)} metrics files but {len(labels)} labels; give one label per file.")
    runs = [read(p) for p in args.metrics]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(args.panels))
    rows_of_panels = (len(args.panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_of_panels, cols, figsize=(4.4 * cols, 3.3 * rows_of_panels), squeeze=False)
    for ax, key in zip(axes.flat, args.panels):
        for i, (rows, label) in enumerate(zip(runs, labels)):
            points = [(x_of(r, args.x), r[key]) for r in rows if key in r]
            if not points:  # a key this run does not log: its colour stays its own in the other panels
                continue
            marker = "o" if key.startswith("eval/") else None
            ax.plot(*zip(*points), label=label, color=f"C{i}", marker=marker, markersize=3)
        ax.set_title(TITLES.get(key, key))
        ax.set_xlabel("wall-clock minutes" if args.x == "minutes" else "episodes")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(args.panels) :]:
        ax.axis("off")
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(summary_table(runs, labels, args.panels))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
