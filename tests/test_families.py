"""The model-family matrix: the scripts on tiny random models of each architecture a user is likely to bring
(Llama, Qwen2, Qwen3, GPT-NeoX/Pythia, GPT-2, Gemma, and Qwen3-MoE for a mixture of experts).

The embedded default is one Llama; every other family reaches the scripts only through transformers' Auto classes,
and the families differ where the scripts lean on them: learned absolute positions (GPT-2), tied embeddings (GPT-2,
Gemma), a scaled embedding (Gemma), a routed MLP (Qwen3-MoE), dropout on in the config (GPT-2), a causal LM not
named ...ForCausalLM (GPT2LMHeadModel), each classifier's `score` head, and what transformers makes of a reward model
saved without a tokenizer (an error for Llama, an empty tokenizer of the model's class for most others). For each
family this checks that
- the log-probs recorded while sampling with a KV cache equal one teacher-forced forward over the finished
  sequences (left-padded prompts of different lengths, temperature 0.7), so that PPO's ratio is 1 before any update;
- rlhf_kernels' static_decode (the cache of fixed shape that CUDA graphs replay) samples the tokens the plain loop,
  with the same log-probs (float64), at T = 0.7 and 1 and greedily, stopping where it stops;
- a group's rows (equal prompts, encoded once, the cache repeated) sample what each row samples alone, in float64;
- the reward model's score at the last real token does not depend on the padding around the sequence;
- a reward model saved without a tokenizer is given none, and so reads the policy's token ids;
- ppo.py, grpo.py and rloo.py each run two iterations with the family's policy and reward model, and the policy they
  save loads back as the same architecture, with every weight, moved from where it started."""

import math
import os

import pytest
import torch
from helpers import ROOT, assert_group_prompts_prefilled_once, assert_static_decode_matches_dynamic, run_script
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

import ppo

TOKENIZER = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
# Every family gets the embedded tokenizer's vocabulary and special tokens (it has no BOS).
PAD = TOKENIZER.pad_token_id
EOS = TOKENIZER.eos_token_id
TOKENS = dict(vocab_size=len(TOKENIZER), bos_token_id=TOKENIZER.bos_token_id, eos_token_id=EOS, pad_token_id=PAD)
DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
FAMILIES = {
    "llama": lambda **kw: LlamaConfig(**DECODER, **TOKENS, **kw),
    "qwen2": lambda **kw: Qwen2Config(**DECODER, **TOKENS, **kw),
    "qwen3": lambda **kw: Qwen3Config(**DECODER, head_dim=8, **TOKENS, **kw),
    "gpt_neox": lambda **kw: GPTNeoXConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        **TOKENS,
        **kw,
    ),
    "gpt2": lambda **kw: GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **TOKENS, **kw),
    "gemma": lambda **kw: GemmaConfig(**DECODER, head_dim=8, **TOKENS, **kw),
    "qwen3_moe": lambda **kw: Qwen3MoeConfig(
        **DECODER, head_dim=8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **TOKENS, **kw
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """The family's policy (a causal LM, with the embedded tokenizer beside it, since the scripts load the tokenizer
    from --model_name_or_path) and reward model (a one-label sequence classifier, saved without a tokenizer: it reads
    the policy's tokens), saved once per family."""
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(FAMILIES[name]()).save_pretrained(folder / "policy")
    TOKENIZER.save_pretrained(folder / "policy")
    AutoModelForSequenceClassification.from_config(FAMILIES[name](num_labels=1)).save_pretrained(folder / "rm")
    return folder / "policy", folder / "rm"


def test_sampled_logprobs_equal_teacher_forced(family):
    policy = AutoModelForCausalLM.from_pretrained(family[0]).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, len(TOKENIZER), (n,), generator=g).tolist() for n in [1, 5, 3, 8, 2, 6]]
    prompt_ids, prompt_mask = ppo.left_pad(prompts, PAD, "cpu")  # (6, 8)
    uniforms = torch.rand(6, 10, generator=g)
    # A token is the first whose cumulative probability passes its uniform, so a uniform of 0 draws token 0, the EOS:
    # rows 0, 2 and 3 end early (after 4, 1 and 7 tokens), the others run to the limit of 10.
    assert EOS == 0
    uniforms[0, 3] = 0.0
    uniforms[2, 0] = 0.0
    uniforms[3, 6] = 0.0
    sampling = ppo.Sampling(10, 0.7, torch.tensor([EOS]), PAD)
    responses, logprobs_old, response_mask = ppo.generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
    assert response_mask.sum(1).tolist() == [4, 10, 1, 7, 10, 10]
    input_ids = torch.cat([prompt_ids, responses], 1)
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    with torch.no_grad():
        teacher_forced = ppo.response_logprobs(policy, input_ids, attention_mask, prompt_ids.shape[1], 0.7)
    valid = response_mask.bool()
    torch.testing.assert_close(teacher_forced[valid], logprobs_old[valid], atol=1e-5, rtol=0)


def test_static_decode_samples_what_the_dynamic_loop_samples(family):
    # the MoE's default grouped matrix products have no float64 kernel; its loop over the experts has
    policy = AutoModelForCausalLM.from_pretrained(family[0], dtype=torch.float64, experts_implementation="eager")
    policy.eval()
    assert_static_decode_matches_dynamic(policy, PAD, torch.tensor([EOS]), len(TOKENIZER))


def test_reward_head_is_padding_invariant(family):
    rm = AutoModelForSequenceClassification.from_pretrained(family[1]).eval()
    seq = torch.randint(2, len(TOKENIZER), (7,), generator=torch.Generator().manual_seed(2)).tolist() + [EOS]
    with torch.no_grad():
        alone = ppo.head_outputs(rm, torch.tensor([seq]), torch.ones(1, 8, dtype=torch.long))[0, -1]
        # left padding as in a prompt batch, right padding as in a response batch
        padded_ids = torch.tensor([[PAD] * 3 + seq + [PAD] * 2])
        padded = ppo.head_outputs(rm, padded_ids, (padded_ids != PAD).long())[0, 10]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)


def test_a_reward_model_without_a_tokenizer_reads_the_policys_tokens(family):
    # Were it given a tokenizer of its own, the responses would be decoded and re-tokenised for it; an empty one (what
    # transformers builds for most families when none was saved) turns every response into nothing, or into <unk>s.
    ((rm, own),) = ppo.load_reward_models(ppo.Args(reward_model_path=(str(family[1]),)), TOKENIZER, "cpu")
    assert own is None
    assert rm.config.pad_token_id == PAD


# Two iterations of four responses each, one optimiser step per iteration. All three scripts on the review prompts,
# scored by the family's reward model: grpo.py's default rule reward would give a random policy 0 on every arithmetic
# answer, every group zero-signal, and no step to check.
TINY = ["--total_episodes=8", "--minibatch_size=4", "--micro_batch_size=4", "--response_length=8", "--eval_every=0"]
REVIEWS = ["--reward_fn", "--dataset", os.path.join(ROOT, "assets", "reviews", "train.jsonl")]
BATCH = {
    "ppo.py": ["--rollout_batch_size=4", "--num_epochs=1"],
    "grpo.py": ["--rollout_batch_size=2", "--num_generations=2"],
    "rloo.py": ["--rollout_batch_size=2", "--num_generations=2"],
}


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "rloo.py"])
def test_two_iterations(script, family, tmp_path):
    policy, rm = family
    models = [f"--model_name_or_path={policy}", "--reward_model_path", str(rm)]
    rows, _ = run_script(script, tmp_path / "run", *TINY, *REVIEWS, *BATCH[script], *models)
    assert [r["iteration"] for r in rows] == [1, 2]
    keys = ["objective/score", "objective/kl", "policy/loss", "policy/entropy", "grad_norm/policy"]
    if script == "ppo.py":
        keys.append("val/loss")
    for r in rows:
        for key in keys:
            assert math.isfinite(r[key]), key
        # logprobs_old recorded while sampling equal the training forward (dropout off, where a config has it on)
        assert r["policy/first_ratio_dev"] < 1e-4
    # the reference, loaded apart, is the starting policy
    assert rows[0]["objective/kl"] == pytest.approx(0.0, abs=1e-4)
    start = AutoModelForCausalLM.from_pretrained(policy)
    saved, loading = AutoModelForCausalLM.from_pretrained(tmp_path / "run", output_loading_info=True)
    # no weight missing from the file, none left over
    assert type(saved) is type(start)
    assert not any(loading.values())
    start_weights = start.state_dict()
    saved_weights = saved.state_dict()
    assert start_weights.keys() == saved_weights.keys()
    assert sum((saved_weights[k] - start_weights[k]).abs().sum().item() for k in start_weights) > 0  # it trained


@pytest.mark.parametrize("kernel_decode", [False, True])
def test_a_groups_prompt_is_encoded_once(family, kernel_decode):
    """Each run of equal prompts prefilled once, its cache repeated: the tokens and float64 log-probs (within 1e-9)
    of each row sampled alone, with the plain loop and rlhf_kernels' (see the helper)."""
    policy = AutoModelForCausalLM.from_pretrained(family[0], dtype=torch.float64, experts_implementation="eager")
    assert_group_prompts_prefilled_once(policy.eval(), PAD, torch.tensor([EOS]), len(TOKENIZER), 1e-9, kernel_decode)
