"""Chat prompts and stop tokens, shared by the three scripts (tested through ppo.py's copy): prompts given as chat
messages, or text with --chat_template, are rendered by the tokenizer's template as written out here by hand; a
response ends at the template's end-of-turn token as well as at EOS; bad chat input is refused in one sentence."""

import json
import os
import shutil

import pytest
import torch
from helpers import ROOT, run_script, tiny_llama_config, tiny_run
from transformers import AutoTokenizer, LlamaForCausalLM

import ppo

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_tokenizer():
    """The embedded tokenizer with an end-of-turn special token and a chat template that uses it."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"), padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chat_prompts_render_as_the_template_says(tmp_path):
    tokenizer = chat_tokenizer()
    rows = [
        {"prompt": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "the food was"}]},
        {"prompt": "the room was"},
    ]
    path = write_rows(tmp_path / "chat.jsonl", rows)
    by_hand = [
        "<|system|>be kind<|end|>\n<|user|>the food was<|end|>\n<|assistant|>",
        "<|user|>the room was<|end|>\n<|assistant|>",
    ]
    args = ppo.Args(chat_template=True)
    prompts, _ = ppo.load_prompts(path, "train", args, tokenizer)
    assert prompts == [tokenizer(text, add_special_tokens=False)["input_ids"] for text in by_hand]
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    # the special token is one token, not its characters
    assert end in prompts[0]
    assert prompts[0].count(end) == 2
    # without --chat_template, text stays text and messages are still rendered
    prompts, _ = ppo.load_prompts(path, "train", ppo.Args(), tokenizer)
    assert prompts == [
        tokenizer(by_hand[0], add_special_tokens=False)["input_ids"],
        tokenizer("the room was", add_special_tokens=False)["input_ids"],
    ]


def test_stop_tokens_are_eos_the_generation_config_and_the_end_of_turn(tmp_path):
    tokenizer = chat_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    # no generation_config.json here
    assert ppo.stop_token_ids(tokenizer, str(tmp_path)).tolist() == sorted([tokenizer.eos_token_id, end])
    plain = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [plain.eos_token_id, 7]}))
    assert ppo.stop_token_ids(plain, str(tmp_path)).tolist() == sorted({plain.eos_token_id, 7})


def test_a_response_ends_at_any_stop_token():
    """Sample once with no stop token reachable; then make the token sampled third a stop token: the same response
    ends there, the mask covering it, pad after it, and with the same log-probs up to it."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(tiny_llama_config()).eval()
    prompt_ids, prompt_mask = ppo.left_pad([[5, 6, 7]], 0, "cpu")
    uniforms = torch.rand(1, 8, generator=torch.Generator().manual_seed(1))
    never = ppo.Sampling(8, 0.8, -1, 0)  # no token is -1: no stop
    free, free_logprobs, free_mask = ppo.generate(policy, prompt_ids, prompt_mask, never, uniforms)
    assert free_mask.sum() == 8
    third = free[0, 2].item()
    # the token may have come up earlier: the response ends at its first use
    first = free[0].tolist().index(third)
    at_third = ppo.Sampling(8, 0.8, torch.tensor([1, third]), 0)
    stopped, logprobs, mask = ppo.generate(policy, prompt_ids, prompt_mask, at_third, uniforms)
    assert stopped[0, : first + 1].tolist() == free[0, : first + 1].tolist()
    assert mask[0].tolist() == [1] * (first + 1) + [0] * (mask.shape[1] - first - 1)
    assert (stopped[0, first + 1 :] == 0).all()
    torch.testing.assert_close(logprobs[0, : first + 1], free_logprobs[0, : first + 1])


@pytest.mark.parametrize(
    "prompt, chat_template, message",
    [
        ([{"role": "user", "content": "hi"}], False, "needs a chat template, but the tokenizer"),
        ("the food was", True, "needs a chat template, but the tokenizer"),
        ([{"text": "hi"}], False, "a prompt is text or a list of"),
        ({"role": "user"}, False, "a prompt is text or a list of"),
    ],
)
def test_bad_chat_input_is_refused_in_one_sentence(tmp_path, prompt, chat_template, message):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))  # no chat template
    path = write_rows(tmp_path / "bad.jsonl", [{"prompt": "fine"}, {"prompt": prompt}])
    with pytest.raises(SystemExit, match=message):
        ppo.load_prompts(path, "train", ppo.Args(chat_template=chat_template), tokenizer)


def test_a_run_on_chat_prompts(tmp_path):
    """ppo.py end to end on chat messages with a templated copy of the embedded policy (the template's end of turn is
    the EOS there, so the vocabulary is unchanged): the sample rows show the rendered prompts."""
    model = tmp_path / "chat-sft"
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-sft"), model)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tokenizer.chat_template = TEMPLATE.replace("<|end|>", tokenizer.eos_token)
    tokenizer.save_pretrained(str(model))
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "assets", "reviews", "train.jsonl"))][:64]
    data = write_rows(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])
    chat = [f"--model_name_or_path={model}", f"--dataset={data}", "--log_samples_every=1", "--max_prompt_length=96"]
    options = tiny_run("ppo.py", rollout_batch_size=16, total_episodes=32, eval_every=0)  # two iterations
    metrics, printed = run_script("ppo.py", tmp_path / "out", *chat, *options)
    assert [r["iteration"] for r in metrics] == [1, 2]
    assert "<|user|>" in printed
    assert "<|assistant|>" in printed
