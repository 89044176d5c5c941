"""--gradient_checkpointing and --mixed_precision in one process (shared code, tested through ppo.py's copy): the
checkpointed model recomputes each block in the backward pass and gets the same gradients as the plain one; mixed
precision computes in bf16 over float32 master weights; each runs a whole iteration of every script."""

import os
from dataclasses import replace

import pytest
import torch
from helpers import ROOT, run_script, tiny_run
from transformers import AutoModelForCausalLM

import ppo

POLICY = os.path.join(ROOT, "assets", "tiny-sft")


def batch():
    input_ids, attention_mask = ppo.left_pad(
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
    plain = ppo.load_model(AutoModelForCausalLM, POLICY, ppo.Args(), "cpu", trained=True)
    checkpointed = ppo.load_model(
        AutoModelForCausalLM, POLICY, ppo.Args(gradient_checkpointing=True), "cpu", trained=True
    )
    grads, plain_calls = loss_and_block_calls(plain)
    grads_checkpointed, checkpointed_calls = loss_and_block_calls(checkpointed)
    assert (plain_calls, checkpointed_calls) == (1, 2)  # the block ran again in the backward pass
    for name in grads:
        torch.testing.assert_close(grads_checkpointed[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)
    # no dropout anywhere
    assert not any(m.training for m in checkpointed.modules() if type(m).__name__ not in checkpointed._no_split_modules)


def test_mixed_precision_computes_in_bf16_over_float32_weights():
    args = ppo.Args(mixed_precision=True)
    policy = ppo.load_model(AutoModelForCausalLM, POLICY, args, "cpu", trained=True)
    frozen = ppo.load_model(AutoModelForCausalLM, POLICY, args, "cpu", trained=False)
    plain = ppo.load_model(AutoModelForCausalLM, POLICY, ppo.Args(), "cpu", trained=True)
    input_ids, attention_mask = batch()
    logits = policy(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=ppo.position_ids_from(attention_mask)
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
    policy = ppo.load_model(AutoModelForCausalLM, POLICY, ppo.Args(**{option: True}), "cpu", trained=True)
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
        ppo.validate(replace(ppo.Args(), mixed_precision=True, model_dtype="bfloat16"))


@pytest.mark.parametrize("option", ["--gradient_checkpointing", "--mixed_precision"])
@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "rloo.py"])
def test_one_iteration_with_the_option(script, option, tmp_path):
    # the tiny run's 8 responses, one iteration, in two micro-batches of 4
    one_iteration = tiny_run(script, micro_batch_size=4, total_episodes=8, response_length=8, eval_every=0)
    rows, _ = run_script(script, tmp_path, option, *one_iteration)
    assert [r["iteration"] for r in rows] == [1]
    assert all(torch.isfinite(torch.tensor(v)) for k, v in rows[0].items() if k.startswith(("policy/", "objective/")))
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert all(p.dtype == torch.float32 for p in saved.parameters())  # the master weights are what is saved
