"""bench/compare_algorithms.py and bench/memory_accounting.py: their arithmetic by hand, and smoke runs (tiny sizes,
not timed)."""

import os
import subprocess
import sys

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import compare_algorithms  # noqa: E402


def test_generated_tokens_by_hand():
    # the evaluation before training samples nothing for training
    rows = [
        {"iteration": 0, "episodes": 0, "eval/score": 0.3},
        {"iteration": 1, "episodes": 64, "response/length": 10.0},
        {"iteration": 2, "episodes": 128, "response/length": 12.5},
        {"iteration": 3, "episodes": 256, "response/length": 2.0},
    ]
    assert compare_algorithms.generated_tokens(rows) == 64 * 10.0 + 64 * 12.5 + 128 * 2.0


def test_smoke_run(tmp_path):
    out = tmp_path / "compare.md"
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "compare_algorithms.py"),
            "--quick",
            "--tasks=arithmetic",
            "--algorithms=GRPO,RLOO",
            "--runs",
            str(tmp_path / "runs"),
            "--plots",
            str(tmp_path),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = out.read_text()
    assert "### arithmetic: 256 responses each" in table
    for algorithm in ("GRPO", "RLOO"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {algorithm} |"))
        start = float(row.split("|")[2].split("→")[0])
        assert 0.0 <= start <= 1.0  # an accuracy over the held-out prompts
        assert os.path.exists(tmp_path / "runs" / "arithmetic" / algorithm.lower() / "metrics.jsonl")


def test_memory_accounting_counts_parameters_by_hand(tmp_path):
    out = tmp_path / "memory.md"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "memory_accounting.py"), "--small", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:5]
        for line in out.read_text().splitlines()
        if line.startswith("| ") and "---" not in line
    }
    # Qwen2, width 64, 4 heads of 16 (2 for keys and values), MLP 128, 2 layers, vocabulary 151,936, tied embeddings
    layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    policy = 151936 * 64 + 2 * layer + 64
    assert int(rows["policy (trained)"][0].replace(",", "")) == policy
    assert int(rows["reward model (frozen)"][0].replace(",", "")) == policy + 64  # the score head, one label
    # fp32: weights, gradients, two Adam moments
    assert [int(rows[k][1]) for k in ("policy (trained)", "reference (frozen)")] == [16, 4]
    assert int(rows["policy (trained)"][2].replace(",", "")) == round(policy * 16 / 2**20)
    assert "Measured peak of two PPO iterations" in out.read_text()
