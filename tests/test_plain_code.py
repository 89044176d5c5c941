"""The code reads plainly: ruff lays out and lints every Python file (pyproject.toml), and the shapes that hide
behaviour stay out. An `assert` used as a check vanishes under `python -O`; a conditional expression, an `or` chain
or a comprehension used as a statement hides control flow or a side effect; a walrus or a long argument list packs
what reads better spread out. Each check is shown to fire on a packed sample, and a damaged checkpoint is refused
under `python -O` as without it."""

import ast
import json
import os
import subprocess
import sys

import pytest
from helpers import ENV, ROOT, run_script

import ppo

SCRIPTS = ("ppo.py", "grpo.py", "rloo.py", "dapo.py")
MAX_WALRUS = 2  # per file, where one reads best
MAX_ARGUMENTS = 7  # a function taking more groups them (a small dataclass)


def python_files():
    """Every tracked Python file of the project (the embedded assets hold none)."""
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    return [path for path in listed if os.path.exists(os.path.join(ROOT, path))]


def ruff(*args):
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_format_would_change_nothing():
    result = ruff("format", "--check", "--diff", ".")
    assert result.returncode == 0, "run `ruff format .`:\n" + (result.stdout + result.stderr)[-3000:]


def test_ruff_check_finds_nothing():
    result = ruff("check", ".")
    assert result.returncode == 0, "run `ruff check .`:\n" + (result.stdout + result.stderr)[-3000:]


def test_ruff_flags_a_packed_file(tmp_path):
    """The two tests above can fail: imports packed on one line, an unsorted import and a line past 120 columns."""
    packed = tmp_path / "packed.py"
    packed.write_text("import sys, os\n\nx = [" + ", ".join(["1"] * 60) + "]\n")
    config = os.path.join(ROOT, "pyproject.toml")
    assert ruff("check", "--config", config, "--no-cache", str(packed)).returncode == 1
    assert ruff("format", "--config", config, "--check", "--no-cache", str(packed)).returncode == 1


def packing(source):
    """What of the shapes this project keeps out a source holds: (what, line) pairs."""
    found = []
    walrus = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.NamedExpr):
            walrus.append(node.lineno)
        if isinstance(node, ast.Expr) and isinstance(node.value, (ast.IfExp, ast.BoolOp, ast.Tuple)):
            found.append(("an expression used as a statement for its control flow", node.lineno))
        comprehensions = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
        if isinstance(node, ast.Expr) and isinstance(node.value, comprehensions):
            found.append(("a comprehension used for its side effects", node.lineno))
        if isinstance(node, ast.Assign) and len(node.targets) > 1:
            found.append(("a chained assignment", node.lineno))
    if len(walrus) > MAX_WALRUS:
        found.append((f"{len(walrus)} walrus assignments", walrus[0]))
    return found


def script_findings(source):
    """What a script must not hold besides: an assert, a function of more than MAX_ARGUMENTS arguments."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert):
            found.append(("an assert, which python -O strips", node.lineno))
        if isinstance(node, ast.FunctionDef):
            arguments = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
            if len([a for a in arguments if a != "self"]) > MAX_ARGUMENTS:
                found.append((f"{node.name} takes {len(arguments)} arguments", node.lineno))
    return found


def test_the_checks_fire_on_packed_code():
    packed = """
def f(a, b, c, d, e, f, g, h):
    assert a, "a check"
    x = y = 1
    print(a) if b else print(c)
    a or print(b)
    print(a), print(b)
    [print(v) for v in c]
    if (p := 1) and (q := 2) and (r := 3):
        return p
"""
    assert sorted(what for what, _ in packing(packed)) == [
        "3 walrus assignments",
        "a chained assignment",
        "a comprehension used for its side effects",
        "an expression used as a statement for its control flow",
        "an expression used as a statement for its control flow",
        "an expression used as a statement for its control flow",
    ]
    assert sorted(what for what, _ in script_findings(packed)) == [
        "an assert, which python -O strips",
        "f takes 8 arguments",
    ]
    assert packing("x = 1 if y else 2\nz = [v for v in w]\n") == []  # a conditional value and a list are fine


@pytest.mark.parametrize("path", python_files())
def test_no_packed_code(path):
    found = packing(open(os.path.join(ROOT, path)).read())
    assert not found, f"{path}: " + ", ".join(f"{what} (line {line})" for what, line in found)


@pytest.mark.parametrize("path", SCRIPTS)
def test_scripts_hold_no_assert_and_no_long_argument_list(path):
    found = script_findings(open(os.path.join(ROOT, path)).read())
    assert not found, f"{path}: " + ", ".join(f"{what} (line {line})" for what, line in found)


# ---------------------------------------------------------------- behaviour the packed code hid


def test_a_reward_that_scores_every_response_gives_no_reason():
    assert ppo.call_reward_fn(lambda responses, answers: [1.0, 0.5], ["a", "b"], [1, 2], 10) == ([1.0, 0.5], None)
    scores, reason = ppo.call_reward_fn(lambda responses, answers: [1.0, float("nan")], ["a", "b"], [1, 2], 10)
    assert reason == "not a finite number"


def test_a_reward_that_raises_on_the_batch_alone_fails_every_response():
    def batch_only(responses, answers):
        if len(responses) > 1:
            raise ZeroDivisionError("division by zero")
        return [1.0]

    scores, reason = ppo.call_reward_fn(batch_only, ["a", "b"], [1, 2], 10)
    assert all(score != score for score in scores)  # nan: no score is taken from a grader that disagrees with itself
    assert reason.startswith("nan: the batch's call raised (ZeroDivisionError: division by zero) but no single")


GRPO_ONE_ITERATION = [
    "--total_episodes=8",
    "--rollout_batch_size=2",
    "--num_generations=4",
    "--minibatch_size=8",
    "--micro_batch_size=8",
    "--response_length=6",
    "--eval_every=0",
]


def test_a_checkpoint_damaged_in_place_is_refused_under_python_O(tmp_path):
    """Its check is plain code, not an assert (under -O an assert passes anything): a size that disagrees with the
    manifest's is refused there too."""
    stripped = subprocess.run([sys.executable, "-O", "-c", "assert False"], capture_output=True)
    assert stripped.returncode == 0  # -O does strip asserts here, so the check below would see one
    out = tmp_path / "run"
    run_script("grpo.py", out, *GRPO_ONE_ITERATION)
    checkpoint = out / "checkpoint-1"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["state.json"]["bytes"] += 1  # state.json is no longer of the size recorded
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=2))
    cmd = [sys.executable, "-O", "grpo.py", "--output_dir", str(out), *GRPO_ONE_ITERATION, "--resume", str(checkpoint)]
    result = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"'{checkpoint}' is not a whole checkpoint: state.json is not of the size it was saved with" in result.stderr
    assert "Traceback" not in result.stderr
