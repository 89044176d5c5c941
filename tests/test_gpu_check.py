"""bench/gpu_check.sh and gpu_check.py, on a machine without a GPU: the shell script parses, every command line its
rows would run parses as the script it calls, the GSM8K row has the shapes of the recipe in docs/recipes.md, the wheels
it carries are the lock's versions, its fastest rows run on the CPU and write the report, the caps fit the budget, a
row cut by its cap is not a failure, the commit is found without git, and a check killed mid-row leaves its report."""

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

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
