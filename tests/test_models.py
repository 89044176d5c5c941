"""The models a user brings and how they are held (rlhf_runtime's loading, batches and data, alike for every script;
each script's Sampling, generate and response_logprobs through ppo.py's copy, identical in the four and kept so by
tests/test_code.py's drift test; and runs of the scripts): the model-family matrix, LoRA, chat templates and stop
tokens, gradient checkpointing and mixed precision, and the models' paths, kinds, positions and tokenizers checked
before they load.

The model-family matrix (helpers.FAMILIES): the scripts on tiny random models of each architecture a user is likely
to bring (Llama, Qwen2, Qwen3, GPT-NeoX/Pythia, GPT-2, Gemma, and Qwen3-MoE for a mixture of experts).

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
- ppo.py runs two iterations with the family's policy and reward model, and the policy it saves loads back as the
  same architecture, with every weight, moved from where it started.

LoRA: the reference is the policy with its adapters off and holds no weights of its own; training moves only the
adapters (and the critic's head); the merged save equals the base plus (alpha / r) B A computed by hand from the
adapters-only save, and loads with from_pretrained.

Chat: prompts given as chat messages, or text with --chat_template, are rendered by the tokenizer's template as written
out here by hand; a response ends at the template's end-of-turn token as well as at EOS; bad chat input is refused in
one sentence.

--gradient_checkpointing and --mixed_precision: the checkpointed model recomputes each block in the backward pass and
gets the same gradients as the plain one; mixed precision computes in bf16 over float32 master weights; the two
together run a whole iteration of ppo.py."""

import json
import math
import os
import shutil

import pytest
import torch
from helpers import (
    EOS,
    FAMILIES,
    PAD,
    ROOT,
    TOKENIZER,
    assert_group_prompts_prefilled_once,
    assert_static_decode_matches_dynamic,
    make_args,
    run_main,
    tiny_llama_config,
    tiny_run,
)
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

import grpo
import ppo
import rlhf_runtime as runtime
from rlhf_runtime.batches import head_outputs, left_pad, position_ids_from
from rlhf_runtime.data import load_prompts, stop_token_ids
from rlhf_runtime.loading import adapter_dropout, load_model, load_reference, load_reward_models
from rlhf_runtime.settings import RunSettings

POLICY = os.path.join(ROOT, "assets", "tiny-sft")


# ---------------------------------------------------------------- the model-family matrix


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
    prompt_ids, prompt_mask = left_pad(prompts, PAD, "cpu")  # (6, 8)
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
        alone = head_outputs(rm, torch.tensor([seq]), torch.ones(1, 8, dtype=torch.long))[0, -1]
        # left padding as in a prompt batch, right padding as in a response batch
        padded_ids = torch.tensor([[PAD] * 3 + seq + [PAD] * 2])
        padded = head_outputs(rm, padded_ids, (padded_ids != PAD).long())[0, 10]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)


def test_a_reward_model_without_a_tokenizer_reads_the_policys_tokens(family):
    # Were it given a tokenizer of its own, the responses would be decoded and re-tokenised for it; an empty one (what
    # transformers builds for most families when none was saved) turns every response into nothing, or into <unk>s.
    ((rm, own),) = load_reward_models((str(family[1]),), TOKENIZER, RunSettings(), "cpu")
    assert own is None
    assert rm.config.pad_token_id == PAD


# Two iterations of four responses each, one optimiser step per iteration, on the review prompts scored by the
# family's reward model (in this process). One script suffices: what a family changes is what the runtime does alike
# for every algorithm (loading each kind of model, the reward model's and the critic's head, the positions, saving the
# policy: rlhf_runtime) and what each script's generate and response_logprobs do, identical in the four (the drift
# test); the algorithms' own math reads only their float32 log-probs, values and scores. ppo.py loads every kind of
# model a script loads (the policy, its reference, the reward model and the critic made from it). What a run of
# rloo.py added here, a group's prompt sampled once for its rows, is generate's, checked on every family by
# test_a_groups_prompt_is_encoded_once below, each row against itself sampled alone.
TINY = ["--total_episodes=8", "--minibatch_size=4", "--micro_batch_size=4", "--response_length=8", "--eval_every=0"]


REVIEWS = ["--reward_fn", "--dataset", os.path.join(ROOT, "assets", "reviews", "train.jsonl")]


BATCH = ["--rollout_batch_size=4", "--num_epochs=1"]


def test_two_iterations(family, tmp_path):
    policy, rm = family
    models = [f"--model_name_or_path={policy}", "--reward_model_path", str(rm)]
    rows, _ = run_main("ppo.py", tmp_path / "run", *TINY, *REVIEWS, *BATCH, *models)
    assert [r["iteration"] for r in rows] == [1, 2]
    keys = ["objective/score", "objective/kl", "policy/loss", "policy/entropy", "grad_norm/policy", "val/loss"]
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


# ---------------------------------------------------------------- paths, kinds, positions, tokenizers: checked first


def write_tiny_models(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path / "lm")
    LlamaForSequenceClassification(tiny_llama_config(num_labels=1)).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "lm")
    return tokenizer


def test_wrong_model_kinds(tmp_path):
    write_tiny_models(tmp_path)
    with pytest.raises(SystemExit, match="not a causal LM"):
        ppo.validate(make_args(ppo, model_name_or_path=str(tmp_path / "rm")))
    with pytest.raises(SystemExit, match="not a sequence classifier"):
        ppo.validate(ppo.Args(reward_model_path=(str(tmp_path / "lm"),)))


def test_model_paths_are_blamed_on_the_right_flag(tmp_path):
    with pytest.raises(SystemExit, match="--reward_model_path '/missing' could not be found"):
        ppo.validate(ppo.Args(reward_model_path=("/missing",), output_dir=str(tmp_path / "run")))
    tiny = os.path.join(ROOT, "assets", "tiny-sft")
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes(open(os.path.join(tiny, name), "rb").read())
    with pytest.raises(SystemExit, match="has no tokenizer"):
        ppo.validate(make_args(ppo, model_name_or_path=str(no_tokenizer), output_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


def test_lengths_past_the_policys_positions_and_lora_targets_it_lacks_are_refused_before_loading(tmp_path):
    """The embedded policy has 128 positions and Llama's module names."""
    out = str(tmp_path / "run")
    with pytest.raises(
        SystemExit,
        match=r"^--response_length plus --max_prompt_length must fit the policy's 128 "
        r"positions \(got 65\)\.$",
    ):
        grpo.validate(make_args(grpo, output_dir=out, max_prompt_length=64, response_length=65))
    grpo.validate(make_args(grpo, output_dir=out, max_prompt_length=64, response_length=64))  # 128 fit
    with pytest.raises(
        SystemExit,
        match=r"^--lora_target_modules must each end the name of a module of the policy, "
        r"or be all-linear \(got \('q_proj', 'qkv'\)\)\.$",
    ):
        grpo.validate(make_args(grpo, output_dir=out, lora_r=4, lora_target_modules=("q_proj", "qkv")))
    grpo.validate(make_args(grpo, output_dir=out, lora_r=4, lora_target_modules=("q_proj", "mlp.down_proj")))
    assert not os.path.exists(out)


def test_tokenizer_without_pad_falls_back_to_eos(tmp_path, held_out):
    import shutil

    from transformers import AutoTokenizer

    policy_dir = tmp_path / "policy"
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-sft"), policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(policy_dir)
    assert AutoTokenizer.from_pretrained(policy_dir).pad_token is None
    sizes = ["--rollout_batch_size=8", "--minibatch_size=4", "--micro_batch_size=2", "--num_epochs=2"]
    policy = f"--model_name_or_path={policy_dir}"
    # evaluated on 15 held-out prompts (conftest.py's held_out), not the 400 beside the data, scored 2 at a time
    evaluation = f"--eval_dataset={held_out['reviews']}"
    rows, output = run_main(
        "ppo.py", tmp_path / "run", *sizes, "--total_episodes=16", "--response_length=8", policy, evaluation
    )
    assert "no pad token; using EOS as pad" in output
    rows = rows[1:]
    # With pad == EOS the mask, not the token id, ends a response: lengths stay within bounds and the
    # sampled log-probs still agree with the training forward pass.
    assert all(1 <= r["response/length"] <= 8 and r["policy/first_ratio_dev"] < 1e-4 for r in rows)


# ---------------------------------------------------------------- LoRA


LORA = ["--lora_r=4", "--lora_alpha=8", "--lora_target_modules", "q_proj", "v_proj"]


def test_the_reference_is_the_base_with_the_adapters_off():
    run = RunSettings(lora_r=4, lora_alpha=8.0, lora_target_modules=("q_proj", "v_proj"))
    policy = load_model(AutoModelForCausalLM, POLICY, run, "cpu", trained=True)
    reference = load_reference(run, policy, "cpu")
    assert list(reference.parameters()) == []  # no second copy of the weights
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == {
        n for n, _ in policy.named_parameters() if "lora_" in n
    }
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:  # B starts at zero (adapters on = off); give it something to switch off
                p.copy_(torch.randn_like(p) * 0.1)
    base = AutoModelForCausalLM.from_pretrained(POLICY).eval()
    input_ids, attention_mask = left_pad([[5, 9, 14, 30, 41], [12, 50, 60]], 1, "cpu")
    with torch.no_grad():
        off = ppo.response_logprobs(reference, input_ids, attention_mask, 2, 0.7)
        on = ppo.response_logprobs(policy, input_ids, attention_mask, 2, 0.7)
        expected = ppo.response_logprobs(base, input_ids, attention_mask, 2, 0.7)
    torch.testing.assert_close(off, expected, atol=1e-6, rtol=1e-6)
    assert (on - expected).abs().max() > 1e-3  # the adapters do change the policy when on


def test_adapter_dropout_acts_in_the_update_only():
    """--lora_dropout: the adapters' dropout is off as loaded (sampling, evaluation), on between
    adapter_dropout(.., on=True) and (.., on=False) (the update), and nothing else in the model leaves eval mode."""
    run = RunSettings(lora_r=4, lora_alpha=8.0, lora_dropout=0.5)
    policy = load_model(AutoModelForCausalLM, POLICY, run, "cpu", trained=True)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    input_ids, attention_mask = left_pad([[5, 9, 14, 30, 41], [12, 50, 60]], 1, "cpu")

    def logprobs():
        with torch.no_grad():
            return ppo.response_logprobs(policy, input_ids, attention_mask, 2, 1.0)

    def training_modules():
        return {n for n, m in policy.named_modules() if m.training}

    off = logprobs()
    assert training_modules() == set()
    assert torch.equal(logprobs(), off)
    adapter_dropout([policy], on=True)
    assert training_modules()
    assert all("lora_dropout" in n.split(".") for n in training_modules())
    assert not torch.equal(logprobs(), logprobs())  # a new dropout mask at each forward
    adapter_dropout([policy], on=False)
    assert training_modules() == set()
    assert torch.equal(logprobs(), off)


def test_a_run_with_adapter_dropout_trains_with_it(tmp_path):
    """In a run, the first minibatch's ratio equals 1 exactly without --lora_dropout and only on average with it, once
    the adapters are away from their zero start (the second iteration)."""
    sizes = ["--rollout_batch_size=2", "--num_generations=8", "--minibatch_size=16", "--micro_batch_size=16"]
    args = [*LORA, *sizes, "--total_episodes=32", "--response_length=8", "--eval_every=0"]
    without, _ = run_main("grpo.py", tmp_path / "without", *args)
    with_dropout, _ = run_main("grpo.py", tmp_path / "with", *args, "--lora_dropout=0.3")
    assert without[-1]["policy/first_ratio_dev"] < 1e-5 < with_dropout[-1]["policy/first_ratio_dev"]


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory):
    """ppo.py with LoRA on the policy and the critic, two iterations, saved merged and (same seed, same run) as
    adapters."""
    out = {}
    for kind, extra in (("merged", []), ("adapters", ["--save_adapters_only"])):
        out[kind] = tmp_path_factory.mktemp(kind)
        run_main(
            "ppo.py",
            out[kind],
            *LORA,
            *extra,
            *tiny_run("ppo.py", rollout_batch_size=16, total_episodes=32, response_length=8, eval_every=0),
        )
    return out


def test_the_merged_save_is_the_base_plus_the_scaled_adapters(ppo_runs):
    config = json.load(open(ppo_runs["adapters"] / "adapter_config.json"))
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    adapters = load_file(str(ppo_runs["adapters"] / "adapter_model.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(POLICY).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(str(ppo_runs["merged"])).state_dict()
    assert merged.keys() == base.keys()
    targeted = set()
    for name in base:
        stem = name.removesuffix(".weight")
        a = adapters.get(f"base_model.model.{stem}.lora_A.weight")
        b = adapters.get(f"base_model.model.{stem}.lora_B.weight")
        if a is None:
            assert torch.equal(merged[name], base[name]), name  # no adapter: the base weight, untouched
            continue
        targeted.add(stem.split(".")[-1])
        assert b.abs().max() > 0  # trained away from its zero start
        torch.testing.assert_close(merged[name], base[name] + (8 / 4) * b @ a, atol=1e-6, rtol=1e-5, msg=name)
    assert targeted == {"q_proj", "v_proj"}


def test_rloo_with_lora_starts_at_the_reference(tmp_path):
    """The adapters start at zero, so at the first iteration the policy is its reference: the KL is 0 up to rounding."""
    options = tiny_run("rloo.py", total_episodes=16, response_length=8, eval_every=0)  # two iterations
    rows, _ = run_main("rloo.py", tmp_path, *LORA, *options)
    assert abs(rows[0]["objective/kl"]) < 1e-5
    assert rows[0]["objective/kl"] != rows[1]["objective/kl"]
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path)).config.architectures == ["LlamaForCausalLM"]


def test_save_adapters_only_needs_lora():
    with pytest.raises(SystemExit, match="--save_adapters_only needs adapters: pass --lora_r"):
        ppo.validate(make_args(ppo, save_adapters_only=True))


# ---------------------------------------------------------------- chat templates and stop tokens


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
    prompts, _ = load_prompts(path, "train", RunSettings(chat_template=True), tokenizer)
    assert prompts == [tokenizer(text, add_special_tokens=False)["input_ids"] for text in by_hand]
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    # the special token is one token, not its characters
    assert end in prompts[0]
    assert prompts[0].count(end) == 2
    # without --chat_template, text stays text and messages are still rendered
    prompts, _ = load_prompts(path, "train", RunSettings(), tokenizer)
    assert prompts == [
        tokenizer(by_hand[0], add_special_tokens=False)["input_ids"],
        tokenizer("the room was", add_special_tokens=False)["input_ids"],
    ]


def test_stop_tokens_are_eos_the_generation_config_and_the_end_of_turn(tmp_path):
    tokenizer = chat_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    # no generation_config.json here
    assert stop_token_ids(tokenizer, str(tmp_path)).tolist() == sorted([tokenizer.eos_token_id, end])
    plain = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [plain.eos_token_id, 7]}))
    assert stop_token_ids(plain, str(tmp_path)).tolist() == sorted({plain.eos_token_id, 7})


def test_a_response_ends_at_any_stop_token():
    """Sample once with no stop token reachable; then make the token sampled third a stop token: the same response
    ends there, the mask covering it, pad after it, and with the same log-probs up to it."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(tiny_llama_config()).eval()
    prompt_ids, prompt_mask = left_pad([[5, 6, 7]], 0, "cpu")
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
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
    tokenizer.chat_template = None  # a tokenizer saved without one (the embedded one has one)
    path = write_rows(tmp_path / "bad.jsonl", [{"prompt": "fine"}, {"prompt": prompt}])
    with pytest.raises(SystemExit, match=message):
        load_prompts(path, "train", RunSettings(chat_template=chat_template), tokenizer)


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
    metrics, printed = run_main("ppo.py", tmp_path / "out", *chat, *options)
    assert [r["iteration"] for r in metrics] == [1, 2]
    assert "<|user|>" in printed
    assert "<|assistant|>" in printed


def test_a_lone_surrogate_and_a_broken_chat_template_are_named(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"), padding_side="left")
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "\\ud83d+1=", "answer": 2}\n')  # JSON's half an emoji
    with pytest.raises(SystemExit, match=r"row 2 of .* holds a lone surrogate \(half of a UTF-16 pair\); fix its text"):
        load_prompts(str(data), "train", RunSettings(), tokenizer, grpo.Args().reward_fn)
    for template, error in (
        ("{{ raise_exception('no system role') }}", "no system role"),
        ("{% for m in messages %}<|{{ m['role'] }}|>{% endfor %}", "substring not found"),
    ):
        tokenizer.chat_template = template  # one that raises; one that leaves the assistant's answer out
        with pytest.raises(
            SystemExit,
            match=rf"the chat template of 'here' fails on a user turn and its answer "
            rf"\(.*{error}.*\); fix it",
        ):
            stop_token_ids(tokenizer, "here")


def test_a_template_that_raises_is_named_before_the_chat_prompts_are_rendered(tmp_path):
    """load_task tries the template before it renders any prompt with it."""
    policy = tmp_path / "policy"
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-sft"), policy)
    config = json.loads((policy / "tokenizer_config.json").read_text())
    (policy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ raise_exception('x') }}"}))
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": 2}) + "\n")
    args = make_args(
        grpo, model_name_or_path=str(policy), dataset=str(data), eval_every=0, output_dir=str(tmp_path / "run")
    )
    with pytest.raises(SystemExit, match="the chat template of .* fails on a user turn and its answer"):
        runtime.load_task(args, torch.device("cpu"))


# ---------------------------------------------------------------- gradient checkpointing and mixed precision


def batch():
    input_ids, attention_mask = left_pad(
        [[5, 9, 14, 30, 41, 7, 8], [12, 50, 60, 3], [70, 71, 72, 73, 74, 75]], 1, "cpu"
    )
    return input_ids, attention_mask


def loss_and_block_calls(model):
    """The gradient of a log-prob loss, and how often the first block's MLP ran for one forward and backward."""
    calls = []
    mlp = model.model.layers[0].mlp
    forward = mlp.forward

    def counted(x):  # counted even in the backward's recompute, which runs no hooks
        calls.append(1)
        return forward(x)

    mlp.forward = counted
    input_ids, attention_mask = batch()
    logprobs = ppo.response_logprobs(model, input_ids, attention_mask, 3, 0.7)
    (-(logprobs * attention_mask[:, 3:]).sum()).backward()
    del mlp.forward
    return {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)


def test_gradient_checkpointing_recomputes_each_block_and_changes_no_gradient():
    plain = load_model(AutoModelForCausalLM, POLICY, RunSettings(), "cpu", trained=True)
    checkpointed = load_model(
        AutoModelForCausalLM, POLICY, RunSettings(gradient_checkpointing=True), "cpu", trained=True
    )
    grads, plain_calls = loss_and_block_calls(plain)
    grads_checkpointed, checkpointed_calls = loss_and_block_calls(checkpointed)
    assert (plain_calls, checkpointed_calls) == (1, 2)  # the block ran again in the backward pass
    for name in grads:
        torch.testing.assert_close(grads_checkpointed[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)
    # no dropout anywhere
    assert not any(m.training for m in checkpointed.modules() if type(m).__name__ not in checkpointed._no_split_modules)


def test_mixed_precision_computes_in_bf16_over_float32_weights():
    run = RunSettings(mixed_precision=True)
    policy = load_model(AutoModelForCausalLM, POLICY, run, "cpu", trained=True)
    frozen = load_model(AutoModelForCausalLM, POLICY, run, "cpu", trained=False)
    plain = load_model(AutoModelForCausalLM, POLICY, RunSettings(), "cpu", trained=True)
    input_ids, attention_mask = batch()
    logits = policy(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask)
    ).logits
    assert logits.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    assert all(p.dtype == torch.bfloat16 for p in frozen.parameters())
    grads, _ = loss_and_block_calls(policy)
    assert all(g.dtype == torch.float32 for g in grads.values())
    # bf16 keeps 8 bits of mantissa (0.4%): the log-probs are float32's to about 1%, and not bitwise (bf16 did run)
    with torch.no_grad():
        mixed = ppo.response_logprobs(policy, input_ids, attention_mask, 3, 0.7)
        exact = ppo.response_logprobs(plain, input_ids, attention_mask, 3, 0.7)
    torch.testing.assert_close(mixed, exact, rtol=1e-2, atol=1e-2)
    assert not torch.equal(mixed, exact)


@pytest.mark.parametrize("option", ["mixed_precision", "gradient_checkpointing"])
def test_the_static_decode_loop_records_the_training_log_probs_with_the_option(option):
    """rlhf_kernels' static decode loop through a forward under bf16 autocast (--mixed_precision) or with the blocks
    flagged for recomputation (--gradient_checkpointing, which must not drop the cache while sampling): the log-probs
    recorded while sampling are a teacher-forced pass's through the same model, so that the first ratio is 1 (to bf16's
    rounding under autocast, about 1%)."""
    policy = load_model(AutoModelForCausalLM, POLICY, RunSettings(**{option: True}), "cpu", trained=True)
    prompt_ids, prompt_mask = batch()
    uniforms = torch.rand(3, 12, generator=torch.Generator().manual_seed(5))
    sampling = ppo.Sampling(12, 0.7, torch.tensor([0]), 1, kernel_decode=True)
    responses, logprobs, response_mask = ppo.generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
    input_ids = torch.cat([prompt_ids, responses], 1)
    with torch.no_grad():
        teacher_forced = ppo.response_logprobs(
            policy, input_ids, torch.cat([prompt_mask, response_mask], 1), prompt_ids.shape[1], 0.7
        )
    tolerance = 2e-2 if option == "mixed_precision" else 2e-5
    torch.testing.assert_close(teacher_forced * response_mask, logprobs, atol=tolerance, rtol=tolerance)


def test_mixed_precision_refuses_bf16_master_weights():
    with pytest.raises(SystemExit, match="--mixed_precision keeps float32 master weights"):
        ppo.validate(make_args(ppo, mixed_precision=True, model_dtype="bfloat16"))


def test_one_iteration_with_the_option(tmp_path):
    """Both options in one run (each one's own effect is tested above, in this process). One script suffices: both
    act only in rlhf_runtime.loading.load_model, alike for every script, and the algorithms' math reads float32
    log-probs, values and scores under either; ppo.py loads every kind of model (the trained policy and critic, the
    reference and reward model frozen in bf16)."""
    # the tiny run's 8 responses, one iteration, in two micro-batches of 4
    one_iteration = tiny_run("ppo.py", micro_batch_size=4, total_episodes=8, response_length=8, eval_every=0)
    rows, _ = run_main("ppo.py", tmp_path, "--gradient_checkpointing", "--mixed_precision", *one_iteration)
    assert [r["iteration"] for r in rows] == [1]
    assert all(torch.isfinite(torch.tensor(v)) for k, v in rows[0].items() if k.startswith(("policy/", "objective/")))
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert all(p.dtype == torch.float32 for p in saved.parameters())  # the master weights are what is saved
