"""Reward functions (rlhf_runtime/rewards.py and reward_process.py, the same code for every script: tested once, its
runs through grpo.py): the built-in rules by hand; the user's own, from a file or a module, alone or several weighted,
against the built-in rule or one function returning their sum; a failure, a non-finite score, a wrong return named on
its response; and reward code run where it can always be stopped: each --reward_fn of the user's own runs in a process
of its own, a fresh interpreter in a process group that a timeout or a stop signal kills whole. Each case is a grader
as people write them (a shell command, a subprocess, a thread pool, a process pool, a grader that catches the timeout,
a lazy generator, one with its own alarm, sys.exit, a math.py, two grader.py, an import that waits for a service, a
random.py in the working folder) and is compared with what must happen: the call or the loading ends within its
timeout, nothing it started is left, the failure is named as it happened, the scores are those of a plain loop, a run
is the one whose reward never failed."""

import hashlib
import importlib.util
import json
import math
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy
import pytest
import torch
from helpers import (
    ENV,
    GROUPS_OF_EIGHT,
    ROOT,
    args_for,
    assert_bitwise_equal,
    assert_rows_agree,
    cli,
    final_state,
    launch,
    make_args,
    read_rows,
    resume_as_printed,
    run_main,
    run_script,
    set_up,
    tiny_run,
    torchrun,
    wait_for,
    without_timing,
)
from transformers import AutoTokenizer

import grpo
import ppo
import rlhf_runtime as runtime
from rlhf_runtime import log, rewards
from rlhf_runtime.reward_process import call_in_form

# ---------------------------------------------------------------- the built-in rules


def test_arithmetic_reward():
    assert rewards.arithmetic_reward([" 95", "94", "95 "], ["95", "95", "95"]) == [1.0, 0.0, 1.0]


def test_gsm8k_reward_reads_the_last_number_against_the_answer_after_hashes():
    # The first GSM8K training answer: intermediate numbers in the calculator annotations, the final one after '####'.
    answer = (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
    )
    responses = [
        "In May she sold 48 / 2 = 24, so 48 + 24 = 72 clips in all. The answer is 72.",  # last number 72: right
        "She sold 72 clips in April and May, 24 of them in May.",  # 72 appears, but the last number is 24: wrong
        "The answer is 72.0",  # the same number written as a decimal: right
        "No idea.",  # no number: wrong
    ]
    assert rewards.gsm8k_reward(responses, [answer] * 4) == [1.0, 0.0, 1.0, 0.0]
    # thousands separator, sign
    assert rewards.gsm8k_reward(["It costs $1,234 in total.", "-5"], ["#### 1234", "#### -5"]) == [1.0, 1.0]
    assert rewards.last_number("1,234.50 and then 7") == 7.0
    assert rewards.last_number("2.50 dollars") == 2.5


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
    builtin, _ = run_main("grpo.py", tmp_path / "builtin", *common, "--reward_fn", "arithmetic")
    mine, printed = run_script("grpo.py", tmp_path / "mine", *common, "--reward_fn", f"{tmp_path / 'my_rule.py'}:exact")
    assert without_timing(mine) == without_timing(builtin)
    assert "objective/rule_reward" in mine[-1]
    assert "eval/score" in mine[-1]
    # as a user runs it: transformers' own loading and saving bars are off; the run's lines are there
    assert "Loading weights" not in printed
    assert "Writing model shards" not in printed
    assert "iter 3/3" in printed


def test_a_reward_function_by_module_name(tmp_path, monkeypatch):
    (tmp_path / "rules_pkg").mkdir()
    (tmp_path / "rules_pkg" / "__init__.py").write_text("")
    (tmp_path / "rules_pkg" / "arith.py").write_text(SAME_AS_ARITHMETIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = rewards.load_reward_fn("rules_pkg.arith:exact", 10)
    assert rewards.call_reward_fn(fn, dict(responses=["12", " 7 ", "x"], answers=["12", "8", "x"]), 10) == (
        [1.0, 0.0, 1.0],
        None,
    )


@pytest.mark.parametrize(
    "spec,message",
    [
        ("no_such_file.py:reward", "'no_such_file.py' could not be loaded \\(FileNotFoundError"),
        ("{tmp}/rule.py:missing", "has no function 'missing'"),
        ("{tmp}/rule.py:one_argument", r"one_argument\(responses\) is in none of the forms taken"),
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
        rewards.load_reward_fns(args.reward_fn, args.run.reward_timeout)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("spec", ["None", "none"])
def test_reward_fn_none_is_refused_as_no_rules_name(spec):
    with pytest.raises(SystemExit, match=f"unknown --reward_fn '{spec}'; choose one of"):
        set_up(grpo, make_args(grpo, reward_fn=(spec,), eval_every=0))


# ---------------------------------------------------------------- several weighted rule rewards


RULES = """
def correct(responses, answers):
    return [float(r.strip() == str(a).strip()) for r, a in zip(responses, answers)]

def short(responses, answers):
    return [float(len(r.strip()) <= 2) for r in responses]

def both(responses, answers):
    return [c + 0.5 * s for c, s in zip(correct(responses, answers), short(responses, answers))]

def broken(responses, answers):
    return [1.0 / (len(r.strip()) - 2) for r in responses]
"""


def scored_by_rules(tmp_path, specs, weights=()):
    """score_responses on four known responses to arithmetic prompts, the rules loaded as the scripts load them."""
    (tmp_path / "rules.py").write_text(RULES)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"), padding_side="left")
    prompts = ["1+1=", "2+2=", "9+9=", "50+50="]
    answers = ["2", "4", "18", "100"]
    replies = ["2", "5", "18", "100"]
    encode = [tokenizer(p)["input_ids"] for p in prompts]
    prompt_ids, prompt_mask = runtime.left_pad(encode, tokenizer.pad_token_id, "cpu")
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in replies]
    width = max(map(len, ids))
    responses = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in ids])
    response_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
    fns = [(spec.rpartition(":")[2], rewards.load_reward_fn(f"{tmp_path / 'rules.py'}:{spec}", 600)) for spec in specs]
    args = make_args(ppo, reward_fn=tuple(specs), reward_weights=weights)
    return runtime.score_responses(
        runtime.Scorer([], fns, tokenizer, runtime.new_state(), ppo.combine_scores),
        torch.cat([prompt_ids, responses], 1),
        torch.cat([prompt_mask, response_mask], 1),
        prompt_ids.shape[1],
        [{"prompt": p, "answer": a} for p, a in zip(prompts, answers)],
        args,
    )


def test_two_weighted_rules_give_their_weighted_sum(tmp_path):
    scores = scored_by_rules(tmp_path, ["correct", "short"], (2.0, -0.25))
    assert scores.texts == ["2", "5", "18", "100"]
    assert scores.failed == 0
    # by hand: correct 1 0 1 1, short 1 1 1 0; 2 * correct - 0.25 * short
    assert scores.raw.tolist() == [1.75, -0.25, 1.75, 2.0]
    assert scores.metrics["objective/rule_reward"].tolist() == [1.75, -0.25, 1.75, 2.0]
    assert scores.metrics["reward/correct"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert scores.metrics["reward/short"].tolist() == [1.0, 1.0, 1.0, 0.0]
    scores = scored_by_rules(tmp_path, ["correct"])  # one rule, weight 1: its scores, and no reward/<name>
    assert scores.raw.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert list(scores.metrics) == ["objective/rule_reward", "health/unscored_rewards"]


def test_a_failing_rule_among_several_is_named(tmp_path):
    with pytest.raises(
        SystemExit,
        match=r"the response '18' to the prompt '9\+9=' is an error \(ZeroDivisionError: "
        r"float division by zero\) \(--reward_fn broken\)",
    ):
        scored_by_rules(tmp_path, ["correct", "broken"])


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(reward_fn=("arithmetic", "gsm8k"), reward_weights=(1.0,)), "--reward_weights needs one weight per"),
        (dict(reward_fn=("arithmetic", "arithmetic")), "--reward_fn gives two functions one name"),
        (dict(reward_fn=("arithmetic", "a.py:arithmetic")), "--reward_fn gives two functions one name, and each logs"),
    ],
)
def test_bad_weights_or_names_stop_before_any_model_loads(kw, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        grpo.validate(make_args(grpo, output_dir=str(tmp_path / "run"), **kw))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -float("inf"), 1e39])
def test_reward_weights_must_be_finite_and_within_float32(weight):
    args = make_args(grpo, reward_fn=("arithmetic", "gsm8k"), reward_weights=(1.0, weight))
    with pytest.raises(SystemExit, match=r"--reward_weights must each be finite and within \+-3.4e\+38 \(got "):
        grpo.validate(args)


def weights_digest(out):
    return hashlib.sha256(open(os.path.join(out, "model.safetensors"), "rb").read()).hexdigest()


# two iterations of grpo.py's groups of 8
TWO_ITERATIONS = [*GROUPS_OF_EIGHT, "--total_episodes=64", "--eval_every=0"]


def test_two_rules_by_file_train_like_one_rule_returning_their_sum(tmp_path):
    (tmp_path / "rules.py").write_text(RULES)
    held_out = tmp_path / "test.jsonl"
    held_out.write_text("".join(open(os.path.join(ROOT, "assets", "arithmetic", "test.jsonl")).readlines()[:12]))
    common = [
        *TWO_ITERATIONS,
        "--total_episodes=96",
        "--eval_every=2",
        f"--eval_dataset={held_out}",
    ]  # three iterations
    rules = tmp_path / "rules.py"
    two, printed = run_main(
        "grpo.py",
        tmp_path / "two",
        *common,
        "--reward_fn",
        f"{rules}:correct",
        f"{rules}:short",
        "--reward_weights",
        "1",
        "0.5",
    )
    one, _ = run_main("grpo.py", tmp_path / "one", *common, "--reward_fn", f"{rules}:both")

    def kept(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "reward/"))} for r in rows]

    assert kept(two) == kept(one)
    assert len(two) == 4
    assert weights_digest(tmp_path / "two") == weights_digest(tmp_path / "one")
    for r in two[1:]:  # each rule's mean is logged; their weighted sum is the rule score
        assert r["objective/rule_reward"] == pytest.approx(r["reward/correct"] + 0.5 * r["reward/short"], abs=1e-6)
        assert "reward/correct" not in one[1]
    lines = [line for line in printed.splitlines() if line.startswith("iter ")]  # each rule's mean on its line
    assert f"correct {two[-1]['reward/correct']:.2f} short {two[-1]['reward/short']:.2f} |" in lines[-1]


# ---------------------------------------------------------------- functions written for TRL, verl and OpenRLHF

# Each project's documented contract, written here: the arithmetic rule (the exact answer) in each form. TRL calls
# with keywords (the prompts as the data holds them, the completions, their token ids, the trainer's state and every
# other column); verl calls compute_score per response with the answer as ground_truth and takes a dict's "score";
# OpenRLHF calls reward_func(queries, prompts, labels), queries being the prompt and response as the policy saw them.
FORMS = """
import torch

def trl_exact(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
    assert len(prompts) == len(completions) == len(completion_ids) == len(answer)
    assert all(isinstance(p, str) and isinstance(i, int) for p, ids in zip(prompts, completion_ids) for i in ids)
    assert trainer_state.max_steps == 2 and trainer_state.global_step in (0, 1)
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth.strip()), "acc": True}

def reward_func(queries, prompts, labels):
    responses = [q[len(p) :].replace("<|endoftext|>", "") for q, p in zip(queries, prompts)]
    assert all(q.startswith(p) for q, p in zip(queries, prompts))
    return {"rewards": torch.tensor([float(r.strip() == l.strip()) for r, l in zip(responses, labels)])}
"""


# As TRL's trainers call them: an async def awaited, and the usual decorator's wrapper(*args, **kwargs) called with
# TRL's keywords (before: the coroutine was "returned a coroutine", the wrapper called as fn(responses, answers)).
AWAITED_AND_WRAPPED = """
import asyncio

async def trl_async(completions, answer, **kwargs):
    await asyncio.sleep(0)
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]

def logged(fn):  # without functools.wraps: the signature read is the wrapper's
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper

@logged
def trl_wrapped(completions, answer, **kwargs):
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]
"""


def test_functions_in_trl_verl_and_openrlhf_forms_train_bitwise_as_the_same_rule_in_this_projects(tmp_path):
    (tmp_path / "forms.py").write_text(FORMS + SAME_AS_ARITHMETIC + AWAITED_AND_WRAPPED)
    common = tiny_run("grpo.py", total_episodes=16, eval_every=0)  # two iterations
    native, _ = run_main("grpo.py", tmp_path / "native", *common, "--reward_fn", f"{tmp_path}/forms.py:exact")
    forms = [("trl_exact", "TRL's"), ("compute_score", "verl's"), ("reward_func", "OpenRLHF's")]
    for name, form in [*forms, ("trl_async", "TRL's"), ("trl_wrapped", "TRL's")]:
        rows, printed = run_main("grpo.py", tmp_path / name, *common, "--reward_fn", f"{tmp_path}/forms.py:{name}")
        assert f"--reward_fn {tmp_path}/forms.py:{name}: {form} form" in printed  # said before any model loads
        assert without_timing(rows) == without_timing(native), name
        assert weights_digest(tmp_path / name) == weights_digest(tmp_path / "native"), name
        assert rows[-1]["health/reward_errors"] == 0


def test_an_async_def_is_awaited_in_every_form():
    """An async def function's coroutine is run to its end, in whichever form it is written (TRL's trainers await
    theirs); the answers by hand: "4" is right, "5" wrong."""

    async def ours(responses, answers):
        return [float(r == a) for r, a in zip(responses, answers)]

    async def trl(completions, answer, **kwargs):
        return [float(c == a) for c, a in zip(completions, answer)]

    async def verl(solution_str, ground_truth):
        return float(solution_str == ground_truth)

    async def openrlhf(queries, prompts, labels):
        return {"rewards": [float(q[len(p) :] == a) for q, p, a in zip(queries, prompts, labels)]}

    batch = dict(
        responses=["4", "5"],
        answers=["4", "4"],
        prompts=["2+2=", "2+2="],
        prompt_texts=["2+2=", "2+2="],
        queries=["2+2=4", "2+2=5"],
        completion_ids=[[1], [2]],
        columns=[{"answer": "4"}, {"answer": "4"}],
        step=0,
        max_steps=1,
    )
    for fn, form in [(ours, "this project's"), (trl, "TRL's"), (verl, "verl's"), (openrlhf, "OpenRLHF's")]:
        assert call_in_form(fn, form, batch) == ([1.0, 0.0], {}), form


# A reward function in the shape of TRL's documented examples: the completions and the dataset's "solution" column
# by keyword, the rest in **kwargs.
TRL_EXAMPLE = """
def accuracy_reward(completions, solution, **kwargs):
    return [1.0 if c.strip() == s.strip() else 0.0 for c, s in zip(completions, solution)]
"""


def test_a_chat_datasets_completions_reach_a_trl_function_as_messages_and_only_the_names_it_declares():
    """As TRL passes them for a conversational dataset: each completion a list holding one assistant message; a
    function without **kwargs gets the names it declares alone."""
    seen = {}

    def fmt(prompts, completions, level):
        seen.update(prompts=prompts, completions=completions, level=level)
        return [float(c[0]["content"].startswith("<think>")) for c in completions]

    chat = [{"role": "user", "content": "2+2?"}]
    batch = dict(
        responses=["<think>4", "4"],
        prompts=[chat, chat],
        completion_ids=[[5, 6], [6]],
        columns=[{"level": 1, "answer": "4"}, {"level": 2, "answer": "4"}],
        step=3,
        max_steps=10,
    )
    assert call_in_form(fmt, "TRL's", batch) == ([1.0, 0.0], {})
    assert seen["completions"] == [
        [{"role": "assistant", "content": "<think>4"}],
        [{"role": "assistant", "content": "4"}],
    ]
    assert seen["prompts"] == [chat, chat] and seen["level"] == [1, 2]


def test_a_trl_reward_function_reads_a_csv_column_and_trains_as_the_built_in_rule(tmp_path):
    lines = open(os.path.join(ROOT, "assets", "arithmetic", "train.jsonl")).read().splitlines()
    data = tmp_path / "train.csv"
    data.write_text("prompt,solution\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in map(json.loads, lines)))
    (tmp_path / "trl_rewards.py").write_text(TRL_EXAMPLE)
    common = [*tiny_run("grpo.py", total_episodes=16, eval_every=0), f"--dataset={data}"]
    builtin, _ = run_main("grpo.py", tmp_path / "builtin", *common, "--answer_field=solution", "--reward_fn=arithmetic")
    trl, printed = run_main(
        "grpo.py", tmp_path / "trl", *common, f"--reward_fn={tmp_path}/trl_rewards.py:accuracy_reward"
    )
    assert "TRL's form" in printed
    assert without_timing(trl) == without_timing(builtin)
    assert weights_digest(tmp_path / "trl") == weights_digest(tmp_path / "builtin")


def test_verls_ground_truth_is_read_nested_from_a_parquet_file_and_flat_from_a_csv(tmp_path):
    import datasets
    import pyarrow
    import pyarrow.parquet

    rows = [json.loads(line) for line in open(os.path.join(ROOT, "assets", "arithmetic", "train.jsonl"))]
    verl_rows = [  # verl's own layout: the answer under reward_model.ground_truth
        {
            "data_source": "arithmetic",
            "prompt": r["prompt"],
            "reward_model": {"style": "rule", "ground_truth": r["answer"]},
            "extra_info": {"index": i},
        }
        for i, r in enumerate(rows)
    ]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(verl_rows), tmp_path / "train.parquet")
    (tmp_path / "forms.py").write_text(FORMS + SAME_AS_ARITHMETIC)
    common = tiny_run("grpo.py", total_episodes=16, eval_every=0)
    native, _ = run_main("grpo.py", tmp_path / "native", *common, "--reward_fn", f"{tmp_path}/forms.py:exact")
    verl, _ = run_main(
        "grpo.py",
        tmp_path / "verl",
        *common,
        f"--dataset={tmp_path / 'train.parquet'}",
        "--answer_field=reward_model.ground_truth",
        f"--reward_fn={tmp_path}/forms.py:compute_score",
    )
    assert without_timing(verl) == without_timing(native)
    assert weights_digest(tmp_path / "verl") == weights_digest(tmp_path / "native")
    # a csv of the same data (datasets' flatten(), as a csv of verl's data names them) has a column of the dotted
    # name, read as named (before: every answer None, with a warning that listed the column)
    flat = tmp_path / "flat" / "train.csv"
    flat.parent.mkdir()
    datasets.Dataset.from_list(verl_rows).flatten().to_csv(str(flat))
    assert "reward_model.ground_truth" in flat.read_text().splitlines()[0].split(",")
    from_csv, _ = run_main(
        "grpo.py",
        tmp_path / "verl_csv",
        *common,
        f"--dataset={flat}",
        "--answer_field=reward_model.ground_truth",
        f"--reward_fn={tmp_path}/forms.py:compute_score",
    )
    assert without_timing(from_csv) == without_timing(native)


# OpenRLHF's example functions return, beside the rewards, extra_logs: a tensor of a value per response, or one value
# for the batch (a 0-d tensor); lists too
OPENRLHF_LOGGED = """
import torch

def reward_func(queries, prompts, labels, **kwargs):
    responses = [q[len(p) :].replace("<|endoftext|>", "") for q, p in zip(queries, prompts)]
    reward = torch.tensor([float(r.strip() == l.strip()) for r, l in zip(responses, labels)])
    logs = {"correct": reward, "accuracy": reward.mean(), "listed": reward.tolist()}
    return {"rewards": reward, "scores": reward, "extra_logs": logs}

def too_few(queries, prompts, labels):
    return {"rewards": torch.zeros(len(queries)), "extra_logs": {"first": torch.zeros(1)}}
"""


def test_openrlhfs_extra_logs_are_logged_as_metrics_by_the_functions_name(tmp_path):
    """reward/<name>/<key>: the mean over the batch of each response's value (a batch's one value counting for each
    of its responses), as OpenRLHF logs them. Here every log is the rewards themselves (or their mean): each metric is
    the rule reward's mean, and the run trains as the same rule in this project's form."""
    (tmp_path / "openrlhf.py").write_text(OPENRLHF_LOGGED + SAME_AS_ARITHMETIC)
    common = tiny_run("grpo.py", total_episodes=16, eval_every=0)  # two iterations
    native, _ = run_main("grpo.py", tmp_path / "native", *common, "--reward_fn", f"{tmp_path}/openrlhf.py:exact")
    logged, _ = run_main("grpo.py", tmp_path / "logged", *common, "--reward_fn", f"{tmp_path}/openrlhf.py:reward_func")
    keys = ["reward/reward_func/correct", "reward/reward_func/accuracy", "reward/reward_func/listed"]
    assert [{k: v for k, v in r.items() if k not in keys} for r in without_timing(logged)] == without_timing(native)
    for row in logged:
        assert row["reward/reward_func/correct"] == row["reward/reward_func/listed"] == row["objective/rule_reward"]
        assert row["reward/reward_func/accuracy"] == pytest.approx(row["objective/rule_reward"], abs=1e-6)
    assert {r["objective/rule_reward"] for r in logged} != {0.0}  # some right: the means are not all 0
    fn = rewards.load_reward_fn(f"{tmp_path}/openrlhf.py:too_few", 30)
    batch = dict(responses=["2", "3"], queries=["1+1=2", "1+1=3"], prompt_texts=["1+1="] * 2, answers=["2", "2"])
    scores, why = rewards.call_reward_fn(fn, batch, 30)
    assert why == "nan: the batch's call returned extra_logs['first'] of 1 values for 2 responses"
    assert all(math.isnan(x) for x in scores)  # the batch fails, as for a wrong number of scores
    fn.kill()


def test_a_file_of_a_package_given_by_path_is_refused_naming_its_module(tmp_path, monkeypatch):
    """A file that imports its neighbours relatively cannot load as a file: the sentence names the package.module:fn
    to pass (before: Python's "attempted relative import" alone), which then loads."""
    package = tmp_path / "graders" / "math"
    package.mkdir(parents=True)
    (tmp_path / "graders" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text(SAME_AS_ARITHMETIC)
    (package / "rules.py").write_text("from .helpers import exact\n")
    refusal = (
        f"--reward_fn {package}/rules.py:exact: '{package}/rules.py' could not be loaded (ImportError: attempted "
        "relative import with no known parent package): it is a module of a package; pass --reward_fn "
        "graders.math.rules:exact, with the folder that holds graders/ on PYTHONPATH."
    )
    with pytest.raises(SystemExit, match=f"^{re.escape(refusal)}$"):
        rewards.load_reward_fn(f"{package}/rules.py:exact", 30)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = rewards.load_reward_fn("graders.math.rules:exact", 30)
    assert rewards.call_reward_fn(fn, dict(responses=["2", "3"], answers=["2", "2"]), 30) == ([1.0, 0.0], None)
    fn.kill()


def test_a_trl_function_gets_every_column_of_the_data_for_every_row(tmp_path):
    """As TRL passes a dataset's columns: one the first row lacks reaches the function for every row, None in that
    one (before: refused as "'level' is either both or neither", the first row's columns alone being passed)."""
    (tmp_path / "rule.py").write_text(
        "def f(completions, level, **kwargs):\n    return [-1.0 if x is None else float(x) for x in level]\n"
    )
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4", "level": 3}\n')
    args = make_args(grpo, dataset=str(data), reward_fn=(f"{tmp_path}/rule.py:f",), eval_every=0)
    reward_fns = rewards.load_reward_fns(args.reward_fn, args.run.reward_timeout)
    rows = runtime.load_task(args, torch.device("cpu"), reward_fns)[2]
    batch = dict(  # as score_responses gives it
        responses=["2", "4"],
        prompts=[row["prompt"] for row in rows],
        completion_ids=[[1], [2]],
        columns=[{k: v for k, v in row.items() if k != "prompt"} for row in rows],
        step=0,
        max_steps=1,
    )
    assert rewards.call_reward_fn(reward_fns[0][1], batch, 30) == ([-1.0, 3.0], None)
    reward_fns[0][1].kill()


NONE_RULES = """
def correct(responses, answers):
    return [None if r == "9" else float(r.strip() == a) for r, a in zip(responses, answers)]

def words(responses, answers):
    return [2.0 if r.isalpha() else None for r in responses]
"""


def test_a_none_does_not_apply_as_in_trl_and_is_kept_apart_from_a_failure(tmp_path):
    """TRL's rule: the weighted sum runs over the functions that scored a response; one that none scored counts 0
    (with one warning); each function's mean is over the responses it scored; a None is no failure."""
    (tmp_path / "rules.py").write_text(NONE_RULES)
    specs = [f"{tmp_path}/rules.py:{name}" for name in ("correct", "words")]
    fns = [(spec, rewards.load_reward_fn(spec, 60)) for spec in specs]
    with pytest.warns(UserWarning, match="no --reward_fn scored .* counts 0, as in TRL"):
        scores = scored(None, more=fns, weights=(1.0, 0.5))  # --on_reward_error stop: a None stops nothing
    # responses "5", "8", "nine", "9" to answers 5, 8, 8, 9: correct gives 1, 1, 0, None; words None, None, 2, None
    assert scores.raw.tolist() == [1.0, 1.0, 0.0 + 0.5 * 2.0, 0.0]
    assert scores.failed == 0
    assert scores.metrics["health/unscored_rewards"].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert scores.metrics["reward/correct"].tolist()[:3] == [1.0, 1.0, 0.0]  # nan where it gave None: left out of
    assert scores.metrics["reward/words"].tolist()[2] == 2.0  # the means the dashboard logs (its nan-masked mean)
    assert scores.metrics["reward/correct"][3].isnan() and scores.metrics["reward/words"][:2].isnan().all()


# ---------------------------------------------------------------- rewards that fail, return the wrong thing or hang


PROMPTS = ["what is 2+3?", "what is 7+1?", "what is 4+4?", "what is 9+0?"]


RESPONSES = ["5", "8", "nine", "9"]


def scored(fn, on_reward_error="stop", penalty=1.0, more=(), weights=()):
    """score_responses on four known prompts and responses with a rule reward (and more (--reward_fn, function)
    pairs) and no reward model."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"), padding_side="left")
    encode = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]
    prompt_ids, prompt_mask = runtime.left_pad(encode, tokenizer.pad_token_id, "cpu")
    replies = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in RESPONSES]
    width = max(map(len, replies))
    responses = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in replies])
    response_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in replies])
    args = make_args(ppo, on_reward_error=on_reward_error, missing_eos_penalty=penalty, reward_weights=weights)
    fns = [("fn", fn)] * (fn is not None) + list(more)
    return runtime.score_responses(
        runtime.Scorer([], fns, tokenizer, runtime.new_state(), ppo.combine_scores),
        torch.cat([prompt_ids, responses], 1),
        torch.cat([prompt_mask, response_mask], 1),
        prompt_ids.shape[1],
        [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, ["5", "8", "8", "9"])],
        args,
    )


def test_a_failing_reward_function_is_pinned_on_its_response():
    def fails_on_words(texts, answers):
        return [float(int(t) == int(a)) for t, a in zip(texts, answers)]  # int("nine") raises

    with pytest.raises(
        SystemExit,
        match=r"the response 'nine' to the prompt 'what is 4\+4\?' is an error "
        r"\(ValueError: invalid literal.*--on_reward_error penalty",
    ):
        scored(fails_on_words)
    # with the penalty it scores --missing_eos_penalty below the lowest valid score of the batch: min(1, 1, 1) - 0.5
    scores = scored(fails_on_words, "penalty", penalty=0.5)
    assert scores.raw.tolist() == [1.0, 1.0, 0.5, 1.0]
    assert scores.failed == 1
    assert scores.texts == RESPONSES
    reward_metrics = scores.metrics
    assert reward_metrics["objective/rule_reward"].tolist() == [1.0, 1.0, 0.0, 1.0]  # the rule counts it as wrong


def test_a_non_finite_score_is_named():
    with pytest.raises(SystemExit, match=r"the response '9' to the prompt 'what is 9\+0\?' is not a finite number"):
        scored(lambda texts, answers: [0.0, 1.0, 2.0, float("inf")])
    scores = scored(lambda texts, answers: [0.0, float("nan"), 2.0, 3.0], "penalty")
    assert scores.raw.tolist() == [0.0, -1.0, 2.0, 3.0]
    assert scores.failed == 1


def test_a_wrong_number_of_scores_is_named():
    with pytest.raises(
        SystemExit,
        match=r"the response '5' .* is nan: the batch's call returned 3 scores for 4 "
        r"responses; fix the reward",
    ):  # the count named, not one response blamed
        scored(lambda texts, answers: [1.0 for t in texts if t != "nine"])  # drops a response

    def one_at_a_time(texts, answers):  # scores a single response, and raises on a batch of several
        if len(texts) == 1:
            return [1.0]
        raise ZeroDivisionError("division by zero")

    with pytest.raises(
        SystemExit,
        match=r"is nan: the batch's call raised \(ZeroDivisionError: division by zero\) but no single response's did; "
        "make the reward score a batch as it scores each response",
    ):
        scored(one_at_a_time)
    # every response failed: no batch minimum, and the advice is not the option already on
    with pytest.raises(
        SystemExit,
        match="every response of the batch failed its reward "
        r"\(the response '5' .* is not a finite number\); fix the reward function\.$",
    ):
        scored(lambda texts, answers: [float("nan")] * len(texts), "penalty")


@pytest.mark.parametrize(
    "returned, why",
    [
        ("1.0", "nan: the batch's call returned a str for 3 responses"),
        ([1.0, 0.0], "nan: the batch's call returned 2 scores for 3 responses"),
        ([1.0, 0.0, 1.0, 1.0], "nan: the batch's call returned 4 scores for 3 responses"),
        (0.5, "nan: the batch's call returned a float for 3 responses"),
        ([1.0, 1e300, 0.0], "1e+300, past float32's range"),
    ],
)
def test_a_wrong_return_is_named(returned, why):
    """Before, a str had each character taken as a score, a wrong count blamed one response with "too many values
    to unpack", and 1e300 (finite in Python, inf in float32) was called "not a finite number"."""
    scores, reason = rewards.call_reward_fn(
        lambda responses, answers: returned, dict(responses=["a", "b", "c"], answers=[1, 2, 3]), 10
    )
    assert reason == why
    assert not torch.tensor(scores).isfinite().all()  # the batch fails: no score is taken from it


def test_a_reward_that_scores_every_response_gives_no_reason():
    assert rewards.call_reward_fn(
        lambda responses, answers: [1.0, 0.5], dict(responses=["a", "b"], answers=[1, 2]), 10
    ) == ([1.0, 0.5], None)
    scores, reason = rewards.call_reward_fn(
        lambda responses, answers: [1.0, float("nan")], dict(responses=["a", "b"], answers=[1, 2]), 10
    )
    assert reason == "not a finite number"


def test_a_reward_that_raises_on_the_batch_alone_fails_every_response():
    def batch_only(responses, answers):
        if len(responses) > 1:
            raise ZeroDivisionError("division by zero")
        return [1.0]

    scores, reason = rewards.call_reward_fn(batch_only, dict(responses=["a", "b"], answers=[1, 2]), 10)
    assert all(score != score for score in scores)  # nan: no score is taken from a grader that disagrees with itself
    assert reason.startswith("nan: the batch's call raised (ZeroDivisionError: division by zero) but no single")


def test_several_functions_a_failure_names_its_function_and_a_none_is_no_failure(tmp_path):
    """Two rules: the first returns None for '5' (the first response), the second fails on 'nine' (the third). The
    response named is the first that failed, with the reason and the --reward_fn of the rule that failed on it; the
    first rule's None is TRL's "does not apply", not a failure (before: refused, and named before the error)."""

    def first(texts, answers):
        return [None if t == "5" else 0.5 for t in texts]

    def second(texts, answers):
        return [float(int(t) == int(a)) for t, a in zip(texts, answers)]  # int("nine") raises

    spec = f"{tmp_path}/rules.py:second"
    with pytest.raises(
        SystemExit,
        match=r"the response 'nine' to the prompt 'what is 4\+4\?' is an error \(ValueError: invalid literal .*\) "
        rf"\(--reward_fn {spec}\); fix the reward",
    ):
        scored(first, more=[(spec, second)])


def test_a_reward_that_hangs_on_each_response_is_not_retried_past_the_first_timeout(tmp_path):
    """The batch's call raises, and each response alone then hangs: the first single call that times out ends the
    retries (before, each of the B responses waited its own timeout), and every score is a failure."""
    rule = tmp_path / "rule.py"
    rule.write_text(
        "import time\n"
        "def grader(responses, answers):\n"
        f"    print(len(responses), file=open({str(tmp_path / 'calls')!r}, 'a'), flush=True)\n"
        "    if len(responses) > 1:\n"
        "        raise ValueError('batch unsupported')\n"
        "    time.sleep(30)\n"
    )
    reward_fn = rewards.load_reward_fn(f"{rule}:grader", 10)
    scores, why = rewards.call_reward_fn(reward_fn, dict(responses=["a", "b", "c"], answers=[1, 2, 3]), timeout=0.5)
    assert (tmp_path / "calls").read_text().split() == ["3", "1"]
    assert all(s != s for s in scores)
    assert len(scores) == 3
    assert why == "an error (TimeoutError: no answer within --reward_timeout 0.5 s)"


def test_penalised_reward_errors_are_counted_in_a_run_and_shown_on_its_lines(
    tmp_path, monkeypatch, keep_signal_handlers, capsys
):
    def half_broken(texts, answers):  # a reward that fails on every other response
        return [float("nan") if i % 2 else 1.0 for i in range(len(texts))]

    monkeypatch.setitem(rewards.REWARD_FNS, "arithmetic", half_broken)
    grpo.main(args_for("grpo.py", tmp_path, total_episodes=16, on_reward_error="penalty"))
    rows = read_rows(tmp_path)
    assert [r["health/reward_errors"] for r in rows] == [4, 4]  # 4 of the 8 responses of each iteration
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iter ")]
    assert len(lines) == 2 and all(" failed 4 |" in line for line in lines)  # before: in metrics.jsonl alone
    with pytest.raises(SystemExit, match="is not a finite number; fix the reward"):
        grpo.main(args_for("grpo.py", tmp_path / "stop", total_episodes=16))


# ---------------------------------------------------------------- reward code run in a process of its own


GRADERS = """
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

PIDS = {pids!r}  # a file named after each grader, holding the process id of what it started


def shell(responses, answers):  # os.system: no Python code runs in this process until the shell ends
    os.system(f"echo $$ > {{PIDS}}/shell; exec sleep 120")


def popen(responses, answers):
    child = subprocess.Popen(["sleep", "120"])
    open(f"{{PIDS}}/popen", "w").write(str(child.pid))
    child.wait()


def threads(responses, answers):  # the pool's shutdown waits for its thread
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(time.sleep, 120).result()


def forgiving(responses, answers):  # a grader that takes a TimeoutError as "no answer": zeros
    try:
        time.sleep(120)
    except TimeoutError:
        pass
    return [0.0] * len(responses)


def lazy(responses, answers):  # a generator: the scores are computed as they are read
    for response in responses:
        time.sleep(120)
        yield 1.0


class OwnLimit(Exception):
    pass


def over_own_limit(signum, frame):
    raise OwnLimit("the grader's own 50 ms limit")


signal.signal(signal.SIGALRM, over_own_limit)


def own_alarm(responses, answers):
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    time.sleep(120)


def crashes(responses, answers):  # as a C extension's crash or an os._exit() would
    os._exit(3)


def where(responses, answers):  # the process it runs in: its threads, the trainer's torch, the default SIGTERM
    return [threading.active_count(), "torch" in sys.modules, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL]
"""


@pytest.fixture
def graders(tmp_path):
    (tmp_path / "pids").mkdir()
    (tmp_path / "graders.py").write_text(GRADERS.format(pids=str(tmp_path / "pids")))
    return tmp_path / "graders.py"


def alive(pid):
    """Whether a process runs (a zombie waiting for its parent does not)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


TIMED_OUT = "an error (TimeoutError: no answer within --reward_timeout 1 s)"


@pytest.mark.parametrize(
    "name, why",
    [
        ("shell", TIMED_OUT),  # before: the alarm could not interrupt os.system: the call took the whole 120 s
        ("popen", TIMED_OUT),  # before: the call timed out, its sleep went on
        ("threads", TIMED_OUT),  # before: the thread went on in the trainer, and kept it alive at the end
        ("forgiving", TIMED_OUT),  # before: the zeros it returned were trained on
        ("lazy", TIMED_OUT),  # before: the generator was read after the alarm was off: the call took 120 s
        ("own_alarm", "an error (OwnLimit: the grader's own 50 ms limit)"),  # before: its handler was replaced
        ("crashes", "an error (the process running it ended (exit code 3))"),  # before: the trainer ended with it
    ],
    ids=["shell", "popen", "threads", "forgiving", "lazy", "own_alarm", "crashes"],
)
def test_a_reward_call_ends_within_its_timeout_with_everything_it_started(graders, name, why):
    threads_before = threading.active_count()
    reward_fn = rewards.load_reward_fn(f"{graders}:{name}", 30)
    started = time.time()
    scores, reason = rewards.call_reward_fn(reward_fn, dict(responses=["a response"], answers=["its answer"]), 1)
    assert time.time() - started < 15
    assert reason == why
    assert math.isnan(scores[0])  # no score taken from it
    assert threading.active_count() == threads_before
    for path in (graders.parent / "pids").iterdir():
        assert gone(int(path.read_text())), path.name


def gone(pid, seconds=5):
    """Whether the process ends within a few seconds (SIGKILL is delivered, not waited for)."""
    deadline = time.time() + seconds
    while alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_nothing_a_grader_started_outlives_the_trainer(graders):
    """The trainer killed with SIGKILL (none of its code runs) while its grader waits on a subprocess: the reward
    process sees the trainer's end of its stdin close and kills its group (before: the subprocess lived on)."""
    batch = "dict(responses=['a'], answers=[1])"
    reward = f"rewards.call_reward_fn(rewards.load_reward_fn({str(graders)!r} + ':popen', 0), {batch}, 0)"
    call = f"from rlhf_runtime import rewards; {reward}"
    trainer = subprocess.Popen([sys.executable, "-c", call], cwd=ROOT, env=ENV)
    started = graders.parent / "pids" / "popen"
    while not started.exists() or not started.read_text():
        assert trainer.poll() is None
        time.sleep(0.05)
    trainer.kill()
    trainer.wait()
    assert gone(int(started.read_text()))


def test_a_stop_signal_ends_a_reward_call_at_once_whatever_the_timeout(graders):
    """SIGTERM or Ctrl-C (a signal in stops) while the grader hangs, under the default 600 s timeout: the call is
    left within a second, its process killed; the next call starts a fresh one."""
    reward_fn = rewards.load_reward_fn(f"{graders}:popen", 600)
    stops = []
    threading.Timer(0.5, stops.append, [signal.SIGTERM]).start()
    started = time.time()
    scores, reason = rewards.call_reward_fn(reward_fn, dict(responses=["a", "b"], answers=[1, 2]), 600, stops)
    assert time.time() - started < 5
    assert reason == "stopped by a signal"
    assert reward_fn.process is None
    assert (
        rewards.call_reward_fn(reward_fn, dict(responses=["a"], answers=[1]), 1)[1] == TIMED_OUT
    )  # a fresh process, killed again


def test_reward_code_never_runs_in_a_fork_of_the_trainer(graders, keep_signal_handlers):
    """A grader's process pool forks the process the grader runs in. Forked from the trainer, its workers had the
    trainer's SIGTERM handler until an at-fork hook put the default back: a worker not yet run when the pool ended
    swallowed the pool's SIGTERM, and Pool.__exit__ waited for it forever (2 of 25 runs, on a loaded machine); a
    fork also copies locks the trainer's other threads hold. The grader runs in a fresh interpreter: no torch, the
    default SIGTERM, and no other thread (what waits for the trainer's end is a process of its own)."""
    runtime.catch_stop_signals()  # the trainer's handlers
    other_thread = threading.Thread(target=time.sleep, args=(5,), daemon=True)  # the trainer has other threads
    other_thread.start()
    assert "torch" in sys.modules
    scores = rewards.call_reward_fn(
        rewards.load_reward_fn(f"{graders}:where", 10), dict(responses=["a", "b", "c"], answers=[1, 2, 3]), 10
    )
    assert scores == ([1.0, 0.0, 1.0], None)


def test_a_reward_process_started_again_runs_the_code_the_run_began_with(graders, tmp_path, monkeypatch):
    """The reward process is sent rlhf_runtime/reward_process.py's functions as source. After a timeout or a stop it
    is started again, and by then the file may have been edited (a git pull during a long run): the program read from
    the file then, at line numbers that no longer hold, did not compile, and the trainer died of the reset
    connection. It is read once, when the run begins. A copy of that file stands in for it, and is the one edited."""
    copy = tmp_path / "reward_process_copy.py"
    copy.write_text((pathlib.Path(ROOT) / "rlhf_runtime" / "reward_process.py").read_text())
    found = importlib.util.spec_from_file_location("reward_process_copy", copy)
    copied = importlib.util.module_from_spec(found)
    found.loader.exec_module(copied)
    monkeypatch.setattr(rewards, "RewardProcess", copied.RewardProcess)  # processes that run the copy's code
    reward_fn = rewards.load_reward_fn(f"{graders}:where", 10)
    assert isinstance(reward_fn, copied.RewardProcess)
    first = rewards.call_reward_fn(reward_fn, dict(responses=["a", "b", "c"], answers=[1, 2, 3]), 10)
    copy.write_text("# edited while the run goes on\n" * 7 + copy.read_text())
    reward_fn.kill()  # as a timeout or a stop does: the next call starts a new process
    assert (
        rewards.call_reward_fn(reward_fn, dict(responses=["a", "b", "c"], answers=[1, 2, 3]), 10)
        == first
        == ([1.0, 0.0, 1.0], None)
    )
    reward_fn.kill()


def test_reward_files_shadow_nothing_and_two_of_one_name_both_work_with_process_pools(tmp_path):
    """A user's math.py and numpy.py replace neither module, here or in the grader's process; two grader.py in two
    folders are two modules, each pickled by a process pool as itself. Their folders are not put on sys.path here."""
    pooled = (
        "import multiprocessing\n"
        "import math\n"
        "def one(pair):\n"
        "    return math.sqrt({value}) * len(pair[0])\n"
        "def score(responses, answers):\n"
        "    with multiprocessing.Pool(2) as pool:\n"
        "        return pool.map(one, list(zip(responses, answers)))\n"
    )
    folders = {}
    for name, value in (("math", 4), ("numpy", 9), ("grader", 16), ("other/grader", 25)):
        path = tmp_path / f"{name}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(pooled.format(value=value))
        folders[name] = path
    path_before = list(sys.path)
    texts = ["a", "bb", "ccc"]
    for name, value in (("math", 4), ("numpy", 9), ("grader", 16), ("other/grader", 25)):
        reward_fn = rewards.load_reward_fn(f"{folders[name]}:score", 30)
        expected = [value**0.5 * len(t) for t in texts]
        assert rewards.call_reward_fn(reward_fn, dict(responses=texts, answers=[1, 2, 3]), 30) == (expected, None), name
    assert sys.modules["math"].sqrt(4) == 2.0
    assert sys.modules["numpy"] is numpy
    assert sys.path == path_before


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(reward_timeout=1e-9), "--reward_timeout must be 0 (no limit) or from 0.1 s"),
        (dict(reward_timeout=1e10), "--reward_timeout must be 0 (no limit) or from 0.1 s"),
        (
            dict(reward_fn=("a/grader.py:score", "b/grader.py:score")),
            "--reward_fn gives two functions one name, and each logs its scores as reward/<name>; rename one",
        ),
    ],
    ids=["timeout 1e-9", "timeout 1e10", "two functions of one name"],
)
def test_reward_options_out_of_range_are_refused_in_one_sentence(changes, message):
    args = make_args(ppo, **changes)
    with pytest.raises(SystemExit, match="^" + re.escape(message)):
        runtime.check_common_args(args, args.rollout_batch_size)


HANGS_AT_IMPORT = """
import os
import subprocess
import time

if os.path.exists({mark!r}):  # loaded before: its service is down now, and the import waits on a program
    waiting = subprocess.Popen(["sleep", "120"])
    open({pid!r}, "w").write(str(waiting.pid))
    waiting.wait()
open({mark!r}, "w").close()


def score(responses, answers):
    time.sleep(120)
"""


def test_a_reward_file_whose_import_hangs_is_refused_within_the_timeout(tmp_path):
    """The grader's service is down when the run begins: loading it is refused within --reward_timeout, and what its
    import started is killed (before, the start waited on the pipe with no timeout: the run hung before any model)."""
    (tmp_path / "loaded").write_text("")
    path = tmp_path / "grader.py"
    path.write_text(HANGS_AT_IMPORT.format(mark=str(tmp_path / "loaded"), pid=str(tmp_path / "pid")))
    started = time.time()
    with pytest.raises(SystemExit) as refused:
        rewards.load_reward_fn(f"{path}:score", 3)
    assert time.time() - started < 15
    assert refused.value.code == (
        f"--reward_fn {path}:score: loading it gave no answer within --reward_timeout 3 s; check what its import "
        "waits for, or pass a longer --reward_timeout."
    )
    assert gone(int((tmp_path / "pid").read_text()))


def test_a_reward_process_started_again_ends_on_a_stop_or_its_timeout_while_loading(tmp_path):
    """A call times out and its process is killed; the next call starts it again, and by then the import hangs (the
    service went down). A stop signal ends that start within a second, a timeout within --reward_timeout, each
    killing what the import started (before, the start waited on the pipe forever and a SIGTERM did nothing)."""
    path = tmp_path / "grader.py"
    path.write_text(HANGS_AT_IMPORT.format(mark=str(tmp_path / "loaded"), pid=str(tmp_path / "pid")))
    reward_fn = rewards.load_reward_fn(f"{path}:score", 30)
    assert rewards.call_reward_fn(reward_fn, dict(responses=["a"], answers=[1]), 1)[1] == TIMED_OUT
    stops = []
    stopped_at = []

    def stop_once_the_import_waits():
        while not (tmp_path / "pid").exists():
            time.sleep(0.05)
        stopped_at.append(time.time())
        stops.append(signal.SIGTERM)

    threading.Thread(target=stop_once_the_import_waits, daemon=True).start()
    scores, reason = rewards.call_reward_fn(reward_fn, dict(responses=["a"], answers=[1]), 600, stops)
    assert time.time() - stopped_at[0] < 2
    assert reason == "stopped by a signal"
    assert math.isnan(scores[0])
    assert reward_fn.process is None
    assert gone(int((tmp_path / "pid").read_text()))
    (tmp_path / "pid").unlink()
    started = time.time()
    scores, reason = rewards.call_reward_fn(reward_fn, dict(responses=["a"], answers=[1]), 3)
    assert time.time() - started < 15
    assert reason == (
        f"an error (TimeoutError: --reward_fn {path}:score: loading it gave no answer within --reward_timeout 3 s; "
        "check what its import waits for, or pass a longer --reward_timeout.)"
    )
    assert gone(int((tmp_path / "pid").read_text()))


STANDARD_NAMES = "raise ImportError('{where} random.py was imported in place of the standard library\\'s')\n"


def test_modules_of_standard_names_in_the_working_folder_or_beside_the_file_shadow_nothing(tmp_path, monkeypatch):
    """A random.py in the working folder and beside the reward file: the reward process's own imports (tempfile
    imports random) and the grader's `import random` get the standard library's, and a module beside the file still
    imports (before, the process died importing the working folder's random.py, and the message blamed the file)."""
    work = tmp_path / "work"
    rules = tmp_path / "rules"
    for folder in (work, rules):
        folder.mkdir()
        (folder / "random.py").write_text(STANDARD_NAMES.format(where=folder.name))
    (rules / "helper.py").write_text("BONUS = 0.5\n")
    (rules / "grader.py").write_text(
        "import random\n"
        "import helper\n"
        "def score(responses, answers):\n"
        "    return [helper.BONUS + random.Random(len(r)).random() for r in responses]\n"
    )
    monkeypatch.chdir(work)
    texts = ["a", "bb"]
    expected = [0.5 + random.Random(len(t)).random() for t in texts]
    reward_fn = rewards.load_reward_fn(f"{rules / 'grader.py'}:score", 30)
    assert rewards.call_reward_fn(reward_fn, dict(responses=texts, answers=[1, 2]), 30) == (expected, None)


# ---------------------------------------------------------------- reward code as people write it, in runs


POOLS = """
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

from grading import grade  # a module beside this file


def one(pair):
    return grade(*pair)


def in_process(responses, answers):
    return [one(pair) for pair in zip(responses, answers)]


def with_a_pool(responses, answers):
    with multiprocessing.Pool(2) as pool:
        return pool.map(one, list(zip(responses, answers)))


def with_an_executor(responses, answers):
    with ProcessPoolExecutor(2) as pool:
        return list(pool.map(one, list(zip(responses, answers))))


def takes_its_inputs(responses, answers):
    scores = in_process(responses, answers)
    responses.clear()
    answers.pop()
    return scores


def exits(responses, answers):
    raise SystemExit(0)


def hangs(seconds):  # and says so, with its process id, in a file named "hanging" beside this one
    with open(os.path.join(os.path.dirname(__file__), "hanging"), "a") as said:
        said.write(f"{os.getpid()}\\n")
    time.sleep(seconds)


calls = []
def hangs_once(responses, answers):  # its second call hangs while a file named "hang" is beside it
    calls.append(len(responses))
    if len(calls) == 2 and os.path.exists(os.path.join(os.path.dirname(__file__), "hang")):
        hangs(600)
    return in_process(responses, answers)


def hangs_in_a_pool(responses, answers):  # a grader's worker that never answers
    with ProcessPoolExecutor(2) as pool:
        return list(pool.map(hangs, [600] * len(responses)))
"""


@pytest.fixture
def reward_file(tmp_path):
    (tmp_path / "grading.py").write_text(
        "def grade(response, answer):\n    return float(response.strip() == str(answer).strip())\n"
    )
    (tmp_path / "pools.py").write_text(POOLS)
    return tmp_path / "pools.py"


def test_reward_functions_with_process_pools_train_as_in_process(reward_file, tmp_path):
    """A multiprocessing.Pool and a ProcessPoolExecutor over the file's own function (which imports a module beside
    it) give grpo.py the metrics the same function gives in-process, bitwise; no worker runs the trainer's SIGTERM
    handler (a pool ends its workers with SIGTERM); a function that empties its inputs changes nothing."""
    args = cli("grpo.py", total_episodes=24)
    runs = {}
    for name in ("in_process", "with_a_pool", "with_an_executor", "takes_its_inputs"):
        rows, printed = run_main("grpo.py", tmp_path / name, *args, "--reward_fn", f"{reward_file}:{name}")
        assert "stopping to save" not in printed, name
        runs[name] = without_timing(rows)
    assert runs["with_a_pool"] == runs["with_an_executor"] == runs["takes_its_inputs"] == runs["in_process"]
    assert len(runs["in_process"]) == 3


def test_sys_exit_in_reward_code_is_a_reward_failure(reward_file, tmp_path):
    out = tmp_path / "run"
    proc = launch("grpo.py", out, [*cli("grpo.py", total_episodes=24), "--reward_fn", f"{reward_file}:exits"])
    printed = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1, printed[-3000:]
    assert "is an error (SystemExit: 0); fix the reward" in printed
    assert "--resume" in printed
    assert "Traceback" not in printed


def test_a_hung_reward_stops_at_its_timeout_and_the_resumed_run_is_the_one_never_stopped(reward_file, tmp_path):
    """The reward's second call hangs: past --reward_timeout it is a reward failure (checkpoint-1 and the command to
    go on). Resumed with the grader fixed, the run's metrics and final weights are those of the run that never hung,
    bitwise."""
    args = [*cli("grpo.py", total_episodes=24), "--reward_fn", f"{reward_file}:hangs_once", "--save_every=3"]
    full, _ = run_main("grpo.py", tmp_path / "full", *args)
    (tmp_path / "hang").touch()
    out = tmp_path / "run"
    started = time.time()
    proc = launch("grpo.py", out, [*args, "--reward_timeout=2"])
    printed = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1, printed[-3000:]
    assert "Traceback" not in printed, printed[-3000:]
    assert "is an error (TimeoutError: no answer within --reward_timeout 2 s); fix the reward" in printed
    assert time.time() - started < 120  # not the 600 s of the hang
    (tmp_path / "hang").unlink()
    resume_as_printed(printed, out / "checkpoint-1")
    assert without_timing(read_rows(out)) == without_timing(full)
    assert_bitwise_equal(final_state(out, 3), final_state(tmp_path / "full", 3))


def test_sigterm_stops_a_run_whose_reward_hangs_within_seconds_whatever_the_timeout(reward_file, tmp_path):
    """SIGTERM while the grader hangs, in its process or in a process pool's worker, under the default 600 s
    --reward_timeout: the run leaves the call within a second, saves the state before the rollout and ends with the
    command that goes on (before: only once the timeout rang); no process of the grader is left behind."""
    (tmp_path / "hang").touch()
    for name, iteration in (("hangs_once", 1), ("hangs_in_a_pool", 0)):  # its second call hangs; its first
        out = tmp_path / name
        proc = launch("grpo.py", out, [*cli("grpo.py", total_episodes=24), "--reward_fn", f"{reward_file}:{name}"])
        wait_for(lambda: (tmp_path / "hanging").exists() and (tmp_path / "hanging").read_text().endswith("\n"), proc)
        hung = [int(pid) for pid in (tmp_path / "hanging").read_text().split()]
        (tmp_path / "hanging").unlink()
        proc.send_signal(signal.SIGTERM)
        signalled = time.time()
        printed = proc.communicate(timeout=240)[0]
        assert time.time() - signalled < 15, name
        assert proc.returncode == 128 + signal.SIGTERM, printed[-3000:]
        assert "SIGTERM: stopping to save" in printed, printed[-3000:]
        assert f"stopped after iteration {iteration}; to go on:" in printed
        assert "Traceback" not in printed, printed[-3000:]
        assert not any(alive(pid) for pid in hung), name  # killed with the grader's process, not handed to init


# ---------------------------------------------------------------- the forms refused, a missing answer column said


ROW = '{"prompt": "1+1=", "answer": "2"}'


@pytest.mark.parametrize(
    "source, row, message",
    [
        ("def f(texts):\n    return [0.0]", ROW, r"f\(texts\) is in none of the forms taken: fn\(responses, answers\)"),
        (
            "def f(completions, level, **kw):\n    return [0.0]",
            ROW,
            r"\(TRL's form\) takes 'level', but '.*train.jsonl' has no column of that name \(its columns besides the "
            r"prompts: answer\); pass data with that column, or give the argument a default\.$",
        ),
        (
            "def f(completions):\n    return [0.0]",
            ROW[:-1] + ', "completions": "x"}',
            r"'.*train.jsonl' has a column 'completions', but --reward_fn .*rule.py:f is in TRL's form, which passes "
            r"prompts, completions, completion_ids, trainer_state itself; rename the column\.$",
        ),
    ],
)
def test_a_function_in_no_form_or_reading_a_column_the_data_lacks_is_refused_before_any_model_loads(
    source, row, message, tmp_path
):
    (tmp_path / "rule.py").write_text(source)
    (tmp_path / "train.jsonl").write_text(row + "\n")
    args = make_args(grpo, dataset=str(tmp_path / "train.jsonl"), reward_fn=(f"{tmp_path}/rule.py:f",), eval_every=0)
    with pytest.raises(SystemExit, match=message):
        # a function in no form is refused here, the others at the data
        reward_fns = rewards.load_reward_fns(args.reward_fn, args.run.reward_timeout)
        try:
            runtime.load_task(args, torch.device("cpu"), reward_fns)
        finally:
            reward_fns[0][1].kill()


def test_a_function_of_ones_own_that_takes_answers_gets_a_warning_when_no_row_has_one(tmp_path):
    """Before: the wrong --answer_field gave the function None answers, silently (the built-in rules stop)."""
    (tmp_path / "rule.py").write_text(SAME_AS_ARITHMETIC)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "solution": "2"}\n')
    args = make_args(grpo, dataset=str(data), reward_fn=(f"{tmp_path}/rule.py:exact",), eval_every=0)
    reward_fns = rewards.load_reward_fns(args.reward_fn, args.run.reward_timeout)
    with pytest.warns(UserWarning, match="has no 'answer' \\(its columns: prompt, solution\\): every answer is None"):
        runtime.load_task(args, torch.device("cpu"), reward_fns)
    args.run.answer_field = "solution"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runtime.load_task(args, torch.device("cpu"), reward_fns)
    reward_fns[0][1].kill()


def test_the_zero_signal_alarm_fires_after_ten_iterations_in_a_row_at_or_above_nine_tenths():
    state = {"alarms_on": []}
    run = grpo.Args().run
    alarms = (run.alarm_kl, run.alarm_clipfrac, run.alarm_collapse)
    shares = [0.95] * 9 + [0.5] + [0.9] * 9 + [1.0, 1.0]  # the run broken at 10, then 11 in a row from 11
    fired = [
        log.failure_alarms({"iteration": i, "health/zero_signal": x}, state, *alarms)["zero_signal"]
        for i, x in enumerate(shares, 1)
    ]
    assert fired == [False] * 19 + [True, True]
    assert "zero_signal" in log.ALARMS


# ---------------------------------------------------------------- the new user's path, replayed

NEW_USER_REWARDS = """
def accuracy_reward(completions, solution, **kwargs):  # written for TRL
    return [1.0 if c.strip() == s.strip() else 0.0 for c, s in zip(completions, solution)]

def bare_number(responses, answers):  # this project's form
    return [float(r.strip().lstrip("-").isdigit()) for r in responses]
"""


def test_a_new_users_csv_and_trl_reward_weighted_with_another_resume_under_torchrun_as_one_process_runs(tmp_path):
    """Their own train.csv and test.csv (a solution column), a reward written for TRL weighted with one of this
    project's form, two iterations on two processes, then resumed to three: the run a single process makes whole."""
    lines = [json.loads(line) for line in open(os.path.join(ROOT, "assets", "arithmetic", "train.jsonl"))]
    for name, rows in (("train.csv", lines[:200]), ("test.csv", lines[200:208])):
        (tmp_path / name).write_text("prompt,solution\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in rows))
    (tmp_path / "rewards.py").write_text(NEW_USER_REWARDS)
    options = [
        *tiny_run("grpo.py", eval_every=1, eval_batch_size=4, save_every=1),
        f"--dataset={tmp_path / 'train.csv'}",  # test.csv beside it is the held-out set
        "--answer_field=solution",
        "--reward_fn",
        f"{tmp_path}/rewards.py:accuracy_reward",
        f"{tmp_path}/rewards.py:bare_number",
        "--reward_weights",
        "1",
        "0.1",
    ]
    one, _ = run_main("grpo.py", tmp_path / "one", *options, "--total_episodes=24")
    first = torchrun("grpo.py", tmp_path / "two", *options, "--total_episodes=16")
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"--reward_fn {tmp_path}/rewards.py:accuracy_reward: TRL's form" in first.stdout
    resumed = torchrun("grpo.py", tmp_path / "two", *options, "--total_episodes=24", "--resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_rows_agree(read_rows(tmp_path / "two"), one)
    assert "reward/accuracy_reward" in one[-1] and "eval/score" in one[-1]
