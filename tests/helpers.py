"""Running an algorithm file the way a user does: a subprocess, offline, with transformers' own hub-kernel default."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script, out, *args):
    """Run `python script --output_dir out args...` from the repository root; return the rows of its
    metrics.jsonl and everything it printed. Fails the test, with the end of stderr, if the run fails."""
    cmd = [sys.executable, os.path.join(ROOT, script), "--output_dir", str(out), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.pop("USE_HUB_KERNELS", None)  # transformers' default (hub kernels on since 5.25) must not matter
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return rows, result.stdout + result.stderr
