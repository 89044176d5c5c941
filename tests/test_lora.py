"""LoRA (shared code, tested through ppo.py's copy and runs of ppo.py and rloo.py): the reference is the policy with
its adapters off and holds no weights of its own; training moves only the adapters (and the critic's head); the merged
save equals the base plus (alpha / r) B A computed by hand from the adapters-only save, and loads with
from_pretrained."""

import json
import os

import pytest
import torch
from helpers import ROOT, run_script, tiny_run
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import ppo

POLICY = os.path.join(ROOT, "assets", "tiny-sft")
LORA = ["--lora_r=4", "--lora_alpha=8", "--lora_target_modules", "q_proj", "v_proj"]


def test_the_reference_is_the_base_with_the_adapters_off():
    args = ppo.Args(lora_r=4, lora_alpha=8.0, lora_target_modules=("q_proj", "v_proj"))
    policy = ppo.load_model(AutoModelForCausalLM, POLICY, args, "cpu", trained=True)
    reference = ppo.load_reference(args, policy, "cpu")
    assert list(reference.parameters()) == []  # no second copy of the weights
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == {
        n for n, _ in policy.named_parameters() if "lora_" in n
    }
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:  # B starts at zero (adapters on = off); give it something to switch off
                p.copy_(torch.randn_like(p) * 0.1)
    base = AutoModelForCausalLM.from_pretrained(POLICY).eval()
    input_ids, attention_mask = ppo.left_pad([[5, 9, 14, 30, 41], [12, 50, 60]], 1, "cpu")
    with torch.no_grad():
        off = ppo.response_logprobs(reference, input_ids, attention_mask, 2, 0.7)
        on = ppo.response_logprobs(policy, input_ids, attention_mask, 2, 0.7)
        expected = ppo.response_logprobs(base, input_ids, attention_mask, 2, 0.7)
    torch.testing.assert_close(off, expected, atol=1e-6, rtol=1e-6)
    assert (on - expected).abs().max() > 1e-3  # the adapters do change the policy when on


def test_adapter_dropout_acts_in_the_update_only():
    """--lora_dropout: the adapters' dropout is off as loaded (sampling, evaluation), on between
    adapter_dropout(.., on=True) and (.., on=False) (the update), and nothing else in the model leaves eval mode."""
    args = ppo.Args(lora_r=4, lora_alpha=8.0, lora_dropout=0.5)
    policy = ppo.load_model(AutoModelForCausalLM, POLICY, args, "cpu", trained=True)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    input_ids, attention_mask = ppo.left_pad([[5, 9, 14, 30, 41], [12, 50, 60]], 1, "cpu")

    def logprobs():
        with torch.no_grad():
            return ppo.response_logprobs(policy, input_ids, attention_mask, 2, 1.0)

    def training_modules():
        return {n for n, m in policy.named_modules() if m.training}

    off = logprobs()
    assert training_modules() == set()
    assert torch.equal(logprobs(), off)
    ppo.adapter_dropout([policy], on=True)
    assert training_modules()
    assert all("lora_dropout" in n.split(".") for n in training_modules())
    assert not torch.equal(logprobs(), logprobs())  # a new dropout mask at each forward
    ppo.adapter_dropout([policy], on=False)
    assert training_modules() == set()
    assert torch.equal(logprobs(), off)


def test_a_run_with_adapter_dropout_trains_with_it(tmp_path):
    """In a run, the first minibatch's ratio equals 1 exactly without --lora_dropout and only on average with it, once
    the adapters are away from their zero start (the second iteration)."""
    sizes = ["--rollout_batch_size=2", "--num_generations=8", "--minibatch_size=16", "--micro_batch_size=16"]
    args = [*LORA, *sizes, "--total_episodes=32", "--response_length=8", "--eval_every=0"]
    without, _ = run_script("grpo.py", tmp_path / "without", *args)
    with_dropout, _ = run_script("grpo.py", tmp_path / "with", *args, "--lora_dropout=0.3")
    assert without[-1]["policy/first_ratio_dev"] < 1e-5 < with_dropout[-1]["policy/first_ratio_dev"]


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory):
    """ppo.py with LoRA on the policy and the critic, two iterations, saved merged and (same seed, same run) as
    adapters."""
    out = {}
    for kind, extra in (("merged", []), ("adapters", ["--save_adapters_only"])):
        out[kind] = tmp_path_factory.mktemp(kind)
        run_script(
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
    rows, _ = run_script("rloo.py", tmp_path, *LORA, *options)
    assert abs(rows[0]["objective/kl"]) < 1e-5
    assert rows[0]["objective/kl"] != rows[1]["objective/kl"]
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path)).config.architectures == ["LlamaForCausalLM"]


def test_save_adapters_only_needs_lora():
    with pytest.raises(SystemExit, match="--save_adapters_only needs adapters: pass --lora_r"):
        ppo.validate(ppo.Args(save_adapters_only=True))
