"""The tool task's assets (assets/tiny-tools, assets/multiply, assets/tools.py): the template renders the Hermes
conversation exactly, the tags are whole tokens that decoding keeps, and the shipped policy calls the tool as often as
the build says, with the prompt's factors, and copies its result.

The behavioural checks sample with their own seed and loop, independent of the build's evaluation; the bands are the
build's targets widened by MARGIN for sampling noise.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from assets.build import EOS, TOOL_TAGS, TOOLS_TEMPLATE, ToolsConfig, encode_conversations, make_tool_corpora
from assets.tools import final_answer, multiply

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "assets")
POLICY = os.path.join(ASSETS, "tiny-tools")
N = 300  # test prompts sampled
# Two binomial standard deviations at n = 300 and p = 0.35 (the tool-call share): 2 * sqrt(0.35 * 0.65 / 300) = 0.055.
# The shares of calls with the right arguments and copied results are near 1, where the deviation is smaller.
MARGIN = 0.06
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 48}}</tool_call>'

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def policy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(POLICY), AutoModelForCausalLM.from_pretrained(POLICY).eval()


def schema():
    from transformers.utils import get_json_schema

    return get_json_schema(multiply)


def call(a, b):
    return {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}


def conversation():
    return [
        {"role": "user", "content": "37*48="},
        {"role": "assistant", "content": None, "tool_calls": [call(37, 48)]},
        {"role": "tool", "name": "multiply", "content": "1776"},
        {"role": "assistant", "content": "1776"},
    ]


def read_jsonl(name):
    with open(os.path.join(ASSETS, name)) as f:
        return [json.loads(line) for line in f]


def test_the_template_renders_the_tool_line_hermes_calls_and_tool_responses(policy):
    tok, _ = policy
    assert tok.chat_template == TOOLS_TEMPLATE
    expected = f"37*48={CALL}{EOS}<tool_response>1776</tool_response>1776{EOS}"
    assert tok.apply_chat_template(conversation(), tools=[schema()], tokenize=False) == "multiply(a, b) | " + expected
    assert tok.apply_chat_template(conversation(), tools=[multiply], tokenize=False) == "multiply(a, b) | " + expected
    assert tok.apply_chat_template(conversation(), tokenize=False) == expected
    # a prompt alone: the tools line and the user's text, no generation prompt
    user = [{"role": "user", "content": "37*48="}]
    assert tok.apply_chat_template(user, tools=[schema()], add_generation_prompt=True, tokenize=False) == (
        "multiply(a, b) | 37*48="
    )
    # two calls in one turn, a tool's error text, a second tool, arguments given as a JSON string
    turns = [
        {"role": "system", "content": "be exact "},
        {"role": "user", "content": "12*34="},
        {"role": "assistant", "content": "two ", "tool_calls": [call(12, 34), call(12, "x")]},
        {"role": "tool", "content": "408"},
        {"role": "tool", "content": "error: b must be a whole number"},
        {"role": "assistant", "content": ""},
    ]
    add = {"type": "function", "function": {"name": "add", "parameters": {"properties": {"x": {}, "y": {}}}}}
    assert tok.apply_chat_template(turns, tools=[schema(), add], tokenize=False) == (
        "multiply(a, b) | add(x, y) | be exact 12*34=two "
        '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'
        '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": "x"}}</tool_call>'
        f"{EOS}<tool_response>408</tool_response><tool_response>error: b must be a whole number</tool_response>{EOS}"
    )
    turns[2]["tool_calls"] = [{"type": "function", "function": {"name": "multiply", "arguments": '{"a": 37, "b": 48}'}}]
    assert CALL in tok.apply_chat_template(turns, tokenize=False)


def test_the_tags_are_single_tokens_that_decoding_keeps(policy):
    tok, _ = policy
    for tag in TOOL_TAGS:
        ids = tok(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, tag
        assert tag not in tok.all_special_tokens
        assert tok.decode(ids, skip_special_tokens=True) == tag
    text = tok.apply_chat_template(conversation(), tools=[schema()], tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == text.replace(EOS, "")
    # The JSON words are whole tokens.
    for word in ("name", "arguments", "multiply"):
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1, word


def test_a_conversation_tokenizes_as_its_turns_do(policy):
    """A rollout appends the tokens of each turn and of the tool's response; they must be the conversation's tokens, and
    the SFT loss covers exactly the policy's two turns, each with its EOS."""
    tok, _ = policy
    messages = conversation()
    pieces = [
        tok.apply_chat_template(messages[:1], tools=[schema()], add_generation_prompt=True)["input_ids"],
        tok(CALL + EOS, add_special_tokens=False)["input_ids"],
        tok.apply_chat_template(messages[2:3])["input_ids"],
        tok("1776" + EOS, add_special_tokens=False)["input_ids"],
    ]
    whole = tok.apply_chat_template(messages, tools=[schema()])["input_ids"]
    assert whole == pieces[0] + pieces[1] + pieces[2] + pieces[3]
    [(ids, labels)] = encode_conversations(tok, [messages], [schema()])
    assert ids == whole
    masked = [-100] * len(pieces[0]) + pieces[1] + [-100] * len(pieces[2]) + pieces[3]
    assert labels == masked


def test_the_prompt_sets_hold_products_and_are_held_out():
    train, test = read_jsonl("multiply/train.jsonl"), read_jsonl("multiply/test.jsonl")
    assert (len(train), len(test)) == (4000, 400)
    for row in train + test:
        a, b = re.fullmatch(r"(\d+)\*(\d+)=", row["prompt"]).groups()
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 999
        assert row["answer"] == str(int(a) * int(b))
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}
    # The SFT data never shows a test pair: the build's corpora, remade from its seed.
    corpora = make_tool_corpora(ToolsConfig(n_sft=5000))
    assert corpora["test"] == test
    assert corpora["train"] == train
    sft_prompts = {c[0]["content"] for c in corpora["sft_with_tool"] + corpora["sft_without_tool"]}
    assert not sft_prompts & {r["prompt"] for r in test}


def test_final_answer_reads_the_last_turn():
    responses = [
        "1776",
        " 1776 ",
        "1777",
        f"{CALL}<tool_response>1776</tool_response>1776",
        f"{CALL}<tool_response>1776</tool_response>1767",
        CALL,  # a call nobody answered
        "<tool_response>1776</tool_response><tool_response>12</tool_response>1776",
        "",
    ]
    assert final_answer(responses, ["1776"] * len(responses)) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert final_answer(["1776"], [1776]) == [1.0]  # an answer column read as a number


def sample_turns(tok, model, inputs, max_new_tokens):
    """A turn after each list of token ids at temperature 1; the new ids up to and including the first EOS."""
    enc = tok.pad({"input_ids": inputs}, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    turns = []
    for row in out[:, enc["input_ids"].shape[1] :].tolist():
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        turns.append(row)
    return turns


def test_the_policy_calls_the_tool_sometimes_with_the_prompts_factors_and_copies_it(policy):
    tok, model = policy
    rows = read_jsonl("multiply/test.jsonl")[:N]
    torch.manual_seed(11)
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tools=[schema()]) for r in rows]
    first = sample_turns(tok, model, [p["input_ids"] for p in prompts], 40)
    calls = []
    for row, prompt, turn in zip(rows, prompts, first):
        text = tok.decode(turn, skip_special_tokens=True)
        if "<tool_call>" in text:
            calls.append((row, prompt["input_ids"] + turn, text))
    assert 0.2 - MARGIN <= len(calls) / len(rows) <= 0.5 + MARGIN, len(calls)
    right = []
    for row, ids, text in calls:
        a, b = row["prompt"][:-1].split("*")
        found = re.fullmatch(r"<tool_call>(.*)</tool_call>", text)
        if found and json.loads(found.group(1)) == {"name": "multiply", "arguments": {"a": int(a), "b": int(b)}}:
            right.append((row, ids))
    assert len(right) / len(calls) >= 0.8 - MARGIN, (len(right), len(calls))
    # The tool's response after the call; the final turn copies it.
    replies = [f"<tool_response>{row['answer']}</tool_response>" for row, _ in right]
    inputs = [ids + tok(reply, add_special_tokens=False)["input_ids"] for (_, ids), reply in zip(right, replies)]
    final = sample_turns(tok, model, inputs, 8)
    copied = [tok.decode(t, skip_special_tokens=True) == row["answer"] for (row, _), t in zip(right, final)]
    assert sum(copied) / len(copied) >= 0.9 - MARGIN, (sum(copied), len(copied))
    # Without the tools line the policy seldom calls (it never saw a call there), and its guesses are rarely right.
    plain = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    texts = [tok.decode(t, skip_special_tokens=True) for t in sample_turns(tok, model, plain, 40)]
    assert sum("<tool_call>" in t for t in texts) / len(rows) <= 0.05
    assert sum(final_answer(texts, [r["answer"] for r in rows])) / len(rows) <= 0.1 + MARGIN


def test_the_tiny_tool_build_writes_its_layout_only(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ASSETS, "build.py"), "--tools", "--tiny", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == [
        "multiply/test.jsonl",
        "multiply/train.jsonl",
        "tiny-tools/config.json",
        "tiny-tools/generation_config.json",
        "tiny-tools/model.safetensors",
        "tiny-tools/report.json",
        "tiny-tools/tokenizer.json",
        "tiny-tools/tokenizer_config.json",
    ]
    config = json.loads((tmp_path / "tiny-tools" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == TOOLS_TEMPLATE
    report = json.loads((tmp_path / "tiny-tools" / "report.json").read_text())
    assert report["tiny"] is True
    assert len((tmp_path / "multiply" / "test.jsonl").read_text().splitlines()) == 20
