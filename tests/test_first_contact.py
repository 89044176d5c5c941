"""What a new user meets first: equal groups, low temperatures, torchrun with the defaults, their own reward function,
and inputs that must end in one sentence before any model loads, leaving nothing behind."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import ENV, ROOT, readme_files, run_script, tiny_run, torchrun

import grpo
import ppo
import rloo

MODULES = {"ppo.py": ppo, "grpo.py": grpo, "rloo.py": rloo}


def without_time(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


# ---------------------------------------------------------------- groups whose scores are all equal


def group_reference(scores, G, mode):
    """GRPO's advantage in float64 by a plain loop: (r - mean) / (std + eps), std over the group or the batch."""
    x = [float(v) for v in scores]
    out = []
    batch_mean = sum(x) / len(x)
    batch_std = (sum((v - batch_mean) ** 2 for v in x) / len(x)) ** 0.5
    for g in range(0, len(x), G):
        group = x[g : g + G]
        mean = sum(group) / G
        std = (sum((v - mean) ** 2 for v in group) / G) ** 0.5
        scale = {"group": std + 1e-8, "batch": batch_std + 1e-8, "none": 1.0}[mode]
        out += [(v - mean) / scale for v in group]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["group", "batch", "none"])
@pytest.mark.parametrize("value", [0.1, 0.3, 1.3, 13.02])
def test_an_all_equal_group_has_advantage_zero_in_every_mode_and_dtype(value, mode, dtype):
    # one group of the value, one group with spread, one more equal group: the reference is exactly 0 on the equal ones
    scores = torch.tensor([value] * 8 + [0.0, 1.0, 0.5, 0.25, 1.0, 0.0, 0.75, 0.5] + [1.0] * 8, dtype=dtype)
    got = grpo.group_advantages(scores, 8, mode)
    expected = group_reference(scores, 8, mode)
    assert (got[:8] == 0).all(), got
    assert (got[16:] == 0).all(), got
    assert torch.allclose(got.double(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
    one_group = grpo.group_advantages(torch.tensor([value] * 8, dtype=dtype), 8, mode)
    assert (one_group == 0).all()
    loo = rloo.rloo_advantages(scores, 8)
    assert (loo[:8] == 0).all()
    assert (loo[16:] == 0).all()


# ---------------------------------------------------------------- padded positions never reach a sum


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_ignore_pads_of_any_log_prob(estimator):
    logprobs = torch.tensor([[-0.5, -1.2, -1e4, -1e4], [-2.0, -1e4, -1e4, -1e4]], requires_grad=True)
    logprobs_ref = torch.tensor([[-0.7, -1.0, 0.0, 0.0], [-1.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    kl = grpo.kl_penalty(logprobs, logprobs_ref, estimator, mask)
    total = (kl * mask).sum()
    total.backward()
    expected = 0.0  # the valid tokens alone, by hand
    for lp, ref in ((-0.5, -0.7), (-1.2, -1.0), (-2.0, -1.5)):
        log_r = ref - lp
        expected += {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": torch.tensor(log_r).expm1().item() - log_r}[estimator]
    assert torch.isfinite(total)
    assert total.item() == pytest.approx(expected, rel=1e-6)
    assert torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[mask == 0] == 0).all()


def test_response_logprobs_are_zero_past_the_end_at_a_low_temperature():
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft")).eval()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 0, 0], [5, 6, 7, 10, 11, 12, 13]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        logprobs, entropy = ppo.response_logprobs(policy, input_ids, attention_mask, 3, 0.1, return_entropy=True)
        # the same rows one at a time, unpadded: the reference for the valid positions
        alone = ppo.response_logprobs(policy, input_ids[:1, :5], attention_mask[:1, :5], 3, 0.1)
    assert (logprobs[0, 2:] == 0).all()
    assert (entropy[0, 2:] == 0).all()
    assert torch.allclose(logprobs[0, :2], alone[0], atol=1e-5)
    assert torch.isfinite(logprobs).all()


@pytest.mark.parametrize("temperature", ["0.25", "0.1"])
@pytest.mark.parametrize("script,flags", [("grpo.py", []), ("rloo.py", ["--kl_in_loss"])])
def test_the_kl_in_the_loss_stays_finite_at_low_temperatures(script, flags, temperature, tmp_path):
    rows, _ = run_script(
        script, tmp_path, *tiny_run(script, total_episodes=80, temperature=temperature, eval_every=0), *flags
    )
    assert len(rows) == 10  # 80 episodes of 8 responses an iteration (tiny_run)
    assert rows[-1]["health/skipped_steps"] == 0
    assert all(r["policy/kl_term"] >= 0 and r["policy/kl_term"] < float("inf") for r in rows)


# ---------------------------------------------------------------- torchrun with the defaults


@pytest.mark.parametrize("script", list(MODULES))
def test_the_defaults_run_under_torchrun_on_two_processes(script, tmp_path):
    per_rollout = {"ppo.py": 64, "grpo.py": 256, "rloo.py": 64}[script]
    done = torchrun(script, tmp_path, f"--total_episodes={per_rollout}", "--eval_every=0")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["iteration"] for r in rows] == [1]
    # the default --micro_batch_size, above the per-process minibatch, is one micro-batch: kept as given, not rewritten
    assert json.load(open(tmp_path / "args.json"))["micro_batch_size"] == MODULES[script].Args().micro_batch_size


@pytest.mark.parametrize("processes", [1, 2, 4, 8])
@pytest.mark.parametrize("script", list(MODULES))
def test_the_defaults_pass_the_checks_on_1_to_8_processes(script, processes, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # a process other than rank 0 says nothing
    args = MODULES[script].Args(output_dir=str(tmp_path / "run"), world_size=processes)
    MODULES[script].validate(args)  # a micro-batch past the per-process minibatch is one micro-batch
    assert args.micro_batch_size == MODULES[script].Args.micro_batch_size  # as given: never rewritten


def test_a_stopping_message_under_torchrun_is_printed_once_on_its_own_line(tmp_path):
    done = torchrun("ppo.py", tmp_path / "run", "--temperature=0")
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "--temperature must be positive" in line]
    assert lines == ["--temperature must be positive (got 0.0)."]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- the user's own reward function

SAME_AS_ARITHMETIC = """
def exact(responses, answers):
    return [float(r.strip() == str(a).strip()) for r, a in zip(responses, answers)]
"""


def test_a_reward_function_from_a_file_trains_like_the_built_in_one(tmp_path):
    (tmp_path / "my_rule.py").write_text(SAME_AS_ARITHMETIC)
    held_out = tmp_path / "test.jsonl"
    held_out.write_text("".join(open(os.path.join(ROOT, "assets", "arithmetic", "test.jsonl")).readlines()[:12]))
    common = tiny_run("grpo.py", total_episodes=24, eval_every=2, eval_dataset=held_out)  # three iterations
    builtin, printed = run_script("grpo.py", tmp_path / "builtin", *common, "--reward_fn", "arithmetic")
    mine, _ = run_script("grpo.py", tmp_path / "mine", *common, "--reward_fn", f"{tmp_path / 'my_rule.py'}:exact")
    assert without_time(mine) == without_time(builtin)
    assert "objective/rule_reward" in mine[-1]
    assert "eval/score" in mine[-1]
    # transformers' own loading and saving bars are off; the run's lines are there
    assert "Loading weights" not in printed
    assert "Writing model shards" not in printed
    assert "iter 3/3" in printed


def test_a_reward_function_by_module_name(tmp_path, monkeypatch):
    (tmp_path / "rules_pkg").mkdir()
    (tmp_path / "rules_pkg" / "__init__.py").write_text("")
    (tmp_path / "rules_pkg" / "arith.py").write_text(SAME_AS_ARITHMETIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = grpo.load_reward_fn("rules_pkg.arith:exact", 10)
    assert grpo.call_reward_fn(fn, ["12", " 7 ", "x"], ["12", "8", "x"], 10) == ([1.0, 0.0, 1.0], None)


def test_the_readme_reward_example_runs_and_scores_by_hand(tmp_path):
    path = readme_files(tmp_path)["my_reward.py"]
    readme = open(os.path.join(ROOT, "README.md")).read()
    command = re.search(
        r"^python grpo\.py --reward_fn my_reward\.py:correct my_reward\.py:bare_number .*$", readme, re.M
    ).group(0)
    correct = grpo.load_reward_fn(f"{path}:correct", 10)
    bare_number = grpo.load_reward_fn(f"{path}:bare_number", 10)
    # by hand: correct and well formed, well formed but wrong, neither
    assert grpo.call_reward_fn(correct, ["12", "13", "twelve"], ["12", "12", "12"], 10) == ([1.0, 0.0, 0.0], None)
    assert grpo.call_reward_fn(bare_number, ["12", "13", "twelve"], ["12"] * 3, 10) == ([1.0, 1.0, 0.0], None)
    argv = [a.replace("my_reward.py:", f"{path}:") for a in command.split()[2:]]
    rows, _ = run_script(
        "grpo.py",
        tmp_path / "run",
        *argv[: argv.index("--output_dir")],
        *tiny_run("grpo.py", total_episodes=16, eval_every=0),
    )
    for r in rows:  # the score is the right answers' rate plus 0.1 times the well-formed rate
        assert r["objective/score"] == pytest.approx(r["reward/correct"] + 0.1 * r["reward/bare_number"], abs=1e-6)
    assert any(r["reward/bare_number"] > 0 for r in rows)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("no_such_file.py:reward", "'no_such_file.py' could not be loaded \\(FileNotFoundError"),
        ("{tmp}/rule.py:missing", "has no function 'missing'"),
        ("{tmp}/rule.py:one_argument", r"cannot be called as one_argument\(responses, answers\)"),
        ("{tmp}/broken.py:reward", "could not be loaded \\(ZeroDivisionError"),
        ("no_such_module_here:reward", "could not be loaded \\(ModuleNotFoundError"),
        ("nope", "unknown --reward_fn 'nope'"),
    ],
)
def test_a_bad_reward_function_stops_before_any_model_loads(spec, message, tmp_path):
    (tmp_path / "rule.py").write_text("def one_argument(responses):\n    return [0.0] * len(responses)\n")
    (tmp_path / "broken.py").write_text("1 / 0\n")
    args = grpo.Args(reward_fn=(spec.format(tmp=tmp_path),), output_dir=str(tmp_path / "run"))
    grpo.validate(args)  # the arguments are well formed; starting the function is main's next set-up step
    with pytest.raises(SystemExit, match=message):
        grpo.load_reward_fns(args)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- inputs that must end in one sentence


def test_bad_datasets_name_the_row_and_leave_nothing_behind(tmp_path):
    cases = {
        "latin1.jsonl": (b'{"prompt": "fine"}\n{"prompt": "caf\xe9 was"}\n', "line 2 of .* is not UTF-8 text"),
        "blank.jsonl": (b'{"prompt": "fine"}\n{"prompt": "   \\t "}\n', "row 2 of .* has an empty prompt"),
        "empty.jsonl": (b'{"prompt": "fine"}\n{"prompt": ""}\n', "row 2 of .* has an empty prompt"),
        "long.jsonl": (
            b'{"prompt": "the"}\n' + b'{"prompt": "' + b"the movie was good " * 40 + b'"}\n',
            "1 prompts of .* are longer than --max_prompt_length 64 \\(the first is row 2",
        ),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        out = tmp_path / f"run_{name}"
        args = ppo.Args(dataset=str(tmp_path / name), output_dir=str(out), eval_every=0)
        ppo.validate(args)
        with pytest.raises(SystemExit, match=message):
            ppo.load_task(args, torch.device("cpu"))
        assert not out.exists(), f"{name}: the output folder was left behind"


def test_model_paths_are_blamed_on_the_right_flag(tmp_path):
    with pytest.raises(SystemExit, match="--reward_model_path '/missing' could not be found"):
        ppo.validate(ppo.Args(reward_model_path=("/missing",), output_dir=str(tmp_path / "run")))
    tiny = os.path.join(ROOT, "assets", "tiny-sft")
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes(open(os.path.join(tiny, name), "rb").read())
    with pytest.raises(SystemExit, match="has no tokenizer"):
        ppo.validate(ppo.Args(model_name_or_path=str(no_tokenizer), output_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


def test_computed_fields_are_not_options_and_trls_num_iterations_is_named(tmp_path):
    """--num_iterations is computed from --total_episodes (and --world_size from torchrun); a TRL user's
    --num_iterations, TRL's passes over each rollout, is refused naming --num_epochs instead of being ignored."""
    for given in (["--num_iterations", "4"], ["--num_iterations=4"]):
        done = subprocess.run(
            [sys.executable, "grpo.py", "--output_dir", str(tmp_path / "run"), *given],
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 1
        assert "--num_iterations (TRL's passes over each rollout) is --num_epochs here" in done.stderr
        assert not (tmp_path / "run").exists()
    shown = subprocess.run([sys.executable, "grpo.py", "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert "--total_episodes" in shown.stdout
    assert "--num_iterations" not in shown.stdout and "--world_size" not in shown.stdout
