"""bench/padding.py: its counts against a hand computation, its long-tailed shape, and a quick run on a real
rollout."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import padding  # noqa: E402


def test_the_counts_of_a_small_rollout_by_hand():
    # four responses in two groups of two; prompts of 2, 3, 1, 4 tokens (left-padded to 4), responses of 5, 1, 2, 2
    m = padding.measured([2, 3, 1, 4], [5, 1, 2, 2], micro=2, group=2)
    # 20 real tokens; today every row is 4 + 5 = 9 wide: 36 positions
    assert m["today"] == pytest.approx(36 / 20)
    assert m["padding"] == pytest.approx(16 / 36)
    # sorted by length (3, 4, 6, 7: rows 2, 1, 3, 0): [2, 1] is 3 + 2 wide, [3, 0] is 4 + 5: 2 * 5 + 2 * 9 = 28
    assert m["sorted_cut"] == pytest.approx(28 / 20)
    assert 20 / 20 <= m["cut"] <= 36 / 20  # whatever the shuffle, between packing and today
    assert m["training"] == m["sorted_cut"]  # one minibatch of all four (the default): sorted whole
    # minibatches of two, in micro-batches of two: nothing to sort within, each micro-batch cut as drawn
    assert padding.measured([2, 3, 1, 4], [5, 1, 2, 2], micro=2, group=2, minibatch=2)["training"] == m["cut"]
    # the logits read: one per response token (10 of 36); the reward model reads one per row (4 of 36)
    assert m["unread"] == pytest.approx(26 / 36)
    assert m["unread_rm"] == pytest.approx(32 / 36)
    # the prefill: 4 rows x 4 columns for 10 / 2 = 5 distinct prompt tokens
    assert m["prefill"] == pytest.approx(16 / 5)
    # now each group's prompt once: 2 rows x 4 columns for the same 5
    assert m["prefill_now"] == pytest.approx(8 / 5)


def test_the_long_tailed_shape_stays_in_its_ranges():
    prompts, responses = padding.long_tailed()
    assert len(prompts) == len(responses) == 320
    assert all(100 <= p <= 300 for p in prompts)
    assert all(20 <= r <= 1024 for r in responses)
    assert prompts[:5] == [prompts[0]] * 5  # a group of five shares its prompt
    # the long tail is there
    assert max(responses) > 900
    assert min(responses) < 30


def test_a_quick_run_prints_a_row_per_setting(tmp_path):
    out = tmp_path / "padding.md"
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "padding.py"),
            "--scripts",
            "grpo.py",
            "--rollouts=1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| `grpo.py`") or "GSM8K" in line]
    assert len(rows) == 2
    # GRPO's default: 32 prompts x 8, so its prefill computes each prompt's tokens at least 8 times
    assert float(rows[0].split("|")[10]) >= 8
    assert float(rows[0].split("|")[11]) == pytest.approx(float(rows[0].split("|")[10]) / 8, abs=0.01)  # now: once
