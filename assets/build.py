"""Build the embedded default assets: two toy tasks, a tokenizer, an SFT policy and a reward model; a tool task apart.

Everything the RLHF scripts need to run offline on a CPU is generated here from scratch, with a fixed
seed, in a few minutes. Nothing is downloaded.

The world
---------
* **reviews** -- one-sentence reviews of films, products, restaurants, hotels and books, drawn from a
  small grammar, e.g. ``"the acting was clever and the plot was dull ."``. Every adjective has a known
  polarity in ``LEXICON`` (+1 positive, -1 negative, 0 neutral), so ``sentiment(text)`` (the sum of
  the word scores) is the ground truth a reward model should learn. A *prompt* is the opening of a
  review up to and including its verb (``"the acting was"``); the *continuation* is the rest, starting
  with a space (``" clever and the plot was dull ."``), followed by the EOS token. ``prompt +
  continuation`` is always the full text, and because the tokenizer splits words with their leading
  space, the tokens of the concatenation are the concatenation of the tokens.
  A review has a mood (positive or negative, 50/50) that most of its adjectives follow; a "but"
  clause flips it. 44% of grammar reviews have sentiment > 0, 44% < 0 and 12% exactly 0.
* **arithmetic** -- ``"37+58="`` -> ``"95"`` and ``"61-24="`` -> ``"37"`` with operands 0..99 and
  non-negative differences. The continuation is the answer (no space), then EOS. A fixed set of
  operand pairs is held out for the test prompts and never appears in SFT training.
* **multiply** (``--tools``, a build of its own) -- ``"37*48="`` -> ``"1776"`` with a in 10..99 and b in
  10..999, products the tiny policy cannot compute, and the ``multiply`` tool of ``tools.py`` that computes
  them. The policy calls it in the Hermes form and copies its result (see ``TOOLS_TEMPLATE``).

The models
----------
* ``tiny-sft/``: a ~1.5M parameter ``LlamaForCausalLM`` trained on both tasks mixed. Its training data
  is deliberately imperfect so that RL has something to fix: a fraction ``corrupt`` of the arithmetic
  answers are off by a small amount (+-1, +-2, +-10), so sampling at temperature 1 is right only about
  ``1 - corrupt`` of the time even though the greedy answer is usually right; and the reviews are
  half positive, half negative.
* ``tiny-rm/``: a ``LlamaForSequenceClassification`` (``num_labels=1``) initialised from the SFT
  backbone and trained with the Bradley-Terry loss ``-logsigmoid(r_chosen - r_rejected)`` on pairs of
  grammar reviews sharing a prompt (the more positive one is chosen; ties are skipped). It reads
  ``prompt + continuation + "<|endoftext|>"`` and is scored at the last non-pad token (the EOS), so it
  works with left and right padding. A small centring penalty keeps the mean score near 0, and after
  training the score head is rescaled so that scores on SFT samples have standard deviation 1.
* ``tiny-tools/``: a ``LlamaForCausalLM`` with its own tokenizer (the four tool tags added whole) and chat
  template, trained from scratch on conversations: given the tool it calls it in a share ``call`` of them
  (and then copies the result), else it guesses a number of the product's size that is usually wrong.
  Multi-turn GRPO has the calls to reinforce; without the tool, nothing to find.

Usage
-----
    python assets/build.py                      # full build into assets/ (a few minutes on 2 cores)
    python assets/build.py --tiny --out DIR     # seconds; same layout, useless models (for CI)
    python assets/build.py --tools              # the tool task alone: tiny-tools/ and multiply/ (minutes)
    python assets/build.py --tools --tiny --out DIR

Layout written into ``--out`` (default: this folder)::

    tiny-sft/   model.safetensors, config.json, generation_config.json, tokenizer files (with CHAT_TEMPLATE)
    tiny-rm/    model.safetensors, config.json, tokenizer files
    reviews/train.jsonl, reviews/test.jsonl          {"prompt": ...}
    arithmetic/train.jsonl, arithmetic/test.jsonl    {"prompt": ..., "answer": ...}
    report.md, report.json
    tiny-tools/ model, tokenizer files (with TOOLS_TEMPLATE), report.json     (--tools only)
    multiply/train.jsonl, multiply/test.jsonl        {"prompt": ..., "answer": ...}   (--tools only)

``report.json`` keys: ``seed``, ``tiny``, ``build_seconds``, ``sft_params``, ``rm_params``,
``vocab_size``, ``arith_acc_t1`` (exact match on test prompts, temperature 1), ``arith_acc_greedy``,
``arith_eos_rate``, ``review_pos_rate`` (fraction of sampled continuations with sentiment > 0),
``review_eos_rate`` (fraction ending with EOS within ``REVIEW_MAX_NEW`` tokens), ``rm_pair_acc``
(held-out pairs), ``rm_sentiment_corr`` (Pearson, RM score vs sentiment on fresh grammar reviews),
``rm_score_mean`` / ``rm_score_std`` (on SFT samples, after rescaling), ``rm_scale`` (the factor the
head was multiplied by), ``sizes_bytes`` (per folder) and ``total_bytes``. ``tiny-tools/report.json``
holds the tool policy's numbers on the test prompts at temperature 1, played as a multi-turn rollout
(``play``): ``tool_call_rate``, ``tool_args_right`` and ``tool_result_copied`` (shares of the calls),
``acc_with_tool`` and ``acc_without_tool`` (``final_answer``), ``tool_call_rate_without_tool``.

Importing this module is cheap and has no side effects; tests and scripts use ``sentiment``,
``make_corpora``, ``sample`` and the constants.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
EOS = "<|endoftext|>"
PAD = "<|pad|>"
REVIEW_MAX_NEW = 24  # new-token budget for a review continuation (the longest grammar one is ~20)
ARITH_MAX_NEW = 6  # "198" + EOS needs 4
# The policy's chat template: messages rendered as the plain text it was trained on, so that data whose prompts are
# messages (TRL's, verl's) trains as the same prompts written as text. Each message's content in order, nothing
# between; an assistant's turn ends with EOS as every training text did; no generation prompt (the answer follows the
# prompt directly). A system message's text stands before the user's: the policy never saw one.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)

# ----------------------------------------------------------------------------------------------
# The reviews grammar and its lexicon
# ----------------------------------------------------------------------------------------------

GENERIC = {
    +1: "wonderful great excellent superb brilliant lovely fantastic amazing delightful good enjoyable impressive",
    -1: "awful terrible horrible dreadful bad poor disappointing boring mediocre weak annoying lousy",
    0: "okay average ordinary typical standard",
}
# domain -> (aspects, items, positive adjectives, negative adjectives)
DOMAINS = {
    "film": (
        "acting plot ending soundtrack dialogue pacing cast script cinematography villain",
        "film movie sequel documentary thriller",
        "clever gripping moving funny stunning",
        "dull predictable clumsy slow confusing",
    ),
    "product": (
        "battery screen camera keyboard speaker charger design price case software",
        "phone laptop tablet headset blender",
        "reliable sturdy sleek fast bright",
        "flimsy broken slow glitchy cheap",
    ),
    "restaurant": (
        "food service soup pasta dessert waiter menu staff pizza coffee",
        "restaurant cafe bistro diner bakery",
        "tasty fresh friendly delicious cozy",
        "bland stale rude greasy cold",
    ),
    "hotel": (
        "room bed pool breakfast view lobby shower staff location wifi",
        "hotel hostel resort inn motel",
        "clean spacious quiet comfortable cozy",
        "dirty cramped noisy smelly cold",
    ),
    "book": (
        "story writing characters prose ending chapter plot dialogue narrator cover",
        "book novel memoir biography sequel",
        "gripping clever moving vivid beautiful",
        "dull predictable confusing shallow tedious",
    ),
}
INTENSIFIERS = "very really quite rather".split()
# Openings; the prompt is everything up to and including the verb.
OPENINGS = [
    "the {a} was",
    "the {a} of the {i} was",
    "i thought the {a} was",
    "honestly , the {a} was",
    "this {i} was",
    "overall the {i} was",
]


def _build_lexicon() -> dict[str, int]:
    lex: dict[str, int] = {}
    for pol, words in GENERIC.items():
        for w in words.split():
            lex[w] = pol
    for _, _, pos, neg in DOMAINS.values():
        for pol, words in ((+1, pos), (-1, neg)):
            for w in words.split():
                # A word shared by two domains must keep one polarity, or sentiment() is ill-defined.
                assert lex.get(w, pol) == pol, w
                lex[w] = pol
    return lex


LEXICON = _build_lexicon()


def sentiment(text: str) -> float:
    """Lexicon score of a review: (#positive words) - (#negative words). Unknown words count 0.

    Special tokens and punctuation are ignored, so it can be applied to a prompt, a continuation or a
    decoded model sample alike.
    """
    return float(sum(LEXICON.get(w, 0) for w in text.replace(EOS, " ").replace(PAD, " ").split()))


def _adjectives(rng: random.Random, domain: str, mood: int, k: int) -> str:
    """k adjectives that mostly follow `mood`: "x", "x and y" or "x , y and z"."""
    _, _, pos, neg = DOMAINS[domain]
    pools = {+1: GENERIC[+1].split() + pos.split(), -1: GENERIC[-1].split() + neg.split(), 0: GENERIC[0].split()}
    words, used = [], set()
    while len(words) < k:
        pol = rng.choices([mood, 0, -mood], weights=[0.85, 0.1, 0.05])[0]
        word = rng.choice(pools[pol])
        if word in used:  # "great and great" is not fluent
            continue
        used.add(word)
        if rng.random() < 0.2:
            word = rng.choice(INTENSIFIERS) + " " + word
        words.append(word)
    if k == 1:
        return words[0]
    return " , ".join(words[:-1]) + " and " + words[-1]


def review_continuation(rng: random.Random, domain: str) -> str:
    """The rest of a review about `domain`, starting with a space and ending with " ."."""
    # Slightly more positive moods than negative: ties and "but" clauses pull the share of reviews with
    # sentiment > 0 below the share of positive moods, and the SFT model should write about half positive.
    mood = rng.choices([+1, -1], weights=[0.56, 0.44])[0]
    cont = " " + _adjectives(rng, domain, mood, rng.choices([1, 2, 3], weights=[0.5, 0.35, 0.15])[0])
    clause = rng.choices(["", "and", "but"], weights=[0.45, 0.4, 0.15])[0]
    if clause:
        # "but" introduces the opposite opinion about another aspect.
        mood2 = mood if clause == "and" else -mood
        k2 = rng.choices([1, 2], weights=[0.7, 0.3])[0]
        cont += f" {clause} the {rng.choice(DOMAINS[domain][0].split())} was {_adjectives(rng, domain, mood2, k2)}"
    return cont + " ."


def review_prompt(rng: random.Random) -> tuple[str, str]:
    """(domain, prompt): the opening of a review, up to and including its verb."""
    domain = rng.choice(sorted(DOMAINS))
    aspects, items = DOMAINS[domain][0].split(), DOMAINS[domain][1].split()
    return domain, rng.choice(OPENINGS).format(a=rng.choice(aspects), i=rng.choice(items))


def make_review(rng: random.Random) -> tuple[str, str]:
    """One (prompt, continuation) pair from the grammar; prompt + continuation is the full review."""
    domain, prompt = review_prompt(rng)
    return prompt, review_continuation(rng, domain)


# ----------------------------------------------------------------------------------------------
# Arithmetic
# ----------------------------------------------------------------------------------------------


def all_problems() -> list[tuple[str, str]]:
    """Every (prompt, answer) with operands 0..99: a+b, and a-b for a >= b."""
    probs = []
    for a in range(100):
        for b in range(100):
            probs.append((f"{a}+{b}=", str(a + b)))
            if a >= b:
                probs.append((f"{a}-{b}=", str(a - b)))
    return probs


def corrupt_answer(rng: random.Random, answer: str) -> str:
    """A plausible wrong answer: off by 1, 2 or 10, kept non-negative."""
    value, delta = int(answer), rng.choice([1, 2, 10])
    if rng.random() < 0.5 and value - delta >= 0:
        return str(value - delta)
    return str(value + delta)


# ----------------------------------------------------------------------------------------------
# Configuration and corpora
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    seed: int = 0
    # corpora
    n_sft_reviews: int = 60_000
    n_sft_arith: int = 120_000
    corrupt: float = 0.5  # fraction of SFT arithmetic answers that are wrong
    n_arith_test: int = 400
    n_arith_train: int = 4000
    n_review_train: int = 4000
    n_review_test: int = 400
    n_rm_train_pairs: int = 20_000
    n_rm_test_pairs: int = 1000
    # tokenizer / model
    vocab_size: int = 800  # more than needed: training stops at ~784, every grammar word whole
    hidden: int = 160
    layers: int = 4
    heads: int = 4
    intermediate: int = 448
    # training
    sft_steps: int = 2500
    # Per step, one batch of each task. Arithmetic needs far more examples to learn carrying than the
    # grammar needs to be fluent, and its sequences are short, so it gets the bigger batch.
    sft_batch_arith: int = 128
    sft_batch_reviews: int = 64
    sft_lr: float = 3e-3
    rm_steps: int = 300
    rm_batch: int = 64  # pairs per step
    rm_lr: float = 1e-3
    rm_center: float = 0.01  # coefficient of the mean((r_c + r_r)^2) centring penalty
    # evaluation
    n_eval: int = 400


TINY = dict(
    n_sft_reviews=300,
    n_sft_arith=300,
    n_arith_test=20,
    n_arith_train=50,
    n_review_train=50,
    n_review_test=20,
    n_rm_train_pairs=100,
    n_rm_test_pairs=40,
    vocab_size=300,
    hidden=32,
    layers=1,
    heads=2,
    intermediate=64,
    sft_steps=5,
    sft_batch_arith=16,
    sft_batch_reviews=16,
    rm_steps=5,
    rm_batch=16,
    n_eval=20,
)


def review_pairs(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """(chosen, rejected) full texts ending in EOS that share a prompt; chosen is strictly more positive.

    Sharing the prompt mirrors how PPO uses the RM (comparing continuations of one prompt) and
    forces it to read the continuation rather than the opening.
    """
    pairs = []
    while len(pairs) < n:
        domain, prompt = review_prompt(rng)
        c1, c2 = review_continuation(rng, domain), review_continuation(rng, domain)
        s1, s2 = sentiment(c1), sentiment(c2)
        if s1 == s2:
            continue
        hi, lo = (c1, c2) if s1 > s2 else (c2, c1)
        pairs.append((prompt + hi + EOS, prompt + lo + EOS))
    return pairs


def make_corpora(cfg: Config) -> dict:
    """All text the builder uses, as plain Python lists; a pure function of cfg (seed included)."""
    rng = random.Random(cfg.seed)
    probs = all_problems()
    rng.shuffle(probs)
    test, pool = probs[: cfg.n_arith_test], probs[cfg.n_arith_test :]
    sft_arith = []
    for _ in range(cfg.n_sft_arith):
        prompt, answer = rng.choice(pool)
        if rng.random() < cfg.corrupt:
            answer = corrupt_answer(rng, answer)
        sft_arith.append((prompt, answer))
    return {
        "sft_reviews": [make_review(rng) for _ in range(cfg.n_sft_reviews)],
        "sft_arith": sft_arith,
        "arith_train": pool[: cfg.n_arith_train],
        "arith_test": test,
        "review_train": [make_review(rng)[0] for _ in range(cfg.n_review_train)],
        "review_test": [make_review(rng)[0] for _ in range(cfg.n_review_test)],
        "rm_train": review_pairs(rng, cfg.n_rm_train_pairs),
        "rm_test": review_pairs(rng, cfg.n_rm_test_pairs),
    }


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with every digit its own token; ids 0 and 1 are EOS and PAD.

    Byte-level pre-tokenisation keeps each word's leading space inside its token, so decoding is exact
    and a continuation that starts with a space tokenises the same alone as after its prompt. Splitting
    digits individually (and never merging them) lets the model learn column-wise arithmetic.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte stays encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",  # prompts are left-padded for generation
        clean_up_tokenization_spaces=False,  # " ." must stay " ." or round-tripping breaks
        model_input_names=["input_ids", "attention_mask"],
    )


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def llama_config(cfg: Config, tok):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,  # there is no BOS: sequences start with their first word
    )


def pad_right(seqs: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [value] * (width - len(s)) for s in seqs])


def encode_lm(tok, pairs: list[tuple[str, str]], loss_on_prompt: bool) -> list[tuple[list[int], list[int]]]:
    """Tokenise (prompt, continuation) into (input_ids, labels) with EOS appended.

    Arithmetic prompts are uniformly random operands, so predicting them only wastes capacity: their
    labels are masked. Review prompts are grammar text worth learning, so the loss covers everything.
    """
    prompts = tok([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    conts = tok([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    out = []
    for p, c in zip(prompts, conts):
        ids = p + c + [tok.eos_token_id]
        labels = (p if loss_on_prompt else [-100] * len(p)) + c + [tok.eos_token_id]
        out.append((ids, labels))
    return out


def lm_loss(model, batch: list[tuple[list[int], list[int]]], pad_id: int) -> torch.Tensor:
    ids = pad_right([b[0] for b in batch], pad_id)
    labels = pad_right([b[1] for b in batch], -100)
    logits = model(input_ids=ids, attention_mask=ids != pad_id).logits  # right padding: RoPE positions stay 0..n-1
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the peak."""
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_sft(cfg: Config, tok, corpora: dict, log=print):
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(llama_config(cfg, tok))
    reviews = encode_lm(tok, corpora["sft_reviews"], loss_on_prompt=True)
    arith = encode_lm(tok, corpora["sft_arith"], loss_on_prompt=False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(cfg.seed + 1)
    model.train()
    t0 = time.time()
    for step in range(cfg.sft_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.sft_steps, cfg.sft_lr)
        # One batch per task, padded separately: arithmetic sequences are much shorter than reviews.
        loss_r = lm_loss(model, rng.sample(reviews, cfg.sft_batch_reviews), tok.pad_token_id)
        loss_a = lm_loss(model, rng.sample(arith, cfg.sft_batch_arith), tok.pad_token_id)
        opt.zero_grad(set_to_none=True)
        (loss_r + loss_a).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == cfg.sft_steps - 1:
            log(
                f"sft step {step:5d}  reviews {loss_r.item():.3f}  arithmetic {loss_a.item():.3f}  "
                f"{time.time() - t0:.0f}s"
            )
    model.eval()
    return model


def rm_scores(rm, tok, texts: list[str], batch_size: int = 256) -> torch.Tensor:
    """Reward for each full text (which should end in EOS), batched with left padding."""
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            out.append(rm(**enc).logits[:, 0])
    return torch.cat(out) if out else torch.zeros(0)


def train_rm(cfg: Config, tok, sft, corpora: dict, log=print):
    """Bradley-Terry reward model initialised from the SFT backbone (a fresh scalar head)."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(cfg.seed + 2)
    config = llama_config(cfg, tok)
    config.num_labels = 1
    rm = LlamaForSequenceClassification(config)
    rm.model.load_state_dict(sft.model.state_dict())
    torch.nn.init.normal_(rm.score.weight, std=0.02)
    pairs = corpora["rm_train"]
    chosen = tok([c for c, _ in pairs], add_special_tokens=False)["input_ids"]
    rejected = tok([r for _, r in pairs], add_special_tokens=False)["input_ids"]
    opt = torch.optim.AdamW(rm.parameters(), lr=cfg.rm_lr, weight_decay=0.01)
    rng = random.Random(cfg.seed + 3)
    rm.train()
    t0 = time.time()
    for step in range(cfg.rm_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.rm_steps, cfg.rm_lr)
        idx = rng.sample(range(len(pairs)), cfg.rm_batch)
        # Chosen and rejected go through in one batch; the head reads the last non-pad token (EOS).
        ids = pad_right([chosen[i] for i in idx] + [rejected[i] for i in idx], tok.pad_token_id)
        r = rm(input_ids=ids, attention_mask=ids != tok.pad_token_id).logits[:, 0]
        r_c, r_r = r[: len(idx)], r[len(idx) :]
        # Bradley-Terry, plus a small penalty on the pair mean: BT alone is blind to a constant shift.
        loss = -F.logsigmoid(r_c - r_r).mean() + cfg.rm_center * ((r_c + r_r) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(rm.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == cfg.rm_steps - 1:
            acc = (r_c > r_r).float().mean().item()
            log(f"rm step {step:5d}  loss {loss.item():.3f}  batch acc {acc:.2f}  {time.time() - t0:.0f}s")
    rm.eval()
    return rm


# ----------------------------------------------------------------------------------------------
# Sampling and evaluation
# ----------------------------------------------------------------------------------------------


def generation_config(tok, **overrides):
    """Plain ancestral sampling: temperature 1, and explicitly no top-k / top-p filtering."""
    from transformers import GenerationConfig

    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=REVIEW_MAX_NEW,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    kwargs.update(overrides)
    return GenerationConfig(**kwargs)


def sample(
    model, tok, prompts: list[str], max_new_tokens: int, greedy: bool = False, seed: int = 0, batch_size: int = 200
) -> list[tuple[str, bool]]:
    """(decoded continuation, ended with EOS) for each prompt; KV-cached, left-padded batches."""
    gen_cfg = generation_config(tok, max_new_tokens=max_new_tokens)
    if greedy:
        gen_cfg = generation_config(
            tok, max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_k=None, top_p=None
        )
    torch.manual_seed(seed)
    out = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            enc = tok(prompts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            gen = model.generate(**enc, generation_config=gen_cfg)
            for row in gen[:, enc["input_ids"].shape[1] :]:
                ended = bool((row == tok.eos_token_id).any())
                out.append((tok.decode(row, skip_special_tokens=True), ended))
    return out


def pearson(x: list[float], y: list[float]) -> float:
    t = torch.tensor([x, y], dtype=torch.float64)
    return float(torch.corrcoef(t)[0, 1])


def evaluate_sft(cfg: Config, sft, tok, corpora: dict) -> tuple[dict, list[str]]:
    """SFT metrics on held-out prompts; also returns the EOS-terminated review samples for the RM."""
    arith = corpora["arith_test"][: cfg.n_eval]
    prompts, answers = [p for p, _ in arith], [a for _, a in arith]
    t1 = sample(sft, tok, prompts, ARITH_MAX_NEW, seed=cfg.seed)
    greedy = sample(sft, tok, prompts, ARITH_MAX_NEW, greedy=True)
    review_prompts = corpora["review_test"][: cfg.n_eval]
    reviews = sample(sft, tok, review_prompts, REVIEW_MAX_NEW, seed=cfg.seed)
    n = max(1, len(arith))
    metrics = {
        "arith_acc_t1": sum(t.strip() == a for (t, _), a in zip(t1, answers)) / n,
        "arith_acc_greedy": sum(t.strip() == a for (t, _), a in zip(greedy, answers)) / n,
        "arith_eos_rate": sum(e for _, e in t1) / n,
        "review_pos_rate": sum(sentiment(t) > 0 for t, _ in reviews) / max(1, len(reviews)),
        "review_eos_rate": sum(e for _, e in reviews) / max(1, len(reviews)),
    }
    finished = [p + t + EOS for p, (t, e) in zip(review_prompts, reviews) if e]
    return metrics, finished


def calibrate_and_evaluate_rm(cfg: Config, rm, tok, corpora: dict, sft_texts: list[str]) -> dict:
    """Rescale the head so SFT-sample scores have std 1, then measure the RM."""
    scores = rm_scores(rm, tok, sft_texts)
    scale = 1.0 / float(scores.std()) if len(scores) > 1 and float(scores.std()) > 0 else 1.0
    with torch.no_grad():
        rm.score.weight.mul_(scale)  # a positive rescale changes no ranking, only the scale PPO sees
    scores = scores * scale
    pairs = corpora["rm_test"]
    r_c = rm_scores(rm, tok, [c for c, _ in pairs])
    r_r = rm_scores(rm, tok, [r for _, r in pairs])
    rng = random.Random(cfg.seed + 4)
    fresh = [p + c + EOS for p, c in (make_review(rng) for _ in range(cfg.n_eval))]
    return {
        "rm_pair_acc": float((r_c > r_r).float().mean()),
        "rm_sentiment_corr": pearson(rm_scores(rm, tok, fresh).tolist(), [sentiment(t) for t in fresh]),
        "rm_score_mean": float(scores.mean()),
        "rm_score_std": float(scores.std()) if len(scores) > 1 else 0.0,
        "rm_scale": scale,
    }


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def write_jsonl(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def write_report(out: str, report: dict) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    rows = [
        ("SFT parameters", f"{report['sft_params']:,}"),
        ("RM parameters", f"{report['rm_params']:,}"),
        ("vocabulary", report["vocab_size"]),
        ("SFT arithmetic accuracy, T=1 (test prompts)", f"{report['arith_acc_t1']:.3f}"),
        ("SFT arithmetic accuracy, greedy", f"{report['arith_acc_greedy']:.3f}"),
        ("SFT arithmetic EOS rate", f"{report['arith_eos_rate']:.3f}"),
        ("SFT review positive rate (sentiment > 0), T=1", f"{report['review_pos_rate']:.3f}"),
        (f"SFT review EOS rate (within {REVIEW_MAX_NEW} tokens)", f"{report['review_eos_rate']:.3f}"),
        ("RM held-out pair accuracy", f"{report['rm_pair_acc']:.3f}"),
        ("RM score vs sentiment, Pearson r", f"{report['rm_sentiment_corr']:.3f}"),
        ("RM score on SFT samples, mean / std", f"{report['rm_score_mean']:.2f} / {report['rm_score_std']:.2f}"),
        ("RM head rescale factor", f"{report['rm_scale']:.3f}"),
    ]
    rows += [(f"size of {name}/", mib(b)) for name, b in report["sizes_bytes"].items()]
    rows += [("total size", mib(report["total_bytes"])), ("build time", f"{report['build_seconds']:.0f} s")]
    title = "tiny build (CI smoke test, models untrained)" if report["tiny"] else f"seed {report['seed']}"
    lines = [f"## Embedded default assets ({title})", "", "| quantity | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return text


def build(cfg: Config, out: str, tiny: bool = False, log=print) -> dict:
    t0 = time.time()
    corpora = make_corpora(cfg)
    log(
        f"corpora: {len(corpora['sft_reviews'])} reviews, {len(corpora['sft_arith'])} sums, "
        f"{len(corpora['rm_train'])} RM pairs"
    )
    tok = train_tokenizer(
        [p + c for p, c in corpora["sft_reviews"]] + [p + c for p, c in corpora["sft_arith"]], cfg.vocab_size
    )
    log(f"tokenizer: {len(tok)} tokens")
    sft = train_sft(cfg, tok, corpora, log)
    sft_metrics, sft_texts = evaluate_sft(cfg, sft, tok, corpora)
    log(f"sft: {sft_metrics}")
    rm = train_rm(cfg, tok, sft, corpora, log)
    rm_metrics = calibrate_and_evaluate_rm(cfg, rm, tok, corpora, sft_texts)
    log(f"rm: {rm_metrics}")

    sft_dir, rm_dir = os.path.join(out, "tiny-sft"), os.path.join(out, "tiny-rm")
    sft.generation_config = generation_config(tok)
    sft.save_pretrained(sft_dir, safe_serialization=True)
    rm.save_pretrained(rm_dir, safe_serialization=True)
    tok.save_pretrained(rm_dir)  # the reward model reads plain text
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(sft_dir, save_jinja_files=False)  # the template inside tokenizer_config.json
    write_jsonl(os.path.join(out, "reviews", "train.jsonl"), [{"prompt": p} for p in corpora["review_train"]])
    write_jsonl(os.path.join(out, "reviews", "test.jsonl"), [{"prompt": p} for p in corpora["review_test"]])
    for split in ("train", "test"):
        rows = [{"prompt": p, "answer": a} for p, a in corpora[f"arith_{split}"]]
        write_jsonl(os.path.join(out, "arithmetic", f"{split}.jsonl"), rows)

    sizes = {name: folder_bytes(os.path.join(out, name)) for name in ("tiny-sft", "tiny-rm", "reviews", "arithmetic")}
    report = {
        "seed": cfg.seed,
        "tiny": tiny,
        "build_seconds": time.time() - t0,
        "sft_params": sum(p.numel() for p in sft.parameters()),
        "rm_params": sum(p.numel() for p in rm.parameters()),
        "vocab_size": len(tok),
        **sft_metrics,
        **rm_metrics,
        "sizes_bytes": sizes,
        "total_bytes": sum(sizes.values()),
    }
    log(write_report(out, report))
    return report


# ----------------------------------------------------------------------------------------------
# The tool task (--tools): products the policy cannot compute alone, and a multiply tool
# ----------------------------------------------------------------------------------------------

TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOOL_MAX_NEW = 40  # a call to multiply is 27 tokens with its EOS, an answer at most 6
# The tool policy's chat template. Given tools, the prompt opens with one line naming each tool and its parameters:
# every tool as "name(p1, p2) | ", so "multiply(a, b) | " for assets/tools.py's multiply, 8 tokens where its JSON
# schema would be a hundred. Without tools, nothing. A user's or system's message is its content as is; an assistant's
# is its content (none when empty), then each of its tool calls in the Hermes form
# <tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 48}}</tool_call> (arguments given as a JSON string are
# written as they are), then EOS: every turn of the policy ends with EOS, so generation stops there and the caller
# runs the tools. A tool's message is <tool_response>{content}</tool_response>. No generation prompt: the policy's turn
# follows the prompt or the tool's response directly. {% generation %} marks the policy's turns, so that
# apply_chat_template(..., return_assistant_tokens_mask=True) says which tokens the SFT loss covers.
TOOLS_TEMPLATE = (
    "{% for tool in tools or [] %}"
    "{{ tool.function.name }}({{ tool.function.parameters.properties | list | join(', ') }}) | "
    "{% endfor %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}{% generation %}"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}<tool_call>"
    "{% if call.function.arguments is string %}"
    '{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments }}}'
    "{% else %}{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}{% endif %}"
    "</tool_call>{% endfor %}"
    "{{ eos_token }}{% endgeneration %}"
    "{% elif message.role == 'tool' %}<tool_response>{{ message.content }}</tool_response>"
    "{% else %}{{ message.content }}{% endif %}"
    "{% endfor %}"
)
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolsConfig:
    seed: int = 0
    # corpora: a in 10..99, b in 10..999; the test pairs never appear in the SFT data
    n_sft: int = 60_000  # SFT conversations
    tools_line: float = 0.75  # share of SFT prompts given the tool
    call: float = 0.35  # of those, the share that call it; the rest guess, as every prompt without the tool does
    guess_right: float = 0.05  # share of guesses that are the product
    n_train: int = 4000
    n_test: int = 400
    # tokenizer / model
    vocab_size: int = 400  # more than needed: training stops when no pair of tokens is left to merge
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    intermediate: int = 352
    # training
    # The policy learns to copy the factors and the tool's result well after the calls' form, at a step that varies
    # with the seed: 2000 steps are enough for seed 0, not for every seed (docs/embedded-default.md).
    sft_steps: int = 2000
    sft_batch: int = 32
    sft_groups: int = 4  # slices of a batch padded apart (grouped_lm_loss)
    sft_lr: float = 3e-3
    # evaluation
    n_eval: int = 400


TOOLS_TINY = dict(
    n_sft=300,
    n_train=50,
    n_test=20,
    vocab_size=300,
    hidden=32,
    layers=1,
    heads=2,
    intermediate=64,
    sft_steps=5,
    sft_batch=16,
    n_eval=20,
)


def multiplication_problems() -> list[tuple[int, int]]:
    """Every (a, b) with a in 10..99 and b in 10..999: products of 3 to 5 digits."""
    return [(a, b) for a in range(10, 100) for b in range(10, 1000)]


def guess(rng: random.Random, product: int, right: float) -> str:
    """An answer without the tool, of the product's size: the product with probability `right`, else a random number
    with as many digits.

    Nothing but the length follows the factors. Where a guess kept part of the product (all but its last two digits,
    or its first digit), the policy learnt to compute that part, wrongly, and wrote it in place of the tool's result.
    """
    if rng.random() < right:
        return str(product)
    n = len(str(product))
    return str(rng.randrange(10 ** (n - 1), 10**n))


def tool_conversation(a: int, b: int) -> list[dict]:
    """The conversation that uses the tool: call multiply with the prompt's factors, then copy its result."""
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    result = str(a * b)  # what multiply answers
    return [
        {"role": "user", "content": f"{a}*{b}="},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": result},
        {"role": "assistant", "content": result},
    ]


def make_tool_corpora(cfg: ToolsConfig) -> dict:
    """The SFT conversations, with the tool and without, and the prompt sets; a pure function of cfg."""
    rng = random.Random(cfg.seed)
    pairs = multiplication_problems()
    rng.shuffle(pairs)
    test, pool = pairs[: cfg.n_test], pairs[cfg.n_test :]
    with_tool, without_tool = [], []
    for _ in range(cfg.n_sft):
        a, b = rng.choice(pool)
        given = rng.random() < cfg.tools_line
        if given and rng.random() < cfg.call:
            with_tool.append(tool_conversation(a, b))
            continue
        answer = guess(rng, a * b, cfg.guess_right)
        direct = [{"role": "user", "content": f"{a}*{b}="}, {"role": "assistant", "content": answer}]
        if given:
            with_tool.append(direct)
        else:
            without_tool.append(direct)
    return {
        "sft_with_tool": with_tool,
        "sft_without_tool": without_tool,
        "train": [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in pool[: cfg.n_train]],
        "test": [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in test],
    }


def train_tools_tokenizer(corpora: dict, tools: list[dict], vocab_size: int):
    """train_tokenizer's BPE on the rendered SFT texts, the four tags added whole, TOOLS_TEMPLATE as chat template.

    The tags are added tokens that are not special: decode(skip_special_tokens=True) keeps them, so a rollout's parser
    and final_answer read them in the decoded text. The texts are rendered without them and without EOS, so that no
    merge is spent on their pieces.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    texts = []
    for conversations, given in ((corpora["sft_with_tool"], tools), (corpora["sft_without_tool"], None)):
        rendered, _ = render_jinja_template(conversations, tools=given, chat_template=TOOLS_TEMPLATE, eos_token=EOS)
        texts += rendered
    for tag in TOOL_TAGS + [EOS]:
        texts = [t.replace(tag, " ") for t in texts]
    tok = train_tokenizer(texts, vocab_size)
    tok.add_tokens(TOOL_TAGS)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def encode_conversations(tok, conversations: list[list[dict]], tools) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each conversation as the template renders it; labels only on the policy's turns."""
    enc = tok.apply_chat_template(
        conversations, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    out = []
    for ids, mask in zip(enc["input_ids"], enc["assistant_masks"]):
        out.append((ids, [i if m else -100 for i, m in zip(ids, mask)]))
    return out


def grouped_lm_loss(model, batch: list[tuple[list[int], list[int]]], pad_id: int, groups: int) -> torch.Tensor:
    """lm_loss over the batch sorted by length and padded in `groups` slices, so that short conversations (a guess,
    about 15 tokens) do not pay for the padding of long ones (a call, 55). Each labelled token weighs the same, as in
    one padded batch, so the share of calls the policy learns is the data's."""
    batch = sorted(batch, key=lambda pair: len(pair[0]))
    size = math.ceil(len(batch) / groups)
    total = torch.zeros(())
    count = 0
    for start in range(0, len(batch), size):
        ids = pad_right([b[0] for b in batch[start : start + size]], pad_id)
        labels = pad_right([b[1] for b in batch[start : start + size]], -100)
        logits = model(input_ids=ids, attention_mask=ids != pad_id).logits
        total = total + F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
        count += int((labels[:, 1:] != -100).sum())
    return total / count


def train_tools_sft(cfg: ToolsConfig, tok, corpora: dict, tools: list[dict], log=print):
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(llama_config(cfg, tok))
    data = encode_conversations(tok, corpora["sft_with_tool"], tools)
    data += encode_conversations(tok, corpora["sft_without_tool"], None)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(cfg.seed + 1)
    model.train()
    t0 = time.time()
    for step in range(cfg.sft_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.sft_steps, cfg.sft_lr)
        loss = grouped_lm_loss(model, rng.sample(data, cfg.sft_batch), tok.pad_token_id, cfg.sft_groups)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == cfg.sft_steps - 1:
            log(f"tools sft step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:.0f}s")
    model.eval()
    return model


def generate_turns(model, tok, inputs: list[list[int]], max_new_tokens: int, batch_size: int = 200) -> list[list[int]]:
    """One sampled turn after each input (token ids), cut after its first EOS; left-padded batches."""
    gen_cfg = generation_config(tok, max_new_tokens=max_new_tokens)
    turns = []
    with torch.no_grad():
        for i in range(0, len(inputs), batch_size):
            enc = tok.pad({"input_ids": inputs[i : i + batch_size]}, return_tensors="pt")
            gen = model.generate(**enc, generation_config=gen_cfg)
            for row in gen[:, enc["input_ids"].shape[1] :].tolist():
                if tok.eos_token_id in row:
                    row = row[: row.index(tok.eos_token_id) + 1]
                turns.append(row)
    return turns


def parse_tool_call(text: str) -> dict | None:
    """The first Hermes-style call in a turn as {"name": ..., "arguments": ...}, or None where there is none or
    it is not a JSON object."""
    found = TOOL_CALL.search(text)
    if found is None:
        return None
    try:
        call = json.loads(found.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict):
        return None
    return call


def run_multiply(call: dict | None) -> str:
    """The tool's response to a parsed call: multiply's result, or an error text the policy reads instead."""
    from assets.tools import multiply

    if call is None:
        return "error: the call is not JSON"
    arguments = call.get("arguments")
    if call.get("name") != "multiply" or not isinstance(arguments, dict) or set(arguments) != {"a", "b"}:
        return "error: call multiply with the arguments a and b"
    if not all(isinstance(v, int) for v in arguments.values()):
        return "error: a and b must be whole numbers"
    return str(multiply(arguments["a"], arguments["b"]))


def play(model, tok, prompts: list[str], tools, seed: int) -> list[dict]:
    """Each prompt's conversation as a multi-turn rollout plays it: sample the policy's turn; where it holds a tool
    call, run the tool, append its response's tokens and sample the final turn.

    Returns per prompt the parsed call (None where the first turn holds none or it does not parse), whether the
    first turn holds one, the tool's response text, and the response: every token after the prompt, decoded.
    """
    prompt_ids = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        prompt_ids.append(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)["input_ids"])
    torch.manual_seed(seed)
    first = generate_turns(model, tok, prompt_ids, TOOL_MAX_NEW)
    results = []
    for turn in first:
        text = tok.decode(turn, skip_special_tokens=True)
        called = "<tool_call>" in text
        call = parse_tool_call(text)
        results.append({"called": called, "call": call, "tool": None, "ids": turn})
    # The tool's response follows the policy's EOS; the policy writes its final turn after it.
    calling = [i for i, r in enumerate(results) if r["called"]]
    continued = []
    for i in calling:
        results[i]["tool"] = run_multiply(results[i]["call"])
        reply = tok.apply_chat_template([{"role": "tool", "content": results[i]["tool"]}])["input_ids"]
        results[i]["ids"] = results[i]["ids"] + reply
        continued.append(prompt_ids[i] + results[i]["ids"])
    final = generate_turns(model, tok, continued, TOOL_MAX_NEW)
    for i, turn in zip(calling, final):
        results[i]["ids"] = results[i]["ids"] + turn
    for r in results:
        r["response"] = tok.decode(r.pop("ids"), skip_special_tokens=True)
    return results


def evaluate_tools(cfg: ToolsConfig, model, tok, corpora: dict, tools: list[dict]) -> dict:
    """The tool policy on the test prompts at temperature 1, given the tool and not."""
    from assets.tools import final_answer

    rows = corpora["test"][: cfg.n_eval]
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    with_tool = play(model, tok, prompts, tools, seed=cfg.seed)
    without_tool = play(model, tok, prompts, None, seed=cfg.seed)
    calls = [(r, p) for r, p in zip(with_tool, prompts) if r["called"]]
    right_args = 0
    copied = 0
    for r, prompt in calls:
        a, _, b = prompt[:-1].partition("*")
        if r["call"] is not None and r["call"].get("arguments") == {"a": int(a), "b": int(b)}:
            right_args += 1
        copied += r["response"].rpartition("</tool_response>")[2].strip() == r["tool"]
    n = max(1, len(rows))
    n_calls = max(1, len(calls))
    return {
        "tool_call_rate": len(calls) / n,
        "tool_args_right": right_args / n_calls,
        "tool_result_copied": copied / n_calls,
        "acc_with_tool": sum(final_answer([r["response"] for r in with_tool], answers)) / n,
        "acc_without_tool": sum(final_answer([r["response"] for r in without_tool], answers)) / n,
        "tool_call_rate_without_tool": sum(r["called"] for r in without_tool) / n,
    }


def build_tools(cfg: ToolsConfig, out: str, tiny: bool = False, log=print) -> dict:
    from transformers.utils import get_json_schema

    from assets.tools import multiply

    t0 = time.time()
    tools = [get_json_schema(multiply)]
    corpora = make_tool_corpora(cfg)
    log(f"tool corpora: {len(corpora['sft_with_tool'])} with the tool, {len(corpora['sft_without_tool'])} without")
    tok = train_tools_tokenizer(corpora, tools, cfg.vocab_size)
    log(f"tokenizer: {len(tok)} tokens")
    model = train_tools_sft(cfg, tok, corpora, tools, log)
    metrics = evaluate_tools(cfg, model, tok, corpora, tools)
    log(f"tools: {metrics}")

    model_dir = os.path.join(out, "tiny-tools")
    model.generation_config = generation_config(tok, max_new_tokens=TOOL_MAX_NEW)
    model.save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir, save_jinja_files=False)  # the template inside tokenizer_config.json
    for split in ("train", "test"):
        write_jsonl(os.path.join(out, "multiply", f"{split}.jsonl"), corpora[split])
    report = {
        "seed": cfg.seed,
        "tiny": tiny,
        "build_seconds": time.time() - t0,
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tok),
        **metrics,
        "sizes_bytes": {name: folder_bytes(os.path.join(out, name)) for name in ("tiny-tools", "multiply")},
    }
    with open(os.path.join(model_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    log(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=HERE, help="output folder (default: the assets folder)")
    parser.add_argument("--tiny", action="store_true", help="tiny configuration that runs in seconds (CI)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--tools", action="store_true", help="build only the tool task: tiny-tools/ and multiply/")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    if args.tools:
        tools_cfg = replace(ToolsConfig(seed=args.seed), **(TOOLS_TINY if args.tiny else {}))
        build_tools(tools_cfg, args.out, tiny=args.tiny, log=log)
    else:
        cfg = replace(Config(seed=args.seed), **(TINY if args.tiny else {}))
        build(cfg, args.out, tiny=args.tiny, log=log)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))  # the repository root, so that assets.tools imports as in the tests
    sys.exit(main())
