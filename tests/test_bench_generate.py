"""bench/bench_generate.py: the smoke run works, and its methods do the same work on the tiny model."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_generate as bg  # noqa: E402


def test_quick_run_writes_a_row_per_method(tmp_path):
    out = tmp_path / "gen.md"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "bench", "bench_generate.py"),
        "--quick",
        "--device=cpu",
        "--threads=1",
        "--out",
        str(out),
    ]
    result = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|") for line in out.read_text().splitlines() if line.startswith("| tiny |")]
    assert [row[4].strip() for row in rows] == ["scripts", "static", "hf-generate", "no-cache"]  # no CUDA graph here
    assert rows[1][9].strip() == "yes, yes"  # the static loop made the scripts' tokens, sampled and greedy


@pytest.fixture(scope="module")
def tiny():
    model, pad = bg.load_model("tiny", torch.float32, torch.device("cpu"))
    ids, mask = bg.make_prompts(6, 10, model.config.vocab_size, pad, "cpu")
    # left padding of varied lengths
    assert (mask == 0).any()
    assert mask[:, -1].all()
    return model, pad, ids, mask


def _run(tiny, name, temperature, greedy):
    model, pad, ids, mask = tiny
    torch.manual_seed(0)
    sampling = bg.ppo.Sampling(12, temperature, bg.NEVER, pad)
    return bg.METHODS[name](model, ids, mask, sampling, greedy=greedy)[0]


def test_greedy_tokens_agree_across_methods(tiny):
    reference = _run(tiny, "scripts", 1.0, greedy=True)
    assert reference.shape == (6, 12)
    for name in ("static", "hf-generate", "no-cache"):
        assert torch.equal(_run(tiny, name, 1.0, greedy=True), reference), name
