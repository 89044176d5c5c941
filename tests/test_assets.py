"""The shipped assets (assets/) load offline and have the properties the RL demos rely on.

The behavioural checks recompute everything from the shipped files with their own fixed seeds; they do
not read report.json. The bands are the builder's targets widened by a stated margin for sampling noise.
"""

import json
import os
import random
import socket
import subprocess
import sys

import pytest
import torch

from assets.build import (
    CHAT_TEMPLATE,
    EOS,
    PAD,
    Config,
    all_problems,
    make_corpora,
    make_review,
    review_pairs,
    sentiment,
)
from rlhf_runtime.data import stop_token_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "assets")
SFT = os.path.join(ASSETS, "tiny-sft")
RM = os.path.join(ASSETS, "tiny-rm")
MARGIN = 0.05  # ~1.4 binomial standard deviations at n=200, p=0.4

torch.set_num_threads(2)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test instead of hanging or silently downloading."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def load(path=None, rm_path=None):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path or SFT)
    sft = AutoModelForCausalLM.from_pretrained(path or SFT).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(rm_path or RM).eval()
    return tok, sft, rm


@pytest.fixture(scope="module")
def assets():
    return load()


def read_jsonl(name):
    with open(os.path.join(ASSETS, name)) as f:
        return [json.loads(line) for line in f]


def check_loaded(tok, sft, rm):
    assert tok.pad_token == PAD
    assert tok.eos_token == EOS
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.padding_side == "left"
    for model in (sft, rm):
        assert model.config.pad_token_id == tok.pad_token_id
        assert model.config.eos_token_id == tok.eos_token_id
        assert model.config.max_position_embeddings >= 128
    assert rm.config.num_labels == 1
    gen = sft.generation_config
    assert gen.top_k in (None, 0)
    assert gen.top_p in (None, 1.0)
    assert gen.temperature in (None, 1.0)


def test_shipped_assets_load_offline(no_network):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    check_loaded(*load())
    for name in ("reviews/train.jsonl", "reviews/test.jsonl", "arithmetic/train.jsonl", "arithmetic/test.jsonl"):
        assert os.path.exists(os.path.join(ASSETS, name)), name


def test_prompt_sets_load_with_datasets():
    from datasets import load_dataset

    reviews = load_dataset(
        "json", data_files={s: os.path.join(ASSETS, f"reviews/{s}.jsonl") for s in ("train", "test")}
    )
    arith = load_dataset(
        "json", data_files={s: os.path.join(ASSETS, f"arithmetic/{s}.jsonl") for s in ("train", "test")}
    )
    assert len(reviews["train"]) >= 1000
    assert len(reviews["test"]) >= 100
    assert len(arith["train"]) >= 1000
    assert len(arith["test"]) >= 100
    assert isinstance(arith["test"][0]["answer"], str)
    # Held out: no test operand pair appears in the train prompts.
    assert not set(arith["test"]["prompt"]) & set(arith["train"]["prompt"])
    for row in arith["test"]:
        if "+" in row["prompt"]:
            a, _, b = row["prompt"][:-1].partition("+")
            expected = int(a) + int(b)
        else:
            a, _, b = row["prompt"][:-1].partition("-")
            expected = int(a) - int(b)
        assert str(expected) == row["answer"]


def test_tokenizer_round_trips_task_text(assets):
    tok, _, _ = assets
    rng = random.Random(7)
    reviews = [make_review(rng) for _ in range(300)]
    arith = [(r["prompt"], r["answer"]) for r in read_jsonl("arithmetic/test.jsonl")[:200]]
    prompts = [r["prompt"] for r in read_jsonl("reviews/test.jsonl")[:200]]
    specials = {tok.pad_token_id, tok.eos_token_id}
    for text in prompts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert not specials & set(ids)
    for prompt, cont in reviews + arith:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        c = tok(cont, add_special_tokens=False)["input_ids"]
        full = tok(prompt + cont, add_special_tokens=False)["input_ids"]
        assert full == p + c, (prompt, cont)  # tokens of the concatenation = concatenated tokens
        assert tok.decode(full, skip_special_tokens=True) == prompt + cont
        assert tok.decode(c, skip_special_tokens=True) == cont
        assert not specials & set(full)
    # EOS written as text is recognised as the special token (the RM reads "... .<|endoftext|>").
    assert tok("the plot was dull ." + EOS, add_special_tokens=False)["input_ids"][-1] == tok.eos_token_id
    # Digits are single tokens so that arithmetic is column-wise.
    assert len(tok("1234567890", add_special_tokens=False)["input_ids"]) == 10


def test_the_chat_template_renders_a_users_message_as_the_plain_prompt_the_policy_was_trained_on(assets):
    """TRL's and verl's data hold prompts as messages: each prompt of both tasks as one user message renders to the
    prompt's own text and tokens; a conversation is its contents in order, an assistant's turn ended by EOS as every
    training text was; the end of turn adds no stop token (EOS alone ends a response)."""
    tok, _, _ = assets
    assert tok.chat_template == CHAT_TEMPLATE
    rows = read_jsonl("arithmetic/train.jsonl") + read_jsonl("arithmetic/test.jsonl") + read_jsonl("reviews/test.jsonl")
    for prompt in [r["prompt"] for r in rows]:
        messages = [{"role": "user", "content": prompt}]
        assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == prompt
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert ids == tok(prompt, add_special_tokens=False)["input_ids"]
    turns = [
        {"role": "system", "content": "be brief "},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
    ]
    assert tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False) == f"be brief 1+1=2{EOS}2+2="
    assert stop_token_ids(tok, SFT).tolist() == [tok.eos_token_id]


def generate(tok, model, prompts, max_new_tokens, seed):
    torch.manual_seed(seed)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
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
    new = out[:, enc["input_ids"].shape[1] :]
    return [tok.decode(r, skip_special_tokens=True) for r in new], [(r == tok.eos_token_id).any().item() for r in new]


def test_sft_arithmetic_is_imperfect_but_fluent(assets):
    tok, sft, _ = assets
    rows = random.Random(1).sample(read_jsonl("arithmetic/test.jsonl"), 200)
    texts, ended = generate(tok, sft, [r["prompt"] for r in rows], 6, seed=1)
    acc = sum(t.strip() == r["answer"] for t, r in zip(texts, rows)) / len(rows)
    assert 0.25 - MARGIN <= acc <= 0.60 + MARGIN, acc
    assert sum(ended) / len(ended) >= 0.95


def test_sft_reviews_are_half_positive_and_fluent(assets):
    tok, sft, _ = assets
    prompts = [r["prompt"] for r in random.Random(2).sample(read_jsonl("reviews/test.jsonl"), 200)]
    texts, ended = generate(tok, sft, prompts, 24, seed=2)
    pos = sum(sentiment(t) > 0 for t in texts) / len(texts)
    assert 0.35 <= pos <= 0.65, pos
    assert sum(ended) / len(ended) >= 0.95


def rm_score(tok, rm, texts):
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        return rm(**enc).logits[:, 0]


def test_rm_ranks_fresh_pairs_and_tracks_sentiment(assets):
    tok, _, rm = assets
    pairs = review_pairs(random.Random(12345), 500)
    r_c = rm_score(tok, rm, [c for c, _ in pairs])
    r_r = rm_score(tok, rm, [r for _, r in pairs])
    assert (r_c > r_r).float().mean().item() >= 0.9
    rng = random.Random(54321)
    texts = [p + c + EOS for p, c in (make_review(rng) for _ in range(300))]
    scores = rm_score(tok, rm, texts)
    corr = torch.corrcoef(torch.stack([scores, torch.tensor([sentiment(t) for t in texts])]))[0, 1]
    assert corr.item() >= 0.8, corr.item()
    assert scores.abs().max().item() < 10  # the head was rescaled to unit std on SFT samples
    # More positive words, higher reward.
    ladder = ["the food was bland .", "the food was okay .", "the food was tasty .", "the food was tasty and fresh ."]
    s = rm_score(tok, rm, [t + EOS for t in ladder])
    assert all(s[i] < s[i + 1] for i in range(len(s) - 1)), s


def padded_batch(tok, texts, left, right):
    """[pad]*left + tokens + [pad]*right for each text, with mask and position_ids = cumsum(mask) - 1."""
    seqs = [
        [tok.pad_token_id] * n_left + tok(t, add_special_tokens=False)["input_ids"] + [tok.pad_token_id] * n_right
        for t, n_left, n_right in zip(texts, left, right)
    ]
    width = max(map(len, seqs))
    rows = [s + [tok.pad_token_id] * (width - len(s)) for s in seqs]
    ids = torch.tensor(rows)
    mask = (ids != tok.pad_token_id).long()
    return ids, mask, mask.cumsum(-1) - 1


def test_rm_score_is_padding_invariant(assets):
    tok, _, rm = assets
    texts = ["the plot was dull .", "honestly , the room was clean and quiet but the pool was dirty ."]
    texts = [t + EOS for t in texts] + ["this phone was great ." + EOS]
    with torch.no_grad():
        alone = torch.stack([rm(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0] for t in texts])
        ids, mask, pos = padded_batch(tok, texts, left=[3, 0, 5], right=[2, 4, 0])
        batched = rm(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, 0]
    assert torch.allclose(alone, batched, atol=1e-4), (alone, batched)


def test_sft_logits_are_padding_invariant(assets):
    tok, sft, _ = assets
    text = "i thought the soup was"
    with torch.no_grad():
        alone = sft(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, -1]
        ids, mask, pos = padded_batch(tok, [text, "the view was"], left=[4, 0], right=[0, 0])
        batched = sft(input_ids=ids, attention_mask=mask, position_ids=pos.clamp(min=0)).logits[0, -1]
    assert torch.allclose(alone, batched, atol=1e-4)


def test_corpora_are_deterministic_in_the_seed():
    small = dict(
        n_sft_reviews=200,
        n_sft_arith=200,
        n_arith_test=50,
        n_arith_train=100,
        n_review_train=50,
        n_review_test=20,
        n_rm_train_pairs=50,
        n_rm_test_pairs=20,
    )
    a = make_corpora(Config(seed=3, **small))
    b = make_corpora(Config(seed=3, **small))
    c = make_corpora(Config(seed=4, **small))
    assert a == b
    assert all(a[k] != c[k] for k in a)
    # SFT arithmetic never shows a held-out operand pair.
    test_prompts = {p for p, _ in a["arith_test"]}
    assert not test_prompts & {p for p, _ in a["sft_arith"]}
    assert len(all_problems()) == 100 * 100 + 5050


def test_tiny_build_runs_end_to_end(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ASSETS, "build.py"), "--tiny", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in (
        "tiny-sft/model.safetensors",
        "tiny-sft/config.json",
        "tiny-sft/tokenizer.json",
        "tiny-sft/generation_config.json",
        "tiny-rm/model.safetensors",
        "tiny-rm/tokenizer.json",
        "reviews/train.jsonl",
        "reviews/test.jsonl",
        "arithmetic/train.jsonl",
        "arithmetic/test.jsonl",
        "report.md",
        "report.json",
    ):
        assert (tmp_path / name).exists(), name
    check_loaded(*load(str(tmp_path / "tiny-sft"), str(tmp_path / "tiny-rm")))
    # the shipped tokenizer settings are the build's, its chat template with them; the reward model's has none
    configs = {}
    for name in ("tiny-sft", "tiny-rm"):
        configs[name] = (tmp_path / name / "tokenizer_config.json").read_text()
        assert configs[name] == open(os.path.join(ASSETS, name, "tokenizer_config.json")).read(), name
    assert json.loads(configs["tiny-sft"])["chat_template"] == CHAT_TEMPLATE
    assert "chat_template" not in json.loads(configs["tiny-rm"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tiny"] is True
    assert report["total_bytes"] > 0
