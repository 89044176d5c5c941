"""Loading the models: the policy and the critic to train, the frozen reference and reward models, each with every
choice explicit (dtype, bf16 autocast, activation checkpointing, LoRA adapters, FSDP2 shards). The guarantee: every
model in eval mode (no dropout, so a first ratio is 1), frozen ones without gradients, and under LoRA the reference
is the policy with its adapters off.
"""

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from transformers.modeling_layers import GradientCheckpointingLayer

from rlhf_runtime.processes import shard


def load_model(model_class, path, run, device, trained, **kwargs):
    """from_pretrained with every choice explicit, then autocast, checkpointing, LoRA and FSDP2 as asked."""
    dtype = torch.bfloat16 if run.mixed_precision and not trained else getattr(torch, run.model_dtype)  # frozen: bf16
    model = model_class.from_pretrained(path, dtype=dtype, use_kernels=False, **kwargs).to(device).eval()
    if run.hub_kernels:  # once on its device: on the CPU, at load time, nothing is replaced
        from kernels import Mode

        model.set_use_kernels(True, mode=Mode.TRAINING if trained else Mode.INFERENCE)
    model.requires_grad_(trained)
    if model_class is AutoModelForCausalLM:  # the policy and its reference: equal weights, equal log-probs
        model.get_output_embeddings().register_forward_pre_hook(contiguous_input)
    if run.mixed_precision and not dist.is_initialized():  # one process: autocast, as FSDP2's policy under torchrun
        model.forward = torch.autocast(torch.device(device).type, dtype=torch.bfloat16)(model.forward)
        for module in model.modules():
            if type(module).__name__.endswith("RotaryEmbedding"):
                module.register_forward_hook(rotary_in_bf16)
    if run.gradient_checkpointing and trained:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        if not blocks:
            raise SystemExit(f"'{path}' has no blocks transformers 5 can checkpoint; drop --gradient_checkpointing.")
        for block in blocks:  # recomputed only in training mode: the blocks alone, their layers stay in eval mode
            block.training = True
    if run.lora_r and trained:  # the base frozen, the adapters (and a classifier's head) trained
        from peft import get_peft_model

        task_type = "CAUSAL_LM" if model_class is AutoModelForCausalLM else "SEQ_CLS"
        model = get_peft_model(model, lora_config(run, task_type)).eval()
    if trained or not run.replicate_frozen:  # under torchrun
        shard(model, run.mixed_precision)
    return model


def rotary_in_bf16(rotary, inputs, cos_sin):
    """A hook on a rotary embedding under autocast: its cos and sin in bf16, as FSDP2's policy makes them (a float32
    trunk makes the keys float32: a cache 1.5x as large, cast to bf16 at every step)."""
    return tuple(x.to(torch.bfloat16) for x in cos_sin)


def lora_config(run, task_type):
    """The adapters of --lora_r (peft)."""
    from peft import LoraConfig

    targets = "all-linear" if run.lora_target_modules == ("all-linear",) else list(run.lora_target_modules)
    return LoraConfig(
        r=run.lora_r,
        lora_alpha=run.lora_alpha,
        lora_dropout=run.lora_dropout,
        target_modules=targets,
        task_type=task_type,
    )


def adapter_dropout(models, *, on):
    """--lora_dropout, the one exception to eval mode, on for the update alone (first ratios then 1 on average)."""
    for model in models:
        for name, module in model.named_modules():
            if "lora_dropout" in name.split(".") and isinstance(module, torch.nn.Dropout):
                module.train(on)


class AdaptersOff(torch.nn.Module):
    """The reference under LoRA: the policy with its adapters off (held outside the registry: no weights of its own)."""

    def __init__(self, policy):
        super().__init__()
        self.__dict__["policy"] = policy

    def forward(self, **inputs):
        with self.policy.disable_adapter():
            return self.policy(**inputs)


def contiguous_input(head, args):
    """The LM head's input made contiguous. On the strided slice logits_to_keep gives it, torch's matmul takes one
    path for a trained head and another for a frozen one: contiguous, they agree bit for bit."""
    return (args[0].contiguous(),)


def load_reference(run, policy, device):
    """The frozen reference: a second copy of the starting policy, or under LoRA the policy with its adapters off."""
    if run.lora_r:
        return AdaptersOff(policy)
    return load_model(AutoModelForCausalLM, run.model_name_or_path, run, device, trained=False)


def lora_policy_to_save(weights, run):
    """Under LoRA, the policy to save: the base with the adapters merged in, or --save_adapters_only's adapters."""
    from peft import get_peft_model

    base = AutoModelForCausalLM.from_pretrained(
        run.model_name_or_path, dtype=getattr(torch, run.model_dtype), use_kernels=False
    )
    model = get_peft_model(base, lora_config(run, "CAUSAL_LM"))
    model.load_state_dict(weights)
    if run.save_adapters_only:
        return model
    return model.merge_and_unload()


def load_reward_models(paths, tokenizer, run, device):
    """(frozen reward model, its own tokenizer) pairs, the tokenizer None where it reads the policy's tokens."""
    pairs = []
    for path in paths:
        try:
            own = AutoTokenizer.from_pretrained(path, padding_side="left")
        except (OSError, ValueError, TypeError):  # none saved: transformers raises, or builds one of special tokens
            own = None
        if own is not None and (
            set(own.get_vocab()) <= set(own.all_special_tokens) or own.get_vocab() == tokenizer.get_vocab()
        ):
            own = None
        if own is not None and own.pad_token_id is None:
            own.pad_token = own.eos_token or own.unk_token
        reads = own or tokenizer
        n = AutoConfig.from_pretrained(path).vocab_size  # checked before the weights load
        largest = max(reads.get_vocab().values())  # not len(): a vocabulary's ids need not start at 0 or be dense
        if reads.pad_token_id is None or largest >= n:  # a token to pad with, and ids the model can embed
            raise SystemExit(
                f"the tokenizer beside --reward_model_path '{path}' has no pad, EOS or unk token, or ids "
                f"past the model's {n} embeddings (its largest is {largest}); save the one it was trained with "
                "beside it."
            )
        model = load_model(AutoModelForSequenceClassification, path, run, device, trained=False, num_labels=1)
        model.config.pad_token_id = reads.pad_token_id
        pairs.append((model, own))
    return pairs
