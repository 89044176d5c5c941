"""The bench scripts: their arithmetic against hand computations, their layouts computing what the scripts compute,
and smoke runs (tiny sizes, not timed):
- bench/compare_algorithms.py and bench/memory_accounting.py;
- bench/bench_generate.py: its methods do the same work on the tiny model;
- bench/padding.py: its counts by hand, its long-tailed shape;
- bench/real_tokens.py: the positions each layout computes, and its packed and fused-head layouts computing the
  log-probs of the padded one (the bench times them only because they do);
- bench/bench_trl.py and bench/trl_runner.py: both sides get the same settings, the timing arithmetic by hand; the run
  against TRL itself needs the peer environments and is skipped where they are missing (CI installs only
  requirements.lock);
- bench/gpu_check.sh and gpu_check.py, on a machine without a GPU: the shell script parses, every command line its
  rows would run parses as the script it calls, the GSM8K row has the shapes of the recipe in docs/recipes.md, the
  wheels it carries are the lock's versions, its fastest rows run on the CPU and write the report, the caps fit the
  budget, a row cut by its cap is not a failure, the commit is found without git, and a check killed mid-row leaves
  its report."""

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import tyro
from helpers import MODULES, ROOT, finished, tiny_llama_config
from packaging.requirements import Requirement
from transformers import LlamaForCausalLM

from rlhf_runtime.settings import flat_options

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_generate  # noqa: E402
import bench_trl  # noqa: E402
import compare_algorithms  # noqa: E402
import gpu_check  # noqa: E402
import padding  # noqa: E402
import real_tokens  # noqa: E402
import trl_runner  # noqa: E402  (importable without trl: trl is imported inside main)

# ---------------------------------------------------------------- compare_algorithms.py and memory_accounting.py


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
    result = finished(
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
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
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
    result = finished(
        [sys.executable, os.path.join(ROOT, "bench", "memory_accounting.py"), "--small", "--out", str(out)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
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


# ---------------------------------------------------------------- bench/bench_generate.py


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
    result = finished(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|") for line in out.read_text().splitlines() if line.startswith("| tiny |")]
    assert [row[4].strip() for row in rows] == ["scripts", "static", "hf-generate", "no-cache"]  # no CUDA graph here
    assert rows[1][9].strip() == "yes, yes"  # the static loop made the scripts' tokens, sampled and greedy


@pytest.fixture(scope="module")
def tiny():
    model, pad = bench_generate.load_model("tiny", torch.float32, torch.device("cpu"))
    ids, mask = bench_generate.make_prompts(6, 10, model.config.vocab_size, pad, "cpu")
    # left padding of varied lengths
    assert (mask == 0).any()
    assert mask[:, -1].all()
    return model, pad, ids, mask


def _run(tiny, name, temperature, greedy):
    model, pad, ids, mask = tiny
    torch.manual_seed(0)
    sampling = bench_generate.ppo.Sampling(12, temperature, bench_generate.NEVER, pad)
    return bench_generate.METHODS[name](model, ids, mask, sampling, greedy=greedy)[0]


def test_greedy_tokens_agree_across_methods(tiny):
    reference = _run(tiny, "scripts", 1.0, greedy=True)
    assert reference.shape == (6, 12)
    for name in ("static", "hf-generate", "no-cache"):
        assert torch.equal(_run(tiny, name, 1.0, greedy=True), reference), name


# ---------------------------------------------------------------- bench/padding.py


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
    result = finished(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "padding.py"),
            "--scripts",
            "grpo.py",
            "--rollouts=1",
            "--out",
            str(out),
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| `grpo.py`") or "GSM8K" in line]
    assert len(rows) == 2
    # GRPO's default: 32 prompts x 8, so its prefill computes each prompt's tokens at least 8 times
    assert float(rows[0].split("|")[10]) >= 8
    assert float(rows[0].split("|")[11]) == pytest.approx(float(rows[0].split("|")[10]) / 8, abs=0.01)  # now: once


# ---------------------------------------------------------------- bench/real_tokens.py


# 8 + 8 = 16 real tokens in rows 3 + 3 wide
PROMPTS = [2, 3, 1, 2]


RESPONSES = [1, 3, 2, 2]


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(pad_token_id=1, eos_token_id=2)).eval()


def test_the_positions_of_each_layout_by_hand(policy):
    input_ids, attention_mask, P = real_tokens.rows_of(PROMPTS, RESPONSES, 40)
    assert P == 3
    assert attention_mask.sum(1).tolist() == [3, 6, 3, 4]
    # one micro-batch of all four rows: padded and cut alike are 4 x 6 wide; packed computes the 16 real tokens
    rollout = real_tokens.Rollout(input_ids, attention_mask, P, minibatch=4, micro=4)
    counts = {x: real_tokens.epoch(x, policy, rollout) for x in real_tokens.LAYOUTS}
    assert counts == {
        "padded, full head": 24,
        "padded": 24,
        "sorted and cut": 24,
        "sorted and cut, fused head": 24,
        "packed": 16,
    }
    # micro-batches of one row: a cut row is its own tokens alone, 16 in all
    rollout = real_tokens.Rollout(input_ids, attention_mask, P, minibatch=4, micro=1)
    counts = {x: real_tokens.epoch(x, policy, rollout) for x in real_tokens.LAYOUTS}
    assert counts == {
        "padded, full head": 24,
        "padded": 24,
        "sorted and cut": 16,
        "sorted and cut, fused head": 16,
        "packed": 16,
    }
    # sorted, micro-batches of two: rows of 3, 3 tokens (0, 2: prompts 2 and 1, responses 1 and 2: 2 + 2 wide) and
    # 4, 6 (3, 1: prompts 2 and 3, responses 2 and 3: 3 + 3 wide): 2 x 4 + 2 x 6 = 20
    rollout = real_tokens.Rollout(input_ids, attention_mask, P, minibatch=4, micro=2)
    assert real_tokens.epoch("sorted and cut", policy, rollout) == 20


def test_packed_and_fused_log_probs_equal_the_padded_ones(policy):
    input_ids, attention_mask, P = real_tokens.rows_of(PROMPTS, RESPONSES, 40, seed=3)
    with torch.no_grad():
        padded = real_tokens.full_head_logprobs(policy, input_ids, attention_mask, P)
        for other in (real_tokens.packed_logprobs, real_tokens.fused_head_logprobs):
            got = other(policy, input_ids, attention_mask, P)
            assert (got[attention_mask[:, P:] == 0] == 0).all()
            torch.testing.assert_close(got, padded, atol=1e-5, rtol=1e-5)


def test_the_prefill_parts_before_side_encodes_every_row(policy):
    """The part's "every row" side stands for generate before the sharing: with the grouping replaced, the prefill
    runs on all 6 rows of 2 groups of 3 (not 2), and both sides sample the same tokens with the same log-probs."""
    from unittest import mock

    prompt_ids, prompt_mask = real_tokens.runtime.left_pad([[5, 6, 7]] * 3 + [[8, 9]] * 3, 1, "cpu")
    uniforms = torch.rand(6, 4, generator=torch.Generator().manual_seed(0))
    sampling = real_tokens.ppo.Sampling(4, 1.0, torch.tensor([0]), 1)
    batches = []

    def record_batch(module, args, kwargs):
        batches.append(kwargs["input_ids"].shape[0])

    hook = policy.register_forward_pre_hook(record_batch, with_kwargs=True)
    with mock.patch.object(torch, "unique_consecutive", real_tokens.every_row_alone):
        before = real_tokens.ppo.generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
    first = batches[0]
    batches.clear()
    now = real_tokens.ppo.generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
    hook.remove()
    assert (first, batches[0]) == (6, 2)
    assert torch.equal(before[0], now[0])
    torch.testing.assert_close(before[1], now[1], atol=1e-6, rtol=0)


# ---------------------------------------------------------------- bench/bench_trl.py and bench/trl_runner.py


def options(args):
    """A parsed Args's options by their command-line names, the script's and the run's (Args.run) together."""
    return SimpleNamespace(**flat_options(args))


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
    ours = options(tyro.cli(script.Args, args=cmds["ours"][2:], use_underscores=True))  # as the script parses it
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
        assert (c["adam_epsilon"], c["weight_decay"], c["temperature"]) == (1e-5, 0.0, 1.0)
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
    result = finished(
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
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {
        line.split("|")[2].strip(): [x.strip() for x in line.split("|")[1:-1]]
        for line in out.read_text().splitlines()
        if line.startswith("| embedded |")
    }


def test_smoke_run_of_our_side(tmp_path):
    """One algorithm's row, ppo.py's (the most steps an iteration): each algorithm's command and step count are the
    tests above, by hand."""
    rows = run_bench(tmp_path, "--sides=ours", "--algorithms=ppo")
    assert sorted(rows) == ["ppo"]
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
    not os.path.exists(bench_trl.peer_python("grpo")),
    reason="needs the peer environment with trl==1.16.0 (see bench/bench_trl.py)",
)
def test_smoke_run_against_trl(tmp_path):
    rows = run_bench(tmp_path, "--algorithms=grpo")
    # a ratio ours / TRL
    assert rows["grpo"][5].startswith("**")
    assert rows["grpo"][5].endswith("x**")
    assert rows["grpo"][10] == "4, 4"  # both sides took 4 optimiser steps per iteration


def test_a_missing_trl_environment_stops_in_one_sentence_before_any_run(tmp_path):
    command = [sys.executable, os.path.join(ROOT, "bench", "bench_trl.py"), "--quick", "--algorithms=ppo"]
    result = finished(
        [*command, "--runs", str(tmp_path / "runs")], env={**os.environ, "RLHF_BENCH_VENVS": str(tmp_path / "envs")}
    )
    python = tmp_path / "envs" / "venv-trl112" / "bin" / "python"
    assert result.returncode == 1
    assert result.stderr.startswith(f"{python} does not exist: make the TRL environments")
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()
    # the folder is the user's: --peer_venvs (or RLHF_BENCH_VENVS) names it, the commands are written from it
    assert bench_trl.commands("grpo", "p", "r", 5, 24, "/tmp/x", "envs")["trl"][0] == "envs/venv-trl116/bin/python"


# ---------------------------------------------------------------- bench/gpu_check.sh and bench/gpu_check.py


def parse(script, args):
    return options(tyro.cli(MODULES[script].Args, args=args, use_underscores=True))


def test_the_shell_script_parses():
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, "bench", "gpu_check.sh")]).returncode == 0


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_row_parses(device):
    s = gpu_check.sizes(device)
    for key in ("generation", "recipe_mem"):
        bench_generate.parse_args(s[key])  # exits on an unknown option or method
    for decode in (s["old"], s["new"]):
        ppo_args = parse("ppo.py", [*gpu_check.ppo_args(s, "policy", "rm"), "--decode", decode])
        assert (ppo_args.rollout_batch_size, ppo_args.response_length) == ((64, 128) if device == "cuda" else (4, 8))
        parse("grpo.py", [*gpu_check.grpo_args(s, "policy"), "--decode", decode])
    for script in MODULES:
        args = parse(script, gpu_check.torchrun_args(script))
        # three iterations
        assert args.mixed_precision
        assert args.save_every == 1
        assert args.total_episodes == 3 * args.rollout_batch_size * (1 if script == "ppo.py" else args.num_generations)


def test_the_gsm8k_row_has_the_readme_recipe_shapes():
    recipes = open(os.path.join(ROOT, "docs", "recipes.md")).read()  # the hub recipes, linked from the README
    recipe = re.search(
        r"python grpo\.py --model_name_or_path Qwen/Qwen2\.5-0\.5B-Instruct (--mixed_precision.*?)```", recipes, re.S
    )
    words = shlex.split(recipe.group(1).replace("\\\n", " "))
    expected = parse(
        "grpo.py",
        [
            w
            for w in words
            if not w.startswith("openai/") and w not in ("--dataset", "--eval_dataset", "--dataset_config", "main")
        ],
    )
    got = parse("grpo.py", gpu_check.grpo_args(gpu_check.sizes("cuda"), "policy"))
    for field in (
        "num_generations",
        "rollout_batch_size",
        "minibatch_size",
        "micro_batch_size",
        "num_epochs",
        "learning_rate",
        "lora_r",
        "lora_alpha",
        "kl_coef",
        "ent_coef",
        "response_length",
        "max_prompt_length",
        "mixed_precision",
    ):
        assert getattr(got, field) == getattr(expected, field), field


def test_the_wheels_are_the_locks_versions():
    def requirements(path):
        lines = [line.strip() for line in open(os.path.join(ROOT, path))]
        return [Requirement(line) for line in lines if line and not line.startswith("#")]

    lock = {r.name.lower().replace("_", "-"): r.specifier for r in requirements("requirements.lock")}
    wheels = requirements("bench/gpu_check_wheels.txt")
    names = [w.name.lower().replace("_", "-") for w in wheels]
    assert len(set(names)) == len(names)
    assert {"transformers", "tyro", "peft"} <= set(names)
    for wheel, name in zip(wheels, names):
        assert str(wheel.specifier).startswith("=="), name
        assert name in lock, name
        assert wheel.specifier == lock[name], name


def test_the_fast_rows_run_on_the_cpu(tmp_path):
    out = tmp_path / "report.md"
    assert gpu_check.main(["--device=cpu", "--rows=kernels,generation", "--out", str(out)]) == 0
    report = out.read_text()
    assert "| kernels | pass |" in report
    assert "| generation | pass |" in report
    # the static loop made the same tokens
    assert "| tiny | 8 | 8 | static |" in report
    assert "yes, yes" in report


def test_the_real_tokens_row_runs_on_the_cpu(tmp_path):
    """The layouts at the recipe's lengths scaled down: every layout timed, packing computing the real tokens alone."""
    out = tmp_path / "report.md"
    assert gpu_check.main(["--device=cpu", "--rows=real-tokens", "--out", str(out)]) == 0
    report = out.read_text()
    assert "| real-tokens | pass |" in report
    assert "| GSM8K-like, 2 prompts x 5 (" in report
    row = next(line for line in report.splitlines() if line.startswith("| GSM8K-like"))
    assert row.split(" | ")[5].startswith("1.00, ")  # packed: one position per real token


def test_the_prefill_row_runs_on_the_cpu(tmp_path):
    """generate at the recipe's lengths scaled down, each group's prompt encoded once against every row's: 10 rows
    in groups of 5 prefill 5 times fewer prompt positions, and sample the same tokens."""
    out = tmp_path / "report.md"
    assert gpu_check.main(["--device=cpu", "--rows=prefill", "--out", str(out)]) == 0
    report = out.read_text()
    assert "| prefill | pass |" in report
    row = next(line for line in report.splitlines() if line.startswith("| GSM8K-like, 2 prompts x 5 ("))
    every, once = map(int, row.split(" | ")[1].split(" / "))
    assert every == 5 * once
    assert row.endswith("| yes |")


def test_the_targets_are_read_off_the_tables(tmp_path):
    """On a made-up CUDA table: the new loop's speed-ups against the issue's 10x / 5x / 10x, the eager path's tokens,
    and a PPO iteration's time against 0.6x of the old one's."""
    header = (
        "| model | batch | new tokens | method | median s | tokens/s | vs scripts | vs hf-generate | "
        "same tokens (sampled, greedy) | max abs logp diff | same as static, op by op | its max abs logp diff |"
    )
    rows = [
        ("qwen0.5b-shape", 256, "12.50x", "yes, yes"),
        ("qwen0.5b-shape", 64, "4.90x", "yes, yes"),
        ("tiny", 256, "30.00x", "yes, no"),
    ]
    lines = [header, "|---|" * 12]
    for model, batch, speedup, eager in rows:
        lines.append(
            f"| {model} | {batch} | 128 | cuda-graph | 1.0 | 1 | {speedup} | 1.00x | no, yes | 1.0e-02 | {eager} | 0 |"
        )
    table = tmp_path / "generation.md"
    table.write_text("\n".join(lines))
    ctx = {"device": "cuda", "generation": gpu_check.bench_table(table), "ppo.py": 0.55}
    met = [m for _, _, m in gpu_check.targets(ctx)]
    assert met == [True, False, True, False, None, True]  # 4.9x < 5x; one greedy token off the eager path
    assert gpu_check.targets({**ctx, "device": "cpu"}) == []  # a dry run has no targets


def test_the_caps_of_one_call_fit_its_budget_and_the_times_table_has_them():
    """The default call's rows (all but torchrun, a call of its own) have caps that add up to the budget less a
    margin of 50 s, and torchrun's fits a call too; bench/gpu_check_times.md gives every row the cap ROWS gives it,
    and the caps and expected times of the one call add up to its total line."""
    caps = {name: cap for name, _, cap in gpu_check.ROWS}
    assert gpu_check.ONE_CALL == [name for name in caps if name != "torchrun"]
    assert sum(caps[name] for name in gpu_check.ONE_CALL) + gpu_check.MARGIN_S <= gpu_check.BUDGET_S
    assert gpu_check.MARGIN_S >= 30
    assert caps["torchrun"] + gpu_check.MARGIN_S <= gpu_check.BUDGET_S
    table = open(os.path.join(ROOT, "bench", "gpu_check_times.md")).read()
    rows = {}
    for line in table.splitlines():
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        if line.startswith("|") and len(cells) == 5 and cells[2].isdigit():
            rows[cells[0].split(" (")[0]] = (int(cells[2]), int(cells[3]))
    assert {name: cap for name, (_, cap) in rows.items() if name in caps} == caps
    assert rows["one call"][1] == sum(caps[name] for name in gpu_check.ONE_CALL)
    assert rows["one call"][0] == sum(rows[name][0] for name in gpu_check.ONE_CALL)
    assert all(expected < cap for expected, cap in rows.values())


def test_a_row_cut_by_its_cap_is_not_finished_and_not_a_failure(tmp_path):
    """The kernels row given 1 s (its pytest needs more to start): the report says "not finished in 1 s" in the row's
    section and in the summary, no FAIL, and the check exits 0."""
    out = tmp_path / "report.md"
    assert gpu_check.main(["--device=cpu", "--rows=kernels", "--caps=kernels=1", f"--out={out}"]) == 0
    report = out.read_text()
    assert "**not finished in 1 s**" in report
    assert "| kernels | not finished in 1 s |" in report
    assert "FAIL" not in report


def test_the_commit_without_git_without_a_git_folder_and_stamped(tmp_path, monkeypatch):
    """No `git` on PATH, a tree without .git, the stamp bench/gpu_check.commit that gpu_check.sh --stamp writes in
    the caller's tree, and $GPU_CHECK_COMMIT: a sentence or the commit, never an error."""
    monkeypatch.delenv("GPU_CHECK_COMMIT", raising=False)
    copied = tmp_path / "copied"  # a tree copied without .git
    (copied / "bench").mkdir(parents=True)
    if shutil.which("git"):
        assert gpu_check.commit_of(str(copied)).startswith(
            "unknown (no .git here; run `bash bench/gpu_check.sh --stamp`"
        )
        assert re.fullmatch(r"[0-9a-f]{7}(-dirty)?", gpu_check.commit_of(ROOT))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpu_check.commit_of(str(copied)).startswith("unknown (git could not run: FileNotFoundError;")
    (copied / "bench" / "gpu_check.commit").write_text("1234abc-dirty\n")
    assert gpu_check.commit_of(str(copied)) == "1234abc-dirty (from bench/gpu_check.commit)"
    monkeypatch.setenv("GPU_CHECK_COMMIT", "5678def")
    assert gpu_check.commit_of(str(copied)) == "5678def"


def start_check(out, env):
    """bench/gpu_check.py on the CPU, the kernels row then the generation row, in a process group of its own."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--device=cpu", "--rows=kernels,generation"]
    return subprocess.Popen(
        [*cmd, f"--out={out}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_for(path, text, proc):
    """Until the report holds text (the check still running), in at most 120 s."""
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(path) and text in open(path).read():
            return
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} in the report; the check printed:\n{proc.communicate()[0][-3000:]}")


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_a_check_killed_in_the_middle_leaves_a_readable_report(signal_name, tmp_path):
    """The check, with no `git` on PATH, killed while its second row runs: SIGKILL leaves the header (the versions,
    the commit unknown), the first row's result and the second row's start on disk; SIGTERM (what gpu_check.sh's
    timeout sends) also writes where it stopped and the summary, and exits 2."""
    out = tmp_path / "report.md"
    env = {**os.environ, "PATH": str(tmp_path), "TRITON_INTERPRET": "1"}
    env.pop("GPU_CHECK_COMMIT", None)
    proc = start_check(out, env)
    wait_for(out, "## generation", proc)
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:  # the row's child, in a process group of its own
        children = [int(pid) for pid in f.read().split()]
    proc.send_signal(getattr(signal, signal_name))
    code = proc.wait(timeout=60)
    for pid in children:  # SIGKILL leaves it running: end it here
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    report = out.read_text()
    assert "- commit: unknown (git could not run: FileNotFoundError;" in report
    assert re.search(r"- versions: Python [\d.]+, torch [^,]+, triton", report)
    kernels = report[report.index("## kernels") : report.index("## generation")]
    assert "**pass** (" in kernels
    generation = report[report.index("## generation") :]
    assert "started, " in generation
    if signal_name == "SIGKILL":
        assert code == -signal.SIGKILL
        assert "## summary" not in report
        assert "**" not in generation  # no result: the row the check was in
    else:
        assert code == 2
        assert "**stopped** by SIGTERM after " in generation
        assert "| kernels | pass |" in report
        assert "| generation | stopped by SIGTERM |" in report


def test_the_wheels_carry_accelerate_and_tokenizers():
    """The image's accelerate and tokenizers are older than the lock's: the wheels list carries both (at the lock's
    versions, as test_the_wheels_are_the_locks_versions checks), and the report names the versions it ran with."""
    lines = [line.strip() for line in open(os.path.join(ROOT, "bench", "gpu_check_wheels.txt"))]
    names = {Requirement(line).name.lower() for line in lines if line and not line.startswith("#")}
    assert {"accelerate", "tokenizers"} <= names
    assert {"accelerate", "tokenizers", "transformers", "torch", "triton", "peft"} <= set(gpu_check.PACKAGES)
