"""Threads on a CPU: the embedded default's time per iteration with 1 and 2 torch threads, torch's default, and 2
threads that sleep rather than spin while they wait (OMP_WAIT_POLICY=PASSIVE), on an idle machine and on one where
other work holds a core, alternating the settings within each repeat.

    python bench/threads.py --out bench/threads.md        # about 10 minutes on a 2-core machine

Each run is bench/real_tokens.py's: `python <script> --total_episodes <iterations + 1 of its batch> --eval_every=0`
in a fresh folder with OMP_NUM_THREADS set (or unset: torch's default, one thread per core) and, in the last column,
OMP_WAIT_POLICY=PASSIVE; reported is the median of `time/iteration` over the iterations after the first. "Busy" is
one process spinning on one core beside the run, the shape of a test suite, a compile or a second run on a laptop.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from real_tokens import EPISODES_PER_ITERATION, ROOT, run_script

SETTINGS = {  # the column: OMP_NUM_THREADS (None: unset) and the other variables of the run
    "1 thread": (1, {}),
    "2 threads": (2, {}),
    "torch's default": (None, {}),
    "2 threads, passive": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
}


def one_run(script, setting, iterations):
    """Median seconds per iteration (the first left out) of one short default run in a SETTINGS environment."""
    threads, env = SETTINGS[setting]
    with tempfile.TemporaryDirectory() as out:
        episodes = EPISODES_PER_ITERATION[script] * (iterations + 1)
        times = run_script(str(ROOT), script, episodes, os.path.join(out, "run"), threads, env)
    return statistics.median(times["iteration"])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", default="ppo.py", choices=sorted(EPISODES_PER_ITERATION))
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    results = {}
    for load in ("idle", "busy"):
        spinner = None
        if load == "busy":
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for _ in range(a.repeats):
                for setting in SETTINGS:
                    results.setdefault((load, setting), []).append(one_run(a.script, setting, a.iterations))
        finally:
            if spinner is not None:
                spinner.kill()
    lines = [
        f"`python bench/threads.py --script {a.script} --iterations {a.iterations} --repeats {a.repeats}`, "
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores (torch's default: one thread per core); seconds per "
        "iteration, the median of each run's iterations after the first, then the median over the repeats.",
        "",
        "| machine | " + " | ".join(SETTINGS) + " |",
        "|---|" + "---:|" * len(SETTINGS),
    ]
    for load in ("idle", "busy"):
        cells = [f"{statistics.median(results[(load, setting)]):.2f}" for setting in SETTINGS]
        lines.append(f"| {load} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
