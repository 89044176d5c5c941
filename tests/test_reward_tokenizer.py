"""Reward models with a tokenizer of their own (shared code, tested through ppo.py's copy and a run of rloo.py): the
prompt and the decoded response are re-tokenised for the reward model, and its score equals the one it gives the same
text fed to it directly, one sequence at a time, through transformers' own classifier; a reward model on the policy's
tokenizer keeps reading the token ids."""

import json
import os

import pytest
import torch
from helpers import ROOT, run_script, tiny_llama_config, tiny_run
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaForSequenceClassification, PreTrainedTokenizerFast

import ppo

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
    prompt_ids, prompt_mask = ppo.left_pad(
        [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS], tokenizer.pad_token_id, "cpu"
    )
    replies = [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in RESPONSES]
    width = max(map(len, replies))
    responses = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in replies])
    response_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in replies])
    rows = [{"prompt": p} for p in PROMPTS]
    return ppo.score_responses(
        ppo.Scorer(reward_models, [], tokenizer),
        torch.cat([prompt_ids, responses], 1),
        torch.cat([prompt_mask, response_mask], 1),
        prompt_ids.shape[1],
        rows,
        args,
    )


def test_a_reward_model_with_its_own_tokenizer_scores_the_text(other_rm):
    args = ppo.Args(reward_model_path=(other_rm,))
    policy_tokenizer = AutoTokenizer.from_pretrained(POLICY)
    ((rm, own),) = ppo.load_reward_models(args, policy_tokenizer, "cpu")
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
    ids, mask = ppo.reward_model_inputs(
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
    ((rm, own),) = ppo.load_reward_models(args, AutoTokenizer.from_pretrained(POLICY), "cpu")
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
    rows, _ = run_script("rloo.py", tmp_path, "--reward_model_path", other_rm, *options)
    assert [r["iteration"] for r in rows] == [1, 2]  # 16 episodes of 8 responses an iteration (tiny_run)
    assert all(torch.isfinite(torch.tensor([r["objective/score"], r["objective/kl"]])).all() for r in rows)
