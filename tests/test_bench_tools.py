"""bench/bench_trl_tools.py and bench/trl_tools_runner.py: both sides get grpo_tools.py's defaults by the same names,
TRL's config by hand, the response template reading Hermes calls from the tiny-tools tokenizer, the table's arithmetic
by hand, and smoke runs (ours alone; against TRL where the peer environment venv-trl116 is, skipped elsewhere)."""

import json
import os
import statistics
import sys

import pytest
import tyro
from helpers import ROOT, finished

from rlhf_runtime.settings import flat_options

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_trl  # noqa: E402
import bench_trl_tools  # noqa: E402
import trl_tools_runner  # noqa: E402  (importable without trl: trl is imported inside main)

TINY_TOOLS = os.path.join(ROOT, "assets", "tiny-tools")
needs_assets = pytest.mark.skipif(
    not os.path.isdir(TINY_TOOLS) or not os.path.exists(os.path.join(ROOT, "grpo_tools.py")),
    reason="needs grpo_tools.py and the embedded tool task (assets/tiny-tools, assets/multiply)",
)
needs_trl = pytest.mark.skipif(
    not os.path.exists(bench_trl.peer_python("grpo")),
    reason="needs the peer environment with trl==1.16.0 (see bench/bench_trl.py)",
)


def trl_arguments(iterations=5):
    cmds = bench_trl_tools.commands(bench_trl_tools.SETTINGS, iterations, "/tmp/x", "envs")
    return trl_tools_runner.arguments(cmds["trl"][2:])


@needs_assets
def test_both_sides_parse_to_grpo_tools_defaults():
    import grpo_tools

    cmds = bench_trl_tools.commands(bench_trl_tools.SETTINGS, 5, "/tmp/x", "envs")
    ours = flat_options(tyro.cli(grpo_tools.Args, args=cmds["ours"][2:], use_underscores=True))
    defaults = flat_options(grpo_tools.Args())
    trl = vars(trl_tools_runner.arguments(cmds["trl"][2:]))
    for key, value in bench_trl_tools.SETTINGS.items():
        theirs = trl[key]
        mine = ours[key]
        if key in ("reward_fn", "tools"):  # ours holds a tuple of specs
            mine = ",".join(mine)
        assert mine == theirs == value, key
        default = defaults[key]
        if key in ("reward_fn", "tools"):
            default = ",".join(default)
        if key == "missing_eos_penalty":  # the one setting moved off grpo_tools.py's default: TRL has no penalty
            assert (default, value) == (1.0, 0.0)
        elif key == "eval_dataset":  # ours: the test.jsonl beside the training data when none is given
            assert default is None and value == "assets/multiply/test.jsonl"
        elif isinstance(value, str) and value.startswith("assets/"):  # ours: absolute paths into assets/
            path, _, function = default.partition(":")
            assert ":".join(filter(None, [os.path.relpath(path, ROOT), function])) == value, key
        else:
            assert default == value, key
    assert ours["total_episodes"] == trl["total_episodes"] == 5 * 32 * 8
    assert ours["eval_every"] == 5  # evaluated before training and after the last iteration only


def test_trl_config_by_hand():
    c = trl_tools_runner.tools_config(trl_arguments(iterations=5))
    # 32 prompts x 8 = 256 completions per generation = 64 per step x 4 steps; 5 iterations = 20 steps
    assert c["per_device_train_batch_size"] * c["steps_per_generation"] == 256
    assert (c["gradient_accumulation_steps"], c["num_iterations"], c["max_steps"], c["logging_steps"]) == (1, 1, 20, 4)
    # 3 policy turns: 2 rounds of tool calls; 48 tokens for the policy's and the tools' together
    assert (c["max_tool_calling_iterations"], c["max_completion_length"], c["num_generations"]) == (2, 48, 8)
    assert (c["learning_rate"], c["beta"], c["weight_decay"], c["adam_epsilon"]) == (2e-4, 0.04, 0.0, 1e-5)
    assert (c["bf16"], c["gradient_checkpointing"], c["lr_scheduler_type"], c["temperature"]) == (
        False,
        False,
        "constant",
        1.0,
    )
    assert (c["num_generations_eval"], c["per_device_eval_batch_size"], c["eval_strategy"]) == (1, 100, "no")


def test_assets_from_another_folder_move_the_model_and_the_data_only(tmp_path):
    moved = bench_trl_tools.with_assets(bench_trl_tools.SETTINGS, str(tmp_path))
    assert moved["model_name_or_path"] == str(tmp_path / "tiny-tools")
    assert moved["dataset"] == str(tmp_path / "multiply" / "train.jsonl")
    assert moved["eval_dataset"] == str(tmp_path / "multiply" / "test.jsonl")
    unmoved = {k: v for k, v in moved.items() if k not in ("model_name_or_path", "dataset", "eval_dataset")}
    assert unmoved == {k: v for k, v in bench_trl_tools.SETTINGS.items() if k in unmoved}
    assert unmoved["tools"] == "assets/tools.py:multiply"  # the repository's tool and reward


def test_a_missing_eos_penalty_is_refused_on_the_trl_side():
    cmd = bench_trl_tools.commands(bench_trl_tools.SETTINGS, 5, "/tmp/x", "envs")["trl"][2:]
    with pytest.raises(SystemExit):
        trl_tools_runner.arguments([*cmd, "--missing_eos_penalty", "1.0"])


@needs_assets
def test_the_response_template_reads_hermes_calls_from_tiny_tools():
    """transformers' parser (this repository's 5.25, as the peer environment's) with the runner's template, on the
    tokens of the conversation the tool task teaches: the call, then the answer after the tool's response."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_TOOLS)
    template = trl_tools_runner.response_template(tokenizer.eos_token)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "37*48="}], tools=[multiply_schema()], add_generation_prompt=True
    )["input_ids"]
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 48}}</tool_call>' + tokenizer.eos_token
    call_ids = tokenizer(call, add_special_tokens=False)["input_ids"]
    parsed = tokenizer.parse_response(call_ids, template, prefix=prompt)
    assert parsed == {  # no content: the turn holds only the call (TRL's wrapper adds "" for the chat template)
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 37, "b": 48}}}],
    }
    response = tokenizer("<tool_response>1776</tool_response>", add_special_tokens=False)["input_ids"]
    answer = tokenizer("1776" + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    parsed = tokenizer.parse_response(answer, template, prefix=prompt + call_ids + response)
    assert parsed == {"role": "assistant", "content": "1776"}


def multiply_schema():
    from transformers.utils import get_json_schema

    sys.path.insert(0, ROOT)
    from assets.tools import multiply

    return get_json_schema(multiply)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_times_and_summaries_by_hand(tmp_path):
    ours = tmp_path / "ours"
    trl = tmp_path / "trl"
    ours.mkdir()
    trl.mkdir()
    calls = {"tools/calls_per_response": 1.0, "objective/score": 0.5}
    write_rows(
        ours / "metrics.jsonl",
        [
            {"iteration": 0, "eval/score": 0.25, "time/elapsed": 1.0},
            {"iteration": 1, "time/elapsed": 4.0, **calls},
            {"iteration": 2, "time/elapsed": 5.5, **calls, "tools/calls_per_response": 0.5},
            {"iteration": 3, "time/elapsed": 7.5, **calls, "objective/score": 0.75},
            {"iteration": 4, "time/elapsed": 20.0, **calls, "eval/score": 0.5},  # its evaluation and save
        ],
    )
    rows = [{"iteration": i, "time/iteration": t, "optimizer_steps": 4, **calls} for i, t in ((1, 9.0), (2, 3.0))]
    write_rows(trl / "metrics.jsonl", rows)
    (trl / "eval.json").write_text(json.dumps([{"eval/score": 0.2}, {"eval/score": 0.4}]))
    # the first iteration left out on both sides, and our last
    assert bench_trl_tools.iteration_times("ours", ours / "metrics.jsonl") == [1.5, 2.0]
    assert bench_trl_tools.iteration_times("trl", trl / "metrics.jsonl") == [3.0]
    settings = bench_trl_tools.SETTINGS
    assert bench_trl_tools.run_summary("ours", ours, settings) == {
        "before": 0.25,
        "after": 0.5,
        "calls": (1.0 + 0.5 + 1.0 + 1.0) / 4,
        "score": (0.5 + 0.5 + 0.75 + 0.5) / 4,
        "steps": 32 * 8 // 64,
    }
    assert bench_trl_tools.run_summary("trl", trl, settings) == {
        "before": 0.2,
        "after": 0.4,
        "calls": 1.0,
        "score": 0.5,
        "steps": 4,
    }


def test_table_by_hand():
    times = {"ours": [[1.0, 2.0, 3.0], [2.0, 4.0]], "trl": [[4.0, 4.0], [5.0, 6.0, 7.0]]}
    peaks = {"ours": [500.0, 520.0], "trl": [600.0, 640.0]}
    summary = {"before": 0.1, "after": 0.2, "calls": 0.9, "score": 0.3, "steps": 4}
    summaries = {"ours": [summary, summary], "trl": [summary, dict(summary, after=0.25)]}
    lines = bench_trl_tools.table(times, peaks, summaries, ["ours", "trl"], 8)
    cells = {line.split("|")[1].strip(): [x.strip() for x in line.split("|")[2:-1]] for line in lines[2:]}
    ours = statistics.median([1.0, 2.0, 3.0, 2.0, 4.0])  # over runs x iterations: 2.0
    trl = statistics.median([4.0, 4.0, 5.0, 6.0, 7.0])  # 5.0
    assert cells["time per iteration, s (median)"] == ["2.00", "5.00", f"**{ours / trl:.2f}x**"]
    assert cells["per-run medians, s"] == ["2.00 / 3.00", "4.00 / 6.00", "0.50x, 0.50x"]
    assert cells["held-out score after 8 iterations (runs)"] == ["0.200 / 0.200", "0.200 / 0.250", ""]
    assert cells["peak resident memory, MB (median)"] == ["510", "620", f"**{510 / 620:.2f}x**"]
    assert cells["optimiser steps per iteration"] == ["4", "4", ""]
    # one side alone: no ratio
    lines = bench_trl_tools.table(times, peaks, {"ours": [summary], "trl": []}, ["ours"], 8)
    cells = {line.split("|")[1].strip(): [x.strip() for x in line.split("|")[2:-1]] for line in lines[2:]}
    assert cells["time per iteration, s (median)"] == ["2.00", "n/a", "**n/a**"]
    assert cells["held-out score before training (runs)"] == ["0.100", "n/a", ""]


def run_quick(tmp_path, *args):
    out = tmp_path / "trl_tools.md"
    command = [sys.executable, os.path.join(ROOT, "bench", "bench_trl_tools.py"), "--quick", "--out", str(out)]
    result = finished([*command, "--runs", str(tmp_path / "runs"), *args], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = out.read_text().splitlines()
    return {line.split("|")[1].strip(): [x.strip() for x in line.split("|")[2:-1]] for line in lines if "|" in line}


@needs_assets
def test_smoke_run_of_our_side(tmp_path):
    cells = run_quick(tmp_path, "--sides=ours")
    assert float(cells["time per iteration, s (median)"][0]) > 0
    assert cells["time per iteration, s (median)"][1:] == ["n/a", "**n/a**"]
    assert 0.0 <= float(cells["held-out score after 3 iterations (runs)"][0]) <= 1.0
    assert cells["optimiser steps per iteration"][0] == "2"  # --quick: 4 prompts x 8 in minibatches of 16


@needs_assets
@needs_trl
def test_smoke_run_against_trl(tmp_path):
    cells = run_quick(tmp_path)
    assert cells["time per iteration, s (median)"][2].endswith("x**")
    assert cells["optimiser steps per iteration"][:2] == ["2", "2"]  # both sides took the same steps
    for side in (0, 1):
        assert 0.0 <= float(cells["held-out score after 3 iterations (runs)"][side]) <= 1.0
