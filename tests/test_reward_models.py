"""Reward models (rlhf_runtime's loading and scoring, the same code for every script: tested once, with ppo.py's
combine_scores, and in a run of rloo.py): the score of several is their minimum; a reward model with a tokenizer of its
own re-tokenises the prompt and the decoded response, and its score equals the one it gives the same text fed to it
directly, one sequence at a time, through transformers' own classifier; a reward model on the policy's tokenizer keeps
reading the token ids; a tokenizer without a pad or with ids past its model's embeddings is refused before the model
loads."""

import json
import os
import shutil

import pytest
import torch
from helpers import ROOT, run_main, tiny_llama_config, tiny_run
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaForSequenceClassification, PreTrainedTokenizerFast

import grpo
import ppo
import rlhf_runtime as runtime
from rlhf_runtime.rewards import reward_model_inputs


def test_scores_take_the_minimum_over_reward_models():
    rm_a = torch.tensor([1.0, -2.0, 0.5])
    rm_b = torch.tensor([0.0, 3.0, 0.5])
    assert ppo.combine_scores([rm_a, rm_b]).tolist() == [0.0, -2.0, 0.5]
    assert ppo.combine_scores([rm_a, rm_b], torch.tensor([1.0, 0.0, 1.0])).tolist() == [1.0, -2.0, 1.5]
    assert ppo.combine_scores([], torch.tensor([1.0, 0.0])).tolist() == [1.0, 0.0]


# ---------------------------------------------------------------- a reward model on a tokenizer of its own


POLICY = os.path.join(ROOT, "assets", "tiny-sft")


PROMPTS = ["the food was", "the hotel room felt", "the plot of the film"]


RESPONSES = [" lovely and warm .", " cold", " dull and far too long ."]


def other_tokenizer():
    """A byte-level BPE tokenizer of 300 tokens trained here on the embedded reviews: another vocabulary, other ids."""
    texts = [json.loads(line)["prompt"] for line in open(os.path.join(ROOT, "assets", "reviews", "train.jsonl"))]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(
        texts + PROMPTS + RESPONSES,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<pad>", "<unk>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")


@pytest.fixture(scope="module")
def other_rm(tmp_path_factory):
    """A tiny random reward model on the other tokenizer, saved with it."""
    path = tmp_path_factory.mktemp("other-rm")
    tokenizer = other_tokenizer()
    torch.manual_seed(0)
    config = tiny_llama_config(
        vocab_size=len(tokenizer),
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def scored_batch(reward_models, args):
    tokenizer = AutoTokenizer.from_pretrained(POLICY, padding_side="left")
    prompt_ids, prompt_mask = runtime.left_pad(
        [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS], tokenizer.pad_token_id, "cpu"
    )
    replies = [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in RESPONSES]
    width = max(map(len, replies))
    responses = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in replies])
    response_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in replies])
    rows = [{"prompt": p} for p in PROMPTS]
    return runtime.score_responses(
        runtime.Scorer(reward_models, [], tokenizer, runtime.new_state(), ppo.combine_scores),
        torch.cat([prompt_ids, responses], 1),
        torch.cat([prompt_mask, response_mask], 1),
        prompt_ids.shape[1],
        rows,
        args,
    )


def test_a_reward_model_with_its_own_tokenizer_scores_the_text(other_rm):
    args = ppo.Args(reward_model_path=(other_rm,))
    policy_tokenizer = AutoTokenizer.from_pretrained(POLICY)
    ((rm, own),) = runtime.load_reward_models(args.reward_model_path, policy_tokenizer, args.run, "cpu")
    assert own is not None
    assert own.get_vocab() != policy_tokenizer.get_vocab()
    scores = scored_batch([(rm, own)], args)
    assert scores.texts == RESPONSES  # the decoded responses, EOS dropped
    with torch.no_grad():  # the same text, one unpadded sequence at a time, through transformers' own pooling
        direct = [
            rm(input_ids=torch.tensor([own(p + r)["input_ids"]])).logits[0, 0].item()
            for p, r in zip(PROMPTS, RESPONSES)
        ]
    torch.testing.assert_close(scores.raw, torch.tensor(direct), atol=1e-5, rtol=1e-5)


def test_the_reward_models_chat_template_frames_the_text(other_rm):
    own = AutoTokenizer.from_pretrained(other_rm, padding_side="left")
    own.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    ids, mask = reward_model_inputs(
        own,
        ["the food was", [{"role": "system", "content": "rate it"}, {"role": "user", "content": "the bed"}]],
        [" good", " soft"],
        "cpu",
    )
    by_hand = ["[user] the food was\n[assistant]  good\n", "[system] rate it\n[user] the bed\n[assistant]  soft\n"]
    for row, row_mask, text in zip(ids, mask, by_hand):
        assert row[row_mask.bool()].tolist() == own(text, add_special_tokens=False)["input_ids"]
    assert (mask[:, -1] == 1).all()  # left-padded: the last position is real in every row


def test_a_reward_model_on_the_policys_tokenizer_reads_the_token_ids():
    args = ppo.Args()
    policy_tokenizer = AutoTokenizer.from_pretrained(POLICY)
    ((rm, own),) = runtime.load_reward_models(args.reward_model_path, policy_tokenizer, args.run, "cpu")
    assert own is None
    score = scored_batch([(rm, own)], args).raw
    tokenizer = AutoTokenizer.from_pretrained(POLICY)
    with torch.no_grad():
        direct = [
            rm(
                input_ids=torch.tensor(
                    [tokenizer(p + r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
                )
            )
            .logits[0, 0]
            .item()
            for p, r in zip(PROMPTS, RESPONSES)
        ]
    torch.testing.assert_close(score, torch.tensor(direct), atol=1e-5, rtol=1e-5)


def test_ppos_critic_cannot_start_from_a_reward_model_on_another_tokenizer(other_rm, tmp_path):
    args = ppo.Args(reward_model_path=(other_rm,), output_dir=str(tmp_path))
    ppo.validate(args)
    with pytest.raises(SystemExit, match="whose tokenizer differs from the policy's; pass --value_model_path"):
        ppo.build_models(args, AutoTokenizer.from_pretrained(POLICY), "cpu")


def test_rloo_runs_with_a_reward_model_on_another_tokenizer(other_rm, tmp_path):
    options = tiny_run("rloo.py", total_episodes=16, response_length=8, eval_every=0)
    rows, _ = run_main("rloo.py", tmp_path, "--reward_model_path", other_rm, *options)
    assert [r["iteration"] for r in rows] == [1, 2]  # 16 episodes of 8 responses an iteration (tiny_run)
    assert all(torch.isfinite(torch.tensor([r["objective/score"], r["objective/kl"]])).all() for r in rows)


# ---------------------------------------------------------------- tokenizers checked before their model loads


def test_a_reward_tokenizer_with_ids_past_the_embeddings_is_refused_before_its_model_loads(tmp_path):
    """A word-level tokenizer of 300 words with ids from 1000 up, beside a model of 784 embeddings: 303 tokens fit in
    784, but the ids do not (before, the check counted tokens and the first score raised IndexError)."""
    words = {f"word{i}": 1000 + i for i in range(300)} | {"<pad>": 1300, "<unk>": 1301, "</s>": 1302}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    assert len(tokenizer) <= 784 < max(tokenizer.get_vocab().values())
    rm = tmp_path / "rm"
    tokenizer.save_pretrained(rm)
    config = tiny_llama_config(vocab_size=784, num_hidden_layers=1)
    config.architectures = ["LlamaForSequenceClassification"]
    config.save_pretrained(rm)  # no weights: the check must come before they load
    args = ppo.Args(reward_model_path=(str(rm),))
    policy_tokenizer = AutoTokenizer.from_pretrained(POLICY, padding_side="left")
    with pytest.raises(SystemExit, match="ids past the model's 784 embeddings \\(its largest is 1302\\)"):
        runtime.load_reward_models(args.reward_model_path, policy_tokenizer, args.run, "cpu")


def test_reward_model_tokenizers_without_a_pad_or_with_ids_past_the_embeddings_are_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    policy = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"), padding_side="left")
    for name, specials, vocab in (("no-pad", {}, 784), ("too-many", {"pad_token": "<p>"}, 2)):
        rm = tmp_path / name
        shutil.copytree(os.path.join(ROOT, "assets", "tiny-rm"), rm)
        for f in rm.glob("*token*"):
            f.unlink()
        words = {w: i for i, w in enumerate(["<p>", *(f"w{i}" for i in range(9))])}
        PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words)), **specials).save_pretrained(rm)
        config = json.loads((rm / "config.json").read_text())
        (rm / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
        args = grpo.Args(reward_model_path=(str(rm),))
        with pytest.raises(
            SystemExit,
            match=rf"the tokenizer beside --reward_model_path '{rm}' has no pad, EOS or unk "
            rf"token, or ids past the model's {vocab} embeddings \(its largest is 9\); save the one",
        ):
            runtime.load_reward_models(args.reward_model_path, policy, args.run, torch.device("cpu"))
