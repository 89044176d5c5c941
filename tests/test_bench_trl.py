"""bench/bench_trl.py and bench/trl_runner.py: both sides get the same settings, the timing arithmetic by hand, and a
smoke run of our side (tiny sizes, not timed). The run against TRL itself needs the peer environments and is skipped
where they are missing (CI installs only requirements.lock)."""

import json
import os
import subprocess
import sys

import pytest
import tyro
from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_trl  # noqa: E402
import trl_runner  # noqa: E402  (importable without trl: trl is imported inside main)

SHARED = (
    "model_name_or_path",
    "dataset",
    "total_episodes",
    "rollout_batch_size",
    "minibatch_size",
    "micro_batch_size",
    "num_epochs",
    "response_length",
    "learning_rate",
    "kl_coef",
    "missing_eos_penalty",
    "model_dtype",
    "seed",
    "reward_fn",
)


@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "rloo"])
def test_both_sides_parse_to_the_same_settings(algorithm, tmp_path):
    import importlib

    cmds = bench_trl.commands(algorithm, "assets/tiny-sft", "assets/tiny-rm", 5, 24, str(tmp_path))
    script = importlib.import_module(algorithm)
    ours = tyro.cli(script.Args, args=cmds["ours"][2:], use_underscores=True)  # exactly as the script parses it
    trl = trl_runner.arguments(cmds["trl"][2:])
    assert trl.algorithm == algorithm
    assert cmds["ours"][1].endswith(f"{algorithm}.py")
    for key in SHARED:
        assert getattr(ours, key) == getattr(trl, key), key
    assert list(ours.reward_model_path) == trl.reward_model_path
    assert getattr(ours, "num_generations", 1) == trl.num_generations
    assert ours.eval_every == 0
    assert ours.temperature == trl.temperature == 1.0
    c = bench_trl.ALGORITHMS[algorithm]
    assert (ours.rollout_batch_size, ours.minibatch_size, ours.num_epochs, ours.kl_coef) == (
        c["rollout_batch_size"],
        c["minibatch_size"],
        c["num_epochs"],
        c["kl_coef"],
    )
    assert ours.total_episodes == 5 * c["rollout_batch_size"] * c["num_generations"]


def test_trl_config_matches_the_batch_shape_by_hand():
    def config(algorithm):
        return trl_runner.trl_config(
            trl_runner.arguments(bench_trl.commands(algorithm, "p", "r", 5, 24, "/tmp/x")["trl"][2:])
        )

    ppo = config("ppo")
    grpo = config("grpo")
    rloo = config("rloo")
    for c in (ppo, grpo, rloo):  # fp32, no checkpointing, a constant learning rate and our AdamW's eps and decay
        assert (c["bf16"], c["fp16"], c["gradient_checkpointing"], c["lr_scheduler_type"]) == (
            False,
            False,
            False,
            "constant",
        )
        assert (c["adam_epsilon"], c["weight_decay"], c["temperature"]) == (1e-5, 0.01, 1.0)
    # PPO: 64 prompts = 16 per device x 4 accumulation; 4 minibatches of 16; 4 epochs; 0.5 x 0.2 = our vf_coef 0.1
    assert ppo["per_device_train_batch_size"] * ppo["gradient_accumulation_steps"] == 64
    assert ppo["num_mini_batches"] == 4
    assert (ppo["num_ppo_epochs"], ppo["response_length"], ppo["kl_coef"], ppo["kl_estimator"], ppo["vf_coef"]) == (
        4,
        24,
        0.1,
        "k1",
        0.2,
    )
    assert (ppo["total_episodes"], ppo["missing_eos_penalty"], ppo["stop_token"]) == (5 * 64, 1.0, "eos")
    # GRPO: 32 prompts x 8 = 256 completions per generation = 64 per step x 4 steps; 5 iterations = 20 steps
    assert grpo["per_device_train_batch_size"] * grpo["steps_per_generation"] == 256
    assert grpo["num_generations"] == 8
    assert (grpo["gradient_accumulation_steps"], grpo["num_iterations"], grpo["max_steps"], grpo["beta"]) == (
        1,
        1,
        20,
        0.04,
    )
    assert (grpo["max_completion_length"], grpo["loss_type"], grpo["scale_rewards"], grpo["top_k"]) == (
        24,
        "dapo",
        "group",
        0,
    )
    # RLOO: 16 prompts x 4 = 64 completions, one step per rollout
    assert rloo["per_device_train_batch_size"] * rloo["steps_per_generation"] == 64
    assert rloo["steps_per_generation"] == 1
    assert (rloo["max_steps"], rloo["beta"], rloo["normalize_advantages"]) == (5, 0.2, False)


def test_iteration_times_by_hand(tmp_path):
    ours = tmp_path / "ours.jsonl"
    trl = tmp_path / "trl.jsonl"
    ours.write_text(
        "".join(
            json.dumps({"iteration": i, "time/elapsed": t}) + "\n" for i, t in ((1, 2.0), (2, 3.5), (3, 5.0), (4, 7.0))
        )
    )
    trl.write_text(
        "".join(
            json.dumps({"iteration": i, "time/iteration": t, "optimizer_steps": 16}) + "\n"
            for i, t in ((1, 9.0), (2, 1.0), (3, 2.0))
        )
    )
    assert bench_trl.iteration_times("ours", ours) == [1.5, 1.5, 2.0]  # the first iteration (warm-up) left out
    assert bench_trl.iteration_times("trl", trl) == [1.0, 2.0]
    assert bench_trl.steps_per_iteration("trl", "ppo", trl) == 16
    assert bench_trl.steps_per_iteration("ours", "ppo", ours) == 16
    assert bench_trl.steps_per_iteration("ours", "grpo", ours) == 4


def run_bench(tmp_path, *args):
    out = tmp_path / "trl.md"
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "bench_trl.py"),
            "--quick",
            "--runs",
            str(tmp_path / "runs"),
            "--out",
            str(out),
            *args,
        ],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {
        line.split("|")[2].strip(): [x.strip() for x in line.split("|")[1:-1]]
        for line in out.read_text().splitlines()
        if line.startswith("| embedded |")
    }


def test_smoke_run_of_our_side(tmp_path):
    rows = run_bench(tmp_path, "--sides=ours")
    assert sorted(rows) == ["grpo", "ppo", "rloo"]
    for algorithm, row in rows.items():
        # ours timed, no TRL side
        assert float(row[3]) > 0
        assert row[4] == "n/a"
        assert row[5] == "**n/a**"
        assert float(row[7].replace(",", "")) > 100  # a Python process with torch: more than 100 MB
        assert row[10] == f"{bench_trl.steps_per_iteration('ours', algorithm, None)}, n/a"
        log = tmp_path / "runs" / "embedded" / algorithm / "ours" / "metrics.jsonl"
        assert len(bench_trl.iteration_times("ours", log)) == 2  # 3 iterations, the first not timed


@pytest.mark.skipif(
    not os.path.exists("/work/venv-trl116/bin/python"),
    reason="needs the peer environment with trl==1.16.0 (see bench/bench_trl.py)",
)
def test_smoke_run_against_trl(tmp_path):
    rows = run_bench(tmp_path, "--algorithms=grpo")
    # a ratio ours / TRL
    assert rows["grpo"][5].startswith("**")
    assert rows["grpo"][5].endswith("x**")
    assert rows["grpo"][10] == "4, 4"  # both sides took 4 optimiser steps per iteration
