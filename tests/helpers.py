"""Running an algorithm file the way a user does: a subprocess, offline, with transformers' own hub-kernel default."""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ENV = {k: v for k, v in os.environ.items() if k != "USE_HUB_KERNELS"}  # transformers' default must not matter
ENV.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled")


def run_script(script, out, *args):
    """Run `python script --output_dir out args...` from the repository root; return the rows of its
    metrics.jsonl and everything it printed. Fails the test, with the end of stderr, if the run fails."""
    cmd = [sys.executable, os.path.join(ROOT, script), "--output_dir", str(out), *args]
    result = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return rows, result.stdout + result.stderr


def torchrun(script, out, *args, processes=2):
    """`torchrun --nproc_per_node=processes script --output_dir out args...` from the repository root, offline (gloo
    on the CPU); returns the finished process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", os.path.join(ROOT, script),
           "--output_dir", str(out), *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def readme_files(folder):
    """The files the README shows (its ```python blocks that open with `# name.py`), written into folder:
    {name: path}."""
    text = open(os.path.join(ROOT, "README.md")).read()
    written = {}
    for name, code in re.findall(r"```python\n# ([\w.]+\.py)\n(.*?)```", text, re.S):
        written[name] = os.path.join(folder, name)
        with open(written[name], "w") as f:
            f.write(code)
    return written
