"""bench/gpu_check.sh and gpu_check.py, on a machine without a GPU: the shell script parses, every command line its
rows would run parses as the script it calls, the GSM8K row has the shapes of the recipe in docs/recipes.md, the wheels
it carries are the lock's versions, and its fastest rows run on the CPU and write the report."""

import os
import re
import shlex
import subprocess
import sys

import pytest
import tyro
from helpers import ROOT
from packaging.requirements import Requirement

import grpo
import ppo
import rloo

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_generate  # noqa: E402
import gpu_check  # noqa: E402

MODULES = {"ppo.py": ppo, "grpo.py": grpo, "rloo.py": rloo}


def parse(script, args):
    return tyro.cli(MODULES[script].Args, args=args, use_underscores=True)


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
