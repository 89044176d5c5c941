"""RLOO in one file: sample k responses per prompt, score them, and take a policy-gradient step on each
response with the mean score of the other k - 1 as its baseline.

REINFORCE Leave-One-Out (Ahmadian et al., 2024, "Back to Basics", arXiv:2402.14740; the estimator is
Kool et al.'s, 2019) is grpo.py with the baseline of REINFORCE instead of a normalised group advantage:
A_i = r_i - mean_{j != i} r_j, the same for every token of response i, with no division by a standard
deviation. The KL to the frozen reference is subtracted from each response's reward, as in ppo.py, but
summed over the response instead of token by token. `diff grpo.py rloo.py` shows exactly what changes.

Where this file departs from the paper, and why:
- With one update per rollout (the default: one epoch, one minibatch) the loss is the paper's REINFORCE,
  -A log pi. With more (--num_epochs > 1 or several minibatches) the data goes stale, so the PPO clip on
  the ratio to logprobs_old keeps each step proximal.
- Scores are normalised by running moments and a response without EOS pays a penalty, as in ppo.py.
- --kl_in_loss moves the KL from the reward into the loss (grpo.py's k3 term), an option the paper lacks.
- --policy_loss gspo (GSPO, Zheng et al. 2025: one clipped ratio per response) or cispo (MiniMax-M1's
  clipped, detached importance weight on every token's log pi) replaces the per-token clipped surrogate.
- logprobs_old are recorded while sampling, as in ppo.py, and dropout stays off.

How to read it: Args, the math, the forward passes, main (the loop as numbered steps); below it, shared plumbing.

Commands: `python rloo.py` (the embedded default: reviews, the tiny reward model, CPU); `python rloo.py
--model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --reward_model_path <rm> --dataset <prompts.jsonl> --mixed_precision
--learning_rate 1e-6` (one GPU, hub models); `torchrun --nproc_per_node=8 rloo.py --args ...` (one process per GPU,
every model sharded with FSDP2).
"""

import datetime
import functools
import hashlib
import importlib.util
import inspect
import json
import math
import multiprocessing.connection
import os
import pathlib
import pkgutil
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, fields
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import tyro
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grad_norm_
from tqdm import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
)
from transformers.cache_utils import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import logging as hf_logging

try:  # generate's decode steps on a static cache, each one CUDA graph (rlhf_kernels/): one launch a step on one GPU
    from rlhf_kernels import static_decode
except ImportError:  # this file copied alone: generate decodes with its own plain loop
    static_decode = None
try:  # the fused log-softmax-gather of this file's repository (rlhf_kernels/): no float32 copy of the logits
    from rlhf_kernels import token_logprobs
except ImportError:  # this file copied alone: the same log-probs from plain torch (start_processes says so)

    def token_logprobs(logits, tokens, temperature=1.0, return_entropy=False, check_range=True):
        """log softmax(logits / temperature) (..., V) at tokens (...), in float32, and the entropy (...)."""
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (..., V)
        chosen = logp.gather(-1, tokens[..., None]).squeeze(-1)  # (...)
        entropy = -(logp.exp() * logp.clamp(min=-1e4)).sum(-1)  # the clamp: 0 * -inf would be nan
        return (chosen, entropy) if return_entropy else chosen


ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")  # the embedded example, beside this file


@dataclass
class Args:
    # the task: what is trained on, how it is scored, where it is written
    exp_name: str = "rloo"
    """name of the run (wandb run name)"""
    output_dir: str = "runs/rloo"
    """where metrics.jsonl, args.json and the final policy are written"""
    dataset: str = f"{ASSETS}/reviews/train.jsonl"
    """training prompts: a local .jsonl, .json, .csv, .tsv or .parquet file (.gz/.bz2/.xz too), or a hub dataset"""
    reward_model_path: tuple[str, ...] = (f"{ASSETS}/tiny-rm",)
    """reward models (sequence classifiers, one label); with several, the score is their minimum"""
    reward_fn: tuple[str, ...] = ()
    """rules, weighted, added to reward models' minimum: arithmetic, gsm8k, f.py:fn (TRL's, verl's, OpenRLHF's too)"""
    reward_weights: tuple[float, ...] = ()
    """the weight of each --reward_fn, in order (none given: 1 each)"""

    # RLOO: k samples per prompt, a leave-one-out baseline, the KL in the reward
    total_episodes: int = 64000
    """responses sampled over the whole run"""
    rollout_batch_size: int = 16
    """prompts per iteration, over all processes; each is sampled num_generations times"""
    num_generations: int = 4
    """k, responses per prompt: each one's baseline is the mean score of the other k - 1"""
    minibatch_size: int = 64
    """responses per optimiser step, over all processes"""
    micro_batch_size: int = 64
    """responses per forward/backward in one process (gradient accumulation makes up the minibatch; a value at least
    the per-process minibatch is one micro-batch, so the defaults hold under torchrun)"""
    num_epochs: int = 1
    """passes over each rollout; more than one update per rollout switches REINFORCE to the clipped loss"""
    learning_rate: float = 3e-4
    """policy learning rate (hub-sized models want 1e-6 to 5e-6)"""
    clip_range_low: float = 0.2
    """ratios below 1 - clip_range_low stop pushing a token down"""
    clip_range_high: float = 0.2
    """ratios above 1 + clip_range_high stop pushing a token up (DAPO's clip-higher raises it, e.g. to 0.28)"""
    policy_loss: Literal["clip", "gspo", "cispo"] = "clip"
    """the surrogate: PPO's clipped ratio per token; GSPO's one clipped ratio per response (the paper: --clip_range_low
    3e-4 --clip_range_high 4e-4); CISPO's clipped, detached weight on every token's log pi (no lower bound: low 1)"""
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = "constant"
    """how token losses become the minibatch loss; constant is the paper's sum of log-probs over a response, divided
    by a constant"""
    kl_coef: float = 0.2
    """beta: the KL to the reference, summed over a response, is subtracted from its reward; 0 skips the reference
    model"""
    kl_in_loss: bool = False
    """put the KL in the loss (the --kl_estimator term of grpo.py) instead of the reward"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """the per-token KL estimate in the loss (see kl_penalty)"""
    drop_zero_signal_groups: bool = False
    """leave groups whose responses all scored the same out of the loss"""
    normalize_reward: bool = True
    """normalise scores by the running mean and std of all scores seen so far"""

    # the models and the data
    model_name_or_path: str = f"{ASSETS}/tiny-sft"
    """the starting policy (a causal LM); the frozen reference is a copy of it"""
    model_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the models' weights"""
    hub_kernels: bool = False
    """let transformers replace layers with kernels it downloads from the Hugging Face Hub (GPU; needs the network)"""
    dataset_split: str = "train"
    """split of a hub --dataset"""
    dataset_config: str | None = None
    """configuration of a hub --dataset and --eval_dataset, for those that have several (openai/gsm8k: main)"""
    prompt_field: str = "prompt"
    """the dataset column holding the prompts: text, or chat messages (a list of {"role", "content"})"""
    chat_template: bool = False
    """render each text prompt as one user message through the tokenizer's chat template (chat messages always are)"""
    answer_field: str = "answer"
    """the column of the reference answers (for the rules); a.b reads a nested one (verl's reward_model.ground_truth)"""
    max_prompt_length: int = 64
    """longest prompt in tokens"""
    truncate_prompts: bool = False
    """cut longer prompts to their last max_prompt_length tokens (with a warning) instead of stopping"""
    seed: int = 1
    """random seed, the same on every process (each draws every process's numbers and keeps its own)"""

    # generation and the shared loss terms
    response_length: int = 24
    """most new tokens per response"""
    temperature: float = 1.0
    """sampling temperature; the log-probs of training and KL use the same temperature"""
    decode: Literal["auto", "plain"] = "auto"
    """auto: on one GPU, rlhf_kernels' decode step, each one CUDA graph; plain (and elsewhere): generate's own loop"""
    missing_eos_penalty: float = 1.0
    """subtracted from the score (after normalisation) of a response that never reaches EOS (or end of turn)"""
    mask_truncated: bool = False
    """leave responses cut off at --response_length out of the loss (DAPO's overlong filtering), not penalised"""
    dual_clip: float = 0.0
    """dual-clip PPO's c > 1 (the paper: 3): a token with a negative advantage A loses at most -c A; 0: off"""
    max_grad_norm: float = 1.0
    """gradient-norm clip, per trained model"""
    ent_coef: float = 0.0
    """weight of the entropy bonus (c2, 0 to 0.01)"""

    # evaluation and logging
    eval_dataset: str | None = None
    """held-out prompts (same format as --dataset); default: the test.<ext> beside a local train.<ext> --dataset"""
    eval_split: str = "test"
    """split of a hub --eval_dataset"""
    eval_every: int = 10
    """score the held-out prompts every this many iterations (and before the first and after the last); 0: never"""
    eval_batch_size: int = 100
    """held-out prompts per generation call"""
    log_samples_every: int = 10
    """print a few prompt / response / score rows every this many iterations"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "rlhf-reference"
    """wandb project name"""

    # alarms
    alarm_kl: float = 20.0
    """warn when the KL to the reference passes this (KL explosion)"""
    alarm_clipfrac: float = 0.3
    """warn when the clip fraction passes this (steps too large)"""
    alarm_collapse: float = 0.5
    """warn when entropy or distinct-2 falls below this fraction of its first value (mode collapse)"""

    # checkpoints and failures
    save_every: int = 50
    """write a checkpoint every this many iterations, and always at the end and on SIGTERM or Ctrl-C"""
    keep_checkpoints: int = 2
    """how many of the newest checkpoints to keep in --output_dir"""
    resume: str | None = None
    """continue from a checkpoint folder, or 'auto': the newest one in --output_dir (none there: start afresh)"""
    max_bad_steps: int = 3
    """stop after this many optimiser steps in a row with a non-finite loss or gradient (each one is skipped)"""
    on_reward_error: Literal["stop", "penalty"] = "stop"
    """a reward that raises or is not finite: stop, or score it --missing_eos_penalty below the batch minimum"""
    reward_timeout: float = 600.0
    """seconds a call of your --reward_fn, or its loading, may take (0.1 to 1e6; 0: no limit): then its process is
    killed, with all it started, and the call counts as a failed reward (a hung grader); SIGTERM or Ctrl-C ends it at
    once"""

    # precision and memory
    mixed_precision: bool = False
    """bf16 compute over fp32 weights and Adam states (FSDP2's policy, or autocast); frozen models in bf16"""
    gradient_checkpointing: bool = False
    """recompute each block's activations in the backward pass, not keeping them (less memory, 1/3 more compute)"""
    replicate_frozen: bool = False
    """under torchrun: a whole copy of the frozen models (reference, reward models) on every process, not shards"""

    # LoRA
    lora_r: int = 0
    """LoRA rank: adapters on each trained model's frozen base, the reference being the policy without (0: no LoRA)"""
    lora_alpha: float = 16.0
    """LoRA scale: an adapter adds (lora_alpha / lora_r) B A to its weight"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input, in the training forward only (not sampling, the reference or evaluation)"""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """the layers that get adapters: names such as q_proj v_proj, or all-linear (every linear layer but the head)"""
    save_adapters_only: bool = False
    """with LoRA: save only the adapters (peft's format) instead of the base with the adapters merged in"""

    # computed at runtime, not options
    world_size: tyro.conf.Suppress[int] = 1
    """number of processes, from WORLD_SIZE"""
    num_iterations: tyro.conf.Suppress[int] = 0
    """rollouts in the run: total_episodes // (rollout_batch_size * num_generations)"""


# ---------------------------------- The math: small pure functions, tensors in and tensors out ------------------
def masked_mean(x, mask):
    """Mean of x over its valid entries (mask 1): a 0-d tensor of x's dtype. x and mask (B, ...) alike."""
    total = torch.stack([(x * mask).sum(), mask.sum()]).double()  # summed in x's dtype, divided in float64
    return (total[0] / total[1].clamp(min=1)).to(x.dtype)


def masked_var(x, mask):
    """Biased variance of x over its valid entries: a 0-d tensor."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def clip_loss(logprobs, logprobs_old, advantages, clip_low, clip_high):
    """Per-token clipped surrogate, negated to be minimised (L^CLIP, Schulman et al. 2017, eq. 7):
    -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A) with rho = exp(logp - logp_old). The min switches the gradient
    off once a token has moved eps the way its advantage wants, never when it moved the other way. PPO's eps_low =
    eps_high; DAPO's clip-higher raises eps_high. Inputs (B, T), advantages maybe (B, 1); returns the loss, the ratio
    and whether each token was clipped, (B, T) each."""
    ratio = torch.exp(logprobs - logprobs_old)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    return -torch.min(unclipped, clipped), ratio, (clipped < unclipped).float()


def dual_clip_loss(loss, advantages, c):
    """Dual-clip PPO (Ye et al. 2020, arXiv:1912.09729, eq. 5): a token with A < 0 loses at most -c A (c > 1), where
    clip_loss's -rho A grows without bound as rho does; past the bound its gradient is 0. c = 0: the loss as it is.
    loss (B, T) from clip_loss, advantages (B, T) or (B, 1); returns the loss and where the bound took effect."""
    if not c:
        return loss, torch.zeros_like(loss)
    bounded = (advantages < 0) & (loss > -c * advantages)
    return torch.where(bounded, -c * advantages, loss), bounded.float()


def gspo_loss(logprobs, logprobs_old, advantages, mask, clip_low, clip_high):
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): one ratio per response, s = exp(mean over its tokens of
    log pi - log pi_old), in the clipped surrogate -min(s A, clip(s, 1-eps_low, 1+eps_high) A) on each of its tokens.
    The GSPO-token form: sg(s) exp(log pi - sg(log pi)) has the value s and the gradient s grad log pi per token, so
    with one advantage per response and sequence_mean aggregation the loss is the paper's sequence objective. Inputs
    (B, T), advantages (B, 1); returns the loss, the ratio s and whether its response was clipped, (B, T) each."""
    seq_log_ratio = ((logprobs - logprobs_old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    ratio = torch.exp(seq_log_ratio.detach() + logprobs - logprobs.detach())  # (B, T): s on every token
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    return -torch.min(unclipped, clipped), ratio, (clipped < unclipped).float()


def cispo_loss(logprobs, logprobs_old, advantages, clip_low, clip_high):
    """CISPO (MiniMax-M1, arXiv:2506.13585): the importance weight itself clipped and detached, every token keeping
    its gradient, however far its ratio moved: -sg(clip(rho, 1-eps_low, 1+eps_high)) A log pi with rho = exp(log pi
    - log pi_old). Inputs (B, T), advantages (B, 1); returns the loss, rho and whether each token's weight was
    clipped, (B, T) each."""
    ratio = torch.exp(logprobs - logprobs_old)
    weight = torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach()
    return -weight * advantages * logprobs, ratio, (weight != ratio).float()


def policy_loss(kind, logprobs, logprobs_old, advantages, mask, clip_low, clip_high):
    """The loss --policy_loss names: PPO's clip, GSPO or CISPO. Returns the per-token loss, the ratio and what was
    clipped, (B, T) each."""
    if kind == "gspo":
        return gspo_loss(logprobs, logprobs_old, advantages, mask, clip_low, clip_high)
    if kind == "cispo":
        return cispo_loss(logprobs, logprobs_old, advantages, clip_low, clip_high)
    return clip_loss(logprobs, logprobs_old, advantages, clip_low, clip_high)


def rloo_advantages(rewards, k):
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, eq. 6): A_i = r_i - mean_{j != i} r_j, which equals
    k / (k - 1) * (r_i - mean(r_group)); exactly 0 in a group of equal rewards (not the rounding of the mean of the
    others). rewards (B,) hold consecutive groups of k. Returns (B,)."""
    grouped = rewards.view(-1, k)  # (groups, k)
    baseline = (grouped.sum(1, keepdim=True) - grouped) / (k - 1)  # (groups, k): the mean of the others
    return torch.where(zero_signal_groups(rewards, k)[:, None], 0.0, grouped - baseline).reshape(-1)


def kl_shaped_rewards(scores, logprobs_old, logprobs_ref, response_mask, kl_coef):
    """The reward of a whole response: its score minus beta times its KL to the reference, summed over its tokens
    (Ahmadian et al. 2024; ppo.py spreads the same sum over the tokens). scores (B,), the rest (B, T). Returns
    rewards (B,) and the KL (B,)."""
    kl = ((logprobs_old - logprobs_ref) * response_mask).sum(1)  # (B,) nats per response
    return scores - kl_coef * kl, kl


def update_moments(mean, var, count, batch_mean, batch_var, batch_count):
    """Merge a batch's mean and (biased) variance into running ones (Chan et al.'s parallel formula),
    so the running statistics equal those of the whole stream seen so far. Floats in, floats out."""
    total = count + batch_count
    delta = batch_mean - mean
    new_mean = mean + delta * batch_count / total
    m2 = var * count + batch_var * batch_count + delta**2 * count * batch_count / total
    return new_mean, m2 / total, total


def normalize_scores(score, every, moments):
    """The usual fix for value divergence: scores (B,) less the running mean, over the running std, the moments
    (mean, variance, count) of every score seen so far updated with every (N,), this iteration's scores of all
    processes (Chan et al.'s parallel formula). Returns the normalised scores (B,) and the updated moments."""
    ones = torch.ones_like(every)
    batch_mean = masked_mean(every, ones).item()
    batch_var = masked_var(every, ones).item()
    mean, var, count = update_moments(*moments, batch_mean, batch_var, float(len(every)))
    return (score - mean) / (var**0.5 + 1e-8), (mean, var, count)


def zero_signal_groups(scores, group_size):
    """Groups whose responses all scored the same (B / G,) bool: every advantage in them is 0, so they teach
    nothing. scores (B,) hold consecutive groups of group_size."""
    grouped = scores.view(-1, group_size)  # (groups, G)
    return (grouped == grouped[:, :1]).all(1)


def kl_penalty(logprobs, logprobs_ref, estimator, mask=None):
    """Per-token estimate (B, T) of KL(pi || pi_ref) from tokens sampled from pi (Schulman 2020, "Approximating KL
    divergence"), log r = log pi_ref - log pi, set to 0 past a response's end (mask 0) before any exp: no inf * 0 = nan
    can reach a sum. logprobs, logprobs_ref and mask (B, T):"""
    log_r = logprobs_ref - logprobs
    if mask is not None:
        log_r = torch.where(mask.bool(), log_r, 0.0)
    if estimator == "k1":
        return -log_r  # unbiased, but high variance and negative on some tokens
    if estimator == "k2":
        return 0.5 * log_r**2  # never negative, low variance, biased (exact to second order in log r)
    return torch.expm1(log_r) - log_r  # k3 = (r - 1) - log r: unbiased, never negative, low variance (GRPO, eq. 4)


def loss_weights(mask, aggregation, response_length, num_sequences, num_tokens):
    """Per-token weights w (B, T) such that the minibatch loss is sum w * loss; mask (B, T). num_sequences and
    num_tokens count the whole (global) minibatch, so micro-batches and processes add up to the same loss."""
    if aggregation == "token_mean":  # every token the same weight: a long response counts more than a short one (DAPO)
        return mask / max(num_tokens, 1)
    if aggregation == "sequence_mean":  # every response the same weight: a long one's tokens count less (GRPO)
        return mask / (mask.sum(1, keepdim=True).clamp(min=1) * max(num_sequences, 1))
    return mask / (max(num_sequences, 1) * response_length)  # a constant divisor: no length bias (Dr. GRPO)


# ---------------------- The rollout's forward passes: log-probs, values and scores, sampling with a KV cache ------
def response_logprobs(policy, input_ids, attention_mask, prompt_length, temperature, return_entropy=False):
    """Teacher-forced log-probs (and entropies) (B, T) of the response tokens input_ids[:, prompt_length:], exactly
    0 past each response's end (where attention_mask is 0): a pad's log-prob can be -1e4 at a low temperature, and
    an exp of it in a KL estimate or a ratio would turn the masked sum into inf * 0 = nan. Masked before any exp."""
    logits = policy(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from(attention_mask),
        logits_to_keep=input_ids.shape[1] - prompt_length + 1,
    ).logits  # the LM head on the last T + 1 only
    out = token_logprobs(logits[:, :-1], input_ids[:, prompt_length:], temperature, return_entropy=return_entropy)
    valid = attention_mask[:, prompt_length:].bool()  # (B, T)
    if return_entropy:
        logprobs, entropy = out
        return torch.where(valid, logprobs, 0.0), torch.where(valid, entropy, 0.0)
    return torch.where(valid, out, 0.0)


def combine_scores(rm_scores, rule_reward=None):
    """The minimum over reward models (the ensemble fix for reward exploitation), plus any rule reward: (B,)."""
    if rm_scores:
        score = torch.stack(rm_scores).min(0).values
    else:
        score = torch.zeros_like(rule_reward)
    if rule_reward is not None:
        score = score + rule_reward
    return score


def sample_token(logits, uniforms, temperature):
    """Each row's next token (B,), by inverse CDF of its uniform (B,) or greedy, and its log-prob under these logits."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    cdf = probs.cumsum(-1)  # scaled by its last entry below, so that rounding cannot leave it short of the draw
    if uniforms is None:
        token = probs.argmax(-1)  # (B,) greedy, for evaluation
    else:  # (B,) the first token whose cumulative probability passes the row's uniform
        token = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True)[:, 0].clamp(max=probs.shape[1] - 1)
    return token, token_logprobs(logits, token, temperature, check_range=False)  # drawn here: in range, no host sync


@torch.no_grad()
def generate(policy, prompt_ids, prompt_mask, sampling, uniforms=None):
    """Sample responses (B, T) to left-padded prompts (B, P) with a KV cache, with the log-prob of each token from the
    logits it was drawn from (logprobs_old) and the mask up to and including its stop token. Token t of row b is drawn
    by uniforms[b, t], drawn beforehand so that no response depends on its batch (none: greedy)."""
    hold_full_parameters(policy, hold=True)
    cache = DynamicCache()
    unique, copies = torch.unique_consecutive(torch.cat([prompt_ids, prompt_mask], 1), dim=0, return_inverse=True)
    ids, mask = unique.tensor_split([prompt_ids.shape[1]], 1)  # (U, P) each: the U prompts unlike the row before
    logits = policy(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids_from(mask),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[copies, -1]  # the last position's alone: (B, V)
    cache.reorder_cache(copies)  # a group's prompt encoded once, its keys and values repeated for its rows: (B, ...)
    next_position = position_ids_from(prompt_mask)[:, -1:] + 1  # (B, 1)
    if sampling.kernel_decode:  # --decode auto on one GPU: rlhf_kernels runs these steps as CUDA graphs, same tokens
        return static_decode(policy, cache, logits, prompt_mask, next_position, uniforms, sampling, sample_token)
    attention_mask = prompt_mask
    done = torch.zeros_like(prompt_ids[:, 0], dtype=torch.bool)  # (B,)
    tokens = []
    logprobs = []
    masks = []
    for step in range(sampling.max_new_tokens):
        step_uniforms = None if uniforms is None else uniforms[:, step]  # (B,); None: greedy
        token, logprob = sample_token(logits, step_uniforms, sampling.temperature)
        masks.append(~done)
        tokens.append(torch.where(done, sampling.pad_token_id, token))
        logprobs.append(torch.where(done, 0.0, logprob))
        done = done | torch.isin(token, sampling.stop_ids)
        if done.all() or step == sampling.max_new_tokens - 1:
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        out = policy(
            input_ids=tokens[-1][:, None],
            attention_mask=attention_mask,
            position_ids=next_position,
            cache=cache,
            use_cache=True,
        )
        logits = out.logits[:, -1]
        next_position = next_position + 1
    hold_full_parameters(policy, hold=False)
    return torch.stack(tokens, 1), torch.stack(logprobs, 1), torch.stack(masks, 1).long()


def build_models(args, tokenizer, device):
    """Load the policy, its frozen reference and the reward models, in eval mode (no dropout). With
    --kl_coef 0 nothing reads the reference, so it is not loaded at all."""
    policy = load_model(AutoModelForCausalLM, args.model_name_or_path, args, device, trained=True)
    ref_policy = load_reference(args, policy, device) if args.kl_coef > 0 else None
    reward_models = load_reward_models(args, tokenizer, device)
    return policy, ref_policy, reward_models


def validate(args):
    """Everything that can be checked before a model loads: one sentence for each mistake, naming the fix."""
    require(args, ("num_generations",), "must be at least 2 (the others are each one's baseline)", lambda v: v >= 2)
    require(args, ("learning_rate", "clip_range_low", "clip_range_high"), "must be positive", lambda v: v > 0)
    require(args, ("kl_coef",), "must be zero or more", lambda v: v >= 0)
    if args.dual_clip and args.policy_loss != "clip":
        raise SystemExit(
            f"--dual_clip bounds the clipped loss of a token's ratio; --policy_loss {args.policy_loss} has "
            "no such per-token term to bound (GSPO's ratio is per response, CISPO's weight is clipped already)."
        )
    check_common_args(args, responses_per_iteration=args.rollout_batch_size * args.num_generations)


# What the one line per iteration shows: (label, metric key, format); keys a run does not log are left out.
PRINTED = [
    ("score", "objective/score", "+.3f"),
    ("rule", "objective/rule_reward", ".3f"),
    ("kl", "objective/kl", ".2f"),
    ("len", "response/length", ".1f"),
    ("eos", "response/eos_rate", ".2f"),
    ("d2", "response/distinct2", ".2f"),
    ("ent", "policy/entropy", ".2f"),
    ("clip", "policy/clipfrac", ".3f"),
    ("zero-signal", "adv/zero_signal_fraction", ".2f"),
    ("held-out", "eval/score", "+.3f"),
]


def main(args):
    # --- 0. set-up: one process per device under torchrun (a plain run needs none); the data checked first ---
    # >>> shared: set-up
    rank, device = start_processes(args)
    validate(args)  # every argument checked: nothing is created or started before
    lock_output_dir(args)  # one run per folder
    reward_fns = load_reward_fns(args)  # your functions each started in a process of its own
    find_checkpoint(args)  # --resume: which checkpoint to go on from
    torch.manual_seed(args.seed)  # the same on every process: new weights (a head, adapters) start the same
    tokenizer, prompts, rows, held_out, sampling = load_task(args, device, reward_fns)
    # <<< shared: set-up
    G = args.num_generations
    responses_per_iteration = args.rollout_batch_size * G
    reinforce = args.num_epochs == 1 and args.minibatch_size == responses_per_iteration  # one update per rollout
    args.num_iterations = args.total_episodes // responses_per_iteration
    policy, ref_policy, reward_models = build_models(args, tokenizer, device)
    models = {"policy": policy}
    optimizers = {"policy": torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)}
    all_models = [m for m in (policy, ref_policy, *[rm for rm, _ in reward_models]) if m is not None]
    # Everything besides the model and optimiser that a resumed run needs, in one place.
    if args.resume:
        state = load_checkpoint(args, models, optimizers)
    else:
        state = new_state(score_moments=(0.0, 1.0, 0.0))
    # >>> shared: outputs and the starting policy's held-out score
    scorer = Scorer(reward_models, reward_fns, tokenizer, state)  # state: the iterations done, for TRL's functions
    log = Log(args, state, rank, tokenizer)
    stops = catch_stop_signals()  # the reasons to stop that come up: a signal, a failed reward
    if held_out[0] and not args.resume:  # the starting policy's score: the curves' first point
        log.evaluation(evaluate(policy, scorer, sampling, held_out, args, stops), state)
        stop_if_asked(stops, state, models, optimizers, args)
    # <<< shared: outputs and the starting policy's held-out score

    for iteration in range(state["iteration"] + 1, args.num_iterations + 1):
        clock = Stopwatch()
        rng = torch.Generator().manual_seed(args.seed * 1_000_000 + iteration)  # the same on every process
        # --- 1. prompts: the same shuffled order on every process, each taking its own slice ---
        idx, width, data_position = next_prompts(prompts, state["data_position"], args, rank)  # width: on any process
        idx = [i for i in idx for _ in range(G)]  # each prompt G times in a row: a group stays on one process
        prompt_ids, prompt_mask = left_pad([prompts[i] for i in idx], tokenizer.pad_token_id, device, width)
        P = prompt_ids.shape[1]  # (B, P), B = local prompts x G

        # --- 2. generate with the current policy, recording logprobs_old as we sample; 3. score the responses ---
        # >>> shared: generate and score
        uniforms = row_uniforms(rng, len(idx), args, rank).to(device)  # (B, response_length)
        responses, logprobs_old, response_mask = generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
        input_ids = torch.cat([prompt_ids, responses], 1)  # (B, P + T)
        attention_mask = torch.cat([prompt_mask, response_mask], 1)  # (B, P + T)
        clock.lap("generate")
        scores = score_responses(scorer, input_ids, attention_mask, P, [rows[i] for i in idx], args, stops)
        has_eos = torch.isin(responses, sampling.stop_ids).any(1)  # (B,) ended by EOS or the end of turn
        train_mask = response_mask * (has_eos | (not args.mask_truncated))[:, None]  # (B, T) what the loss reads
        stop_if_asked(stops, state, models, optimizers, args)  # a failed reward, a signal: the state before step 1
        # <<< shared: generate and score

        with torch.no_grad():
            score = scores.raw  # (B,)
            if args.normalize_reward:  # by the running mean and std of every process's scores so far
                every_score = gather_rows({"score": score})["score"]  # (N,)
                score, state["score_moments"] = normalize_scores(score, every_score, state["score_moments"])
            score = torch.where(has_eos | args.mask_truncated, score, score - args.missing_eos_penalty)

            # --- 4. the reference's log-probs, the KL-shaped reward, leave-one-out advantages, one per response ---
            response_reward = score  # (B,) what the advantages compare: the score, or the KL-shaped score
            if ref_policy is not None:
                logprobs_ref = (
                    in_chunks(
                        lambda i, m, p: response_logprobs(ref_policy, i, m, p, args.temperature),
                        args.micro_batch_size,
                        input_ids,
                        attention_mask,
                        P,
                    )
                    * response_mask
                )  # (B, T)
                shaped, seq_kl = kl_shaped_rewards(score, logprobs_old, logprobs_ref, response_mask, args.kl_coef)
                if not args.kl_in_loss:
                    response_reward = shaped  # (B,)
            advantages = rloo_advantages(response_reward, G)  # (B,)
            group_std = response_reward.view(-1, G).std(1, unbiased=False)  # (B / G,)
            zero_signal = zero_signal_groups(response_reward, G)  # (B / G,)
            if args.drop_zero_signal_groups:
                train_mask = train_mask * ~zero_signal.repeat_interleave(G)[:, None]  # (B, T)
        clock.lap("score")

        # --- 5. optimise: epochs of shuffled global minibatches, each process taking its share, in micro-batches ---
        rollout = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            has_eos=has_eos.float(),
            train_mask=train_mask,
            logprobs_old=logprobs_old,
            advantages=advantages,
        )
        if ref_policy is not None:
            rollout["logprobs_ref"] = logprobs_ref
        rollout = gather_rows(rollout)
        stats = defaultdict(float)  # sums over tokens of what the dashboard shows
        adapter_dropout(models.values(), on=True)  # --lora_dropout, in the training forward only
        for _epoch in range(args.num_epochs):
            perm = torch.randperm(responses_per_iteration, generator=rng).to(device)
            for mb_start in range(0, responses_per_iteration, args.minibatch_size):
                mb_idx = perm[mb_start : mb_start + args.minibatch_size]
                mb_mask = rollout["train_mask"][mb_idx]
                mb_tokens = mb_mask.sum().item()  # valid tokens in the global minibatch
                mb_sequences = mb_mask.amax(1).sum().item()  # responses it trains on
                mine = mb_idx.chunk(args.world_size)[rank]  # this process's share
                if mb_tokens == 0:  # every response left out: no step, not even Adam's momentum
                    continue
                for micro_idx in by_length(mine, rollout["attention_mask"]).split(args.micro_batch_size):  # sorted
                    micro, p = cut_padding({k: v[micro_idx] for k, v in rollout.items()}, P)  # cut: (micro, p + T')
                    mask = micro["train_mask"].float()  # (micro, T')
                    logprobs, entropy = response_logprobs(
                        policy, micro["input_ids"], micro["attention_mask"], p, args.temperature, return_entropy=True
                    )  # (micro, T') each
                    pg_loss, ratio, pg_clipped = policy_loss(
                        args.policy_loss,
                        logprobs,
                        micro["logprobs_old"],
                        micro["advantages"][:, None],
                        mask,
                        args.clip_range_low,
                        args.clip_range_high,
                    )
                    pg_loss, dual_clipped = dual_clip_loss(pg_loss, micro["advantages"][:, None], args.dual_clip)
                    if reinforce:  # the paper's -A log pi; at ratio 1 its gradient is the clipped loss's
                        pg_loss = -micro["advantages"][:, None] * logprobs
                    per_token = pg_loss - args.ent_coef * entropy  # (micro, T)
                    terms = {"policy/loss": pg_loss, "policy/entropy": entropy, "policy/clipfrac": pg_clipped}
                    if args.dual_clip:
                        terms["policy/dual_clipfrac"] = dual_clipped
                    if ref_policy is not None and args.kl_in_loss:
                        terms["policy/kl_term"] = kl_penalty(logprobs, micro["logprobs_ref"], args.kl_estimator, mask)
                        per_token = per_token + args.kl_coef * terms["policy/kl_term"]
                    weights = loss_weights(mask, args.loss_aggregation, args.response_length, mb_sequences, mb_tokens)
                    loss = (per_token * weights).sum()
                    loss.backward()  # under FSDP2, also sums the gradients over the processes
                    add_token_stats(stats, mask, ratio, logprobs, micro["logprobs_old"], terms)
                # >>> shared: optimiser step
                grad_norms = {}
                for name, model in models.items():
                    grad_norms[name] = clip_grad_norm_(model.parameters(), args.max_grad_norm)
                if step_is_finite(grad_norms, stats, state, iteration, args):  # a nan or inf gradient: no step
                    for optimizer in optimizers.values():
                        optimizer.step()
                for optimizer in optimizers.values():
                    optimizer.zero_grad(set_to_none=True)
                # <<< shared: optimiser step
        adapter_dropout(models.values(), on=False)
        clock.lap("optimize")

        # --- 6. the dashboard: batch statistics over all processes ---
        # >>> shared: dashboard
        state["iteration"] = iteration
        state["episodes"] += responses_per_iteration
        state["data_position"] = data_position
        m = dashboard(stats, state, scores, rollout, clock, args)
        m["memory/model_states_mb"] = megabytes_held(all_models, optimizers.values())  # this process's (rank 0's)
        # <<< shared: dashboard
        m["objective/group_reward_std"] = global_mean(group_std)
        m["adv/zero_signal_fraction"] = global_mean(zero_signal)
        m["health/zero_signal"] = m["adv/zero_signal_fraction"]  # of the groups drawn: all of them here
        m["adv/abs_mean"] = global_mean(advantages.abs())
        m["objective/score_normalized"] = global_mean(score)
        if ref_policy is not None:  # the KL in nats per response, as in ppo.py
            m["objective/kl"] = global_mean(seq_kl)
            m["objective/kl_coef"] = args.kl_coef
            m["objective/rlhf_reward"] = global_mean(scores.raw - args.kl_coef * seq_kl)

        # --- 7. held-out score, alarms for the classic failure modes, the log; 8. a checkpoint ---
        # >>> shared: evaluate, alarms, log and save
        if held_out[0] and (iteration % args.eval_every == 0 or iteration == args.num_iterations):
            m.update(evaluate(policy, scorer, sampling, held_out, args, stops))
        log.iteration(m, state, prompt_ids, scores.texts, scores.raw)
        if (args.save_every and iteration % args.save_every == 0) or iteration == args.num_iterations:
            save_checkpoint(args, models, optimizers, state, rank)
        stop_if_asked(stops, state, models, optimizers, args)

    # --- last: the final policy where from_pretrained can load it (under FSDP2, gathered from the shards) ---
    finish(policy, tokenizer, log, state, args, rank)
    # <<< shared: evaluate, alarms, log and save


# ======== Everything below is plumbing, identical in ppo.py, grpo.py, rloo.py and dapo.py: the algorithm is above ====


# ---- processes, the task and loading
def start_processes(args):
    """One process per device under torchrun, none in a plain run: sets args.world_size, returns rank and device."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    args.world_size = int(os.environ.get("WORLD_SIZE", 1))
    hf_logging.disable_progress_bar()  # transformers' loading and saving bars; the run's own bar stays
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=collective_timeout(args))
    else:  # a plain run's checkpoints are one process's, as meant: torch need not warn at each save and load
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    if rank == 0 and not token_logprobs.__module__.startswith("rlhf_kernels"):
        print("rlhf_kernels (the fused log-prob kernel) was not found: log-probs come from the plain torch path")
    if rank == 0 and static_decode is None and torch.cuda.is_available():
        print("rlhf_kernels (the CUDA-graph decode step) was not found: generate decodes with its plain loop")
    return rank, device


CHECKPOINT_S = 1200  # the longest a checkpoint may take: a 7B PPO run's policy and critic with Adam, 170 GB at 150 MB/s


def collective_timeout(args):
    """How long a process waits for the others in a collective: twice --reward_timeout and a checkpoint (NCCL's own 10
    minutes, the default --reward_timeout, would end the processes waiting on a hung reward before its checkpoint)."""
    if args.reward_timeout <= 0:  # a reward may take any time
        return datetime.timedelta(days=7)
    return datetime.timedelta(seconds=2 * args.reward_timeout + CHECKPOINT_S)


@dataclass
class Sampling:
    """How generate samples (stop_ids (S,): the tokens that end a response; kernel_decode: rlhf_kernels' decode)."""

    max_new_tokens: int
    temperature: float
    stop_ids: torch.Tensor
    pad_token_id: int
    kernel_decode: bool = False


def load_task(args, device, reward_fns=()):
    """The tokenizer, prompts and rows, held-out (prompts, rows) and how to sample, before any model loads; the
    columns your reward functions read checked against each dataset's."""
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, padding_side="left")
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"the tokenizer of '{args.model_name_or_path}' has no EOS token; set and save one.")
    if tokenizer.pad_token_id is None:
        warnings.warn("the tokenizer has no pad token; using EOS as pad (the masks say what is padding).", stacklevel=2)
        tokenizer.pad_token = tokenizer.eos_token
    stop_ids = stop_token_ids(tokenizer, args.model_name_or_path).to(device)  # the chat template tried first
    # --decode auto: CUDA graphs on one GPU only; FSDP2's hooks cannot be captured, a CPU's static cache gains little
    one_gpu = device.type == "cuda" and not dist.is_initialized()
    kernel_decode = args.decode == "auto" and one_gpu and static_decode is not None
    sampling = Sampling(args.response_length, args.temperature, stop_ids, tokenizer.pad_token_id, kernel_decode)
    prompts, rows = load_prompts(args.dataset, args.dataset_split, args, tokenizer)
    check_reward_columns(reward_fns, rows, args.dataset, args)
    eval_path = held_out_dataset(args)
    held_out = ([], [])
    if eval_path:
        held_out = load_prompts(eval_path, args.eval_split, args, tokenizer)
        check_reward_columns(reward_fns, held_out[1], eval_path, args)
    elif args.eval_every:
        message = f"--eval_every {args.eval_every}: no held-out set (pass --eval_dataset); nothing is evaluated."
        warnings.warn(message, stacklevel=2)
    return tokenizer, prompts, rows, held_out, sampling


def check_model_path(path, kind, what):
    """One sentence, before anything loads, for a path that is not a model of its kind ('model': any)."""
    if os.path.isfile(path):  # AutoConfig reads a config.json: the tokenizer would fail on it, naming a hub repo
        raise SystemExit(f"{what} '{path}' is a file; pass the folder that holds the model (save_pretrained's).")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"{what} '{path}' could not be found or read ({type(e).__name__}); pass a local folder "
            "written by save_pretrained or a hub model name (the hub needs the network)."
        ) from None
    archs = config.architectures or []
    heads = {"causal LM": ("ForCausalLM", "LMHeadModel"), "sequence classifier": ("ForSequenceClassification",)}
    problem = None
    if kind in heads and not any(a.endswith(heads[kind]) for a in archs):
        problem = f"is a {archs or config.model_type}, not a {kind}"
    elif kind == "sequence classifier" and config.num_labels != 1:
        problem = f"has {config.num_labels} labels, not one (num_labels=1)"
    elif kind == "causal LM" and os.path.isdir(path) and not any(pathlib.Path(path).glob("tokenizer*.json")):
        problem = "has no tokenizer (no tokenizer.json or tokenizer_config.json)"  # transformers asks for sentencepiece
    if problem:
        raise SystemExit(f"{what} '{path}' {problem}; pass a {kind} that save_pretrained wrote, with its tokenizer.")
    return config


def load_model(model_class, path, args, device, trained, **kwargs):
    """from_pretrained with every choice explicit, then autocast, checkpointing, LoRA and FSDP2 as asked."""
    dtype = torch.bfloat16 if args.mixed_precision and not trained else getattr(torch, args.model_dtype)  # frozen: bf16
    model = model_class.from_pretrained(path, dtype=dtype, use_kernels=False, **kwargs).to(device).eval()
    if args.hub_kernels:  # once on its device: on the CPU, at load time, nothing is replaced
        from kernels import Mode

        model.set_use_kernels(True, mode=Mode.TRAINING if trained else Mode.INFERENCE)
    model.requires_grad_(trained)
    if args.mixed_precision and not dist.is_initialized():  # one process: autocast, as FSDP2's policy under torchrun
        model.forward = torch.autocast(torch.device(device).type, dtype=torch.bfloat16)(model.forward)
        for module in model.modules():
            if type(module).__name__.endswith("RotaryEmbedding"):
                module.register_forward_hook(rotary_in_bf16)
    if args.gradient_checkpointing and trained:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        if not blocks:
            raise SystemExit(f"'{path}' has no blocks transformers 5 can checkpoint; drop --gradient_checkpointing.")
        for block in blocks:  # recomputed only in training mode: the blocks alone, their layers stay in eval mode
            block.training = True
    if args.lora_r and trained:  # the base frozen, the adapters (and a classifier's head) trained
        from peft import get_peft_model

        task_type = "CAUSAL_LM" if model_class is AutoModelForCausalLM else "SEQ_CLS"
        model = get_peft_model(model, lora_config(args, task_type)).eval()
    if dist.is_initialized() and (trained or not args.replicate_frozen):
        shard(model, args)
    return model


def rotary_in_bf16(rotary, inputs, cos_sin):
    """A hook on a rotary embedding under autocast: its cos and sin in bf16, as FSDP2's policy makes them (a float32
    trunk makes the keys float32: a cache 1.5x as large, cast to bf16 at every step)."""
    return tuple(x.to(torch.bfloat16) for x in cos_sin)


def lora_config(args, task_type):
    """The adapters of --lora_r (peft)."""
    from peft import LoraConfig

    targets = "all-linear" if args.lora_target_modules == ("all-linear",) else list(args.lora_target_modules)
    return LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
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


def load_reference(args, policy, device):
    """The frozen reference: a second copy of the starting policy, or under LoRA the policy with its adapters off."""
    if args.lora_r:
        return AdaptersOff(policy)
    return load_model(AutoModelForCausalLM, args.model_name_or_path, args, device, trained=False)


def lora_policy_to_save(weights, args):
    """Under LoRA, the policy to save: the base with the adapters merged in, or --save_adapters_only's adapters."""
    from peft import get_peft_model

    base = AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path, dtype=getattr(torch, args.model_dtype), use_kernels=False
    )
    model = get_peft_model(base, lora_config(args, "CAUSAL_LM"))
    model.load_state_dict(weights)
    if args.save_adapters_only:
        return model
    return model.merge_and_unload()


def load_reward_models(args, tokenizer, device):
    """(frozen reward model, its own tokenizer) pairs, the tokenizer None where it reads the policy's tokens."""
    pairs = []
    for path in args.reward_model_path:
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
        model = load_model(AutoModelForSequenceClassification, path, args, device, trained=False, num_labels=1)
        model.config.pad_token_id = reads.pad_token_id
        pairs.append((model, own))
    return pairs


# ---- FSDP2
def shard(model, args):
    """FSDP2 over all processes, a unit per transformer block; gradients summed, as each loss is a share of one."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]  # as each model names them
    for module in blocks + [model]:
        fully_shard(module, mp_policy=bf16 if args.mixed_precision else MixedPrecisionPolicy())
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-scaled one)


def hold_full_parameters(model, *, hold):
    """While sampling, an FSDP2 policy holds its blocks gathered: one all-gather per rollout, not per token."""
    if isinstance(model, FSDPModule):
        model.set_reshard_after_forward(not hold)  # for every unit
        if not hold:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


def megabytes_held(models, optimizers):
    """What this process holds of the models' parameters and the optimisers' states, in MB (its FSDP2 shards)."""
    states = [x for o in optimizers for s in o.state.values() for x in s.values() if torch.is_tensor(x)]
    tensors = [p for m in models for p in m.parameters()] + states
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors) / 2**20


def gather_rows(tensors):
    """The whole rollout on every process: each tensor's rows of all processes, right-padded with zeros (masked)."""
    if not dist.is_initialized():
        return tensors
    widths = torch.tensor([x.shape[-1] for x in tensors.values()], device=next(iter(tensors.values())).device)
    dist.all_reduce(widths, op=dist.ReduceOp.MAX)
    gathered = {}
    for (key, x), width in zip(tensors.items(), widths.tolist()):
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]) if x.dim() > 1 else (0, 0)).contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        gathered[key] = torch.cat(parts)
    return gathered


# ---- batches: left padding, each process's draws, micro-batches cut to the columns they use, position ids, heads
def left_pad(sequences, pad_token_id, device, width=None):
    """Token lists to a left-padded (B, width) tensor (width: the longest by default) and its attention mask."""
    if width is None:
        width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def row_uniforms(rng, rows, args, rank):
    """This process's rows of uniforms drawn for all: a response never depends on the number of processes."""
    return torch.rand(rows * args.world_size, args.response_length, generator=rng)[rank * rows : (rank + 1) * rows]


def by_length(rows, attention_mask):
    """The rows (n,) shortest first, so that each micro-batch holds similar lengths and cut_padding cuts it more."""
    return rows[attention_mask[rows].sum(1).argsort(stable=True)]


def cut_padding(batch, P):
    """A micro-batch of (B, P + T), (B, T) and (B,) tensors without the columns none of its rows uses, and its new P:
    the real tokens keep their position ids, so every forward gives them the same outputs."""
    L = batch["attention_mask"].shape[1]
    start, last = batch["attention_mask"].any(0).nonzero()[[0, -1], 0].tolist()  # the first and last used columns
    cut = {}
    for key, x in batch.items():
        if x.dim() == 1:  # (B,): one value per row
            cut[key] = x
        elif x.shape[1] == L:  # (B, P + T): the prompt's columns and the response's
            cut[key] = x[:, start : last + 1]
        else:  # (B, T): the response's columns alone
            cut[key] = x[:, : last + 1 - P]
    return cut, P - start


def in_chunks(forward, size, input_ids, attention_mask, P):
    """A no-grad forward(ids, mask, P') -> (b, T') over the rollout in cut chunks of size rows, similar lengths
    together (B x L x V logits at once would dwarf training's): (B, T), 0 past each chunk's T'."""
    out = torch.zeros(input_ids.shape[0], input_ids.shape[1] - P, device=input_ids.device)  # (B, T)
    for rows in by_length(torch.arange(len(input_ids), device=input_ids.device), attention_mask).split(size):
        chunk, p = cut_padding(dict(input_ids=input_ids[rows], attention_mask=attention_mask[rows]), P)
        out[rows, : chunk["input_ids"].shape[1] - p] = forward(chunk["input_ids"], chunk["attention_mask"], p)
    return out


def position_ids_from(attention_mask):
    """Left padding shifts every prompt; positions (B, L) count real tokens only."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def head_outputs(model, input_ids, attention_mask):
    """A sequence classifier's scalar head at every position (B, L): the critic's values, or the reward model's score
    at the last token. A hook keeps every position's (the classifier returns one), the call going through FSDP."""
    kept = []

    def keep(module, inputs, output):
        kept.append(output)

    hook = model.score.register_forward_hook(keep)
    model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask))
    hook.remove()
    return kept[0].squeeze(-1).float()  # (B, L)


# ---- data
def read_rows(path, split, args):
    """The rows (dicts) of a local .json/.jsonl, .csv/.tsv (every cell text) or .parquet file, or of a hub dataset."""
    local = re.search(r"\.(jsonl?|csv|tsv|parquet)(\.gz|\.bz2|\.xz|\.zst)?$", path, re.I)  # a file's kind, any case
    if local and not os.path.isfile(path):
        what = "does not exist"
        if os.path.isdir(path):
            what = "is a folder"
        elif os.path.exists(path):  # a FIFO, a device, a socket
            what = "is not a regular file"
        raise SystemExit(
            f"dataset file '{path}' {what}; pass a "
            f'file of {{"{args.prompt_field}": ...}} rows (.jsonl, .csv, .tsv, .parquet) or a hub dataset.'
        )
    if not local:  # a hub dataset's split
        from datasets import load_dataset

        try:
            return list(load_dataset(path, args.dataset_config, split=split))
        except Exception as e:  # datasets wraps a file's errors in its own
            raise SystemExit(
                f"hub dataset '{path}' could not be loaded ({type(e).__name__}: {e}); check its name, the split "
                f"'{split}', --dataset_config {args.dataset_config} and the network."
            ) from None
    import bz2  # the readers of compressed and tabular files, needed here alone
    import csv
    import gzip
    import io
    import lzma

    kind = local[1].lower()
    compression = (local[2] or "").lower()
    if compression == ".zst":
        raise SystemExit(
            f"dataset file '{path}' is compressed with zstd, which Python does not read without a package; "
            "decompress it (zstd -d), or compress it with gzip, bzip2 or xz."
        )
    raw = pathlib.Path(path).read_bytes()
    decompress = {".gz": gzip.decompress, ".bz2": bz2.decompress, ".xz": lzma.decompress}
    if compression:
        try:
            raw = decompress[compression](raw)
        except (OSError, EOFError, ValueError, lzma.LZMAError) as e:  # cut short (bz2: ValueError), of another kind
            raise SystemExit(f"dataset file '{path}' is not a whole {compression} file ({e}); check it.") from None
    if kind == "parquet":
        import pyarrow.parquet  # datasets' own reader of parquet

        try:
            return pyarrow.parquet.read_table(io.BytesIO(raw)).to_pylist()
        except Exception as e:  # pyarrow's errors are its own
            raise SystemExit(
                f"dataset file '{path}' could not be loaded ({type(e).__name__}: {e}); check its contents."
            ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise SystemExit(
            f"line {line} of '{path}' is not UTF-8 text (byte {raw[e.start]:#04x}); save it as UTF-8."
        ) from None
    if kind in ("csv", "tsv"):  # every cell as text, as a .jsonl's strings: "119" stays "119", "N/A" stays "N/A"
        csv.field_size_limit(sys.maxsize)  # a cell as long as memory holds (a grader's test cases), not 131,072
        stream = io.StringIO(text.removeprefix("\ufeff"), newline="")
        if kind == "csv":
            reader = csv.reader(stream)
            fix = "a cell holding ',' goes in double quotes"
        else:  # a .tsv: a row a line, every tab a separator, no quoting (a quote is text: a prompt's "...")
            reader = csv.reader(stream, delimiter="\t", quoting=csv.QUOTE_NONE)
            fix = "a .tsv cell holds no tab"
        rows = []
        try:
            header = next(reader, [])
            for cells in reader:
                if cells and len(cells) != len(header):
                    raise SystemExit(
                        f"line {reader.line_num} of '{path}' has {len(cells)} cells and its header "
                        f"{len(header)}; fix that line ({fix})."
                    )
                if cells:
                    rows.append(dict(zip(header, cells)))
        except csv.Error as e:
            raise SystemExit(f"line {reader.line_num} of '{path}' cannot be read ({e}); fix that line.") from None
        return rows
    whole = kind == "json" and text.lstrip().startswith("[")  # one JSON list, else an object a line
    lines = text.split("\n")  # never at U+2028, U+2029 or U+0085, which a JSON string may hold (splitlines splits)
    if whole:
        lines = [text]
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            parsed = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(
                f"line {number + e.lineno - 1} of '{path}' is not valid JSON ({e.msg}); fix that line."
            ) from None
        if whole:
            rows.extend(parsed)
        else:
            rows.append(parsed)
    return rows


def load_prompts(path, split, args, tokenizer):
    """A dataset's prompts tokenised once and its rows (dicts), every row checked before any model loads."""
    rows = read_rows(path, split, args)
    if len(rows) == 0:
        raise SystemExit(f"dataset '{path}' is empty; pass a dataset with at least one prompt.")
    texts = []
    for n, row in enumerate(rows, 1):
        has = list(row) if isinstance(row, dict) else []
        if args.prompt_field not in has:
            raise SystemExit(
                f"dataset '{path}' has no '{args.prompt_field}' column in row {n} (it has "
                f"{has or type(row).__name__}); pass --prompt_field with the column of the prompts."
            )
        answer = answer_of(row, args.answer_field)
        if REWARD_FNS.keys() & set(args.reward_fn) and answer is None:  # yours may need none
            raise SystemExit(
                f"--reward_fn {' '.join(args.reward_fn)} needs an answer column, but row {n} of "
                f"'{path}' has no (or a null) '{args.answer_field}' (it has {has}); pass --answer_field."
            )
        if REWARD_FNS.keys() & set(args.reward_fn) and not isinstance(answer, (str, int, float)):  # not its repr
            raise SystemExit(
                f"row {n} of '{path}' has a {type(answer).__name__} as its '{args.answer_field}' ({answer!r:.80}); "
                "the built-in rules compare text or a number: store the answer as one."
            )
        prompt = row[args.prompt_field]
        chat = isinstance(prompt, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt)
        if not isinstance(prompt, str) and not chat:
            raise SystemExit(
                f"row {n} of '{path}' has a {type(prompt).__name__} as its prompt; a prompt is text or "
                'a list of {"role", "content"} messages.'
            )
        if isinstance(prompt, str):
            empty = not prompt.strip()
        else:
            empty = not any(str(m["content"]).strip() for m in prompt)
        if empty:
            raise SystemExit(f"row {n} of '{path}' has an empty prompt; remove that row.")
        if re.search("[\ud800-\udfff]", str(prompt)):  # half of a UTF-16 pair, which no tokenizer reads
            raise SystemExit(f"row {n} of '{path}' holds a lone surrogate (half of a UTF-16 pair); fix its text.")
        if (chat or args.chat_template) and tokenizer.chat_template is None:
            raise SystemExit(
                f"row {n} of '{path}' needs a chat template, but the tokenizer of "
                f"'{args.model_name_or_path}' has none; save one with it, or drop --chat_template."
            )
        if isinstance(prompt, str) and args.chat_template:  # --chat_template: the text as a user's turn
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, str):
            prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        texts.append(prompt)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    too_long = [i for i, p in enumerate(prompts) if len(p) > args.max_prompt_length]
    if too_long and not args.truncate_prompts:
        longest = max(too_long, key=lambda i: len(prompts[i]))
        raise SystemExit(
            f"{len(too_long)} prompts of '{path}' are longer than --max_prompt_length "
            f"{args.max_prompt_length} (the first is row {too_long[0] + 1}; the longest, row "
            f"{longest + 1}, has {len(prompts[longest])} tokens); raise it, or pass --truncate_prompts."
        )
    if too_long:
        warnings.warn(f"{len(too_long)} prompts were cut to their last {args.max_prompt_length} tokens.", stacklevel=2)
        prompts = [p[-args.max_prompt_length :] for p in prompts]
    if min(map(len, prompts)) == 0:  # text the tokenizer makes nothing of
        raise SystemExit(f"row {[len(p) for p in prompts].index(0) + 1} of '{path}' is a prompt of no tokens; drop it.")
    return prompts, rows


def stop_token_ids(tokenizer, path):
    """The tokens that end a response: the EOS, the generation_config's, and the chat template's end of turn."""
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # the model has no generation_config.json
        eos = None
    if not isinstance(eos, list):
        eos = [eos]
    ids = {tokenizer.eos_token_id} | set(eos) - {None}
    if tokenizer.chat_template is not None:
        turns = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
        try:  # a template that raises, or that leaves the answer out (no "2")
            text = tokenizer.apply_chat_template(turns, tokenize=False)
            after = tokenizer(text[text.rindex("2") + 1 :], add_special_tokens=False)["input_ids"]
        except Exception as e:
            raise SystemExit(
                f"the chat template of '{path}' fails on a user turn and its answer ({type(e).__name__}: "
                f"{e}); fix it (tokenizer_config.json), or pass a tokenizer without one."
            ) from None
        if after and after[0] in tokenizer.added_tokens_decoder and tokenizer.added_tokens_decoder[after[0]].special:
            ids.add(after[0])
    return torch.tensor(sorted(ids))


def held_out_dataset(args):
    """--eval_dataset, else the test.<ext> beside a local train.<ext> --dataset; None with --eval_every 0 or none."""
    if args.eval_every == 0:
        return None
    if args.eval_dataset:
        return args.eval_dataset
    name = os.path.basename(args.dataset)  # train.<ext>: a format read_rows reads, compressed or not
    beside = os.path.join(os.path.dirname(args.dataset), "test" + name[len("train") :])
    if re.fullmatch(r"train\.(jsonl?|csv|tsv|parquet)(\.gz|\.bz2|\.xz)?", name, re.I) and os.path.isfile(beside):
        return beside
    return None


def next_prompts(prompts, position, args, rank):
    """This process's prompts (dataset indices) from one shuffled order per epoch, the longest on any process, and
    the position (data epoch, cursor) after them: position is where the last draw left off."""
    epoch, cursor = position
    if cursor + args.rollout_batch_size > len(prompts):
        epoch += 1
        cursor = 0
    shuffle = torch.Generator().manual_seed(args.seed + epoch)
    order = torch.randperm(len(prompts), generator=shuffle).tolist()
    batch = [order[(cursor + i) % len(prompts)] for i in range(args.rollout_batch_size)]  # for all
    local_batch = args.rollout_batch_size // args.world_size
    mine = batch[rank * local_batch : (rank + 1) * local_batch]
    return mine, max(len(prompts[i]) for i in batch), (epoch, cursor + args.rollout_batch_size)


# ---- rewards and evaluation
@dataclass
class Scorer:
    """What scores a response: the reward models, each with its own tokenizer (None where it reads the policy's
    tokens), the rules as (--reward_fn, its function or process), the policy's tokenizer that decodes them, and the
    run's state (TRL's functions read its iteration)."""

    reward_models: list
    reward_fns: list
    tokenizer: object
    state: dict


@dataclass
class Scores:
    """What score_responses returns for a batch of B responses."""

    raw: torch.Tensor  # (B,) the reward models' minimum plus the rules' weighted sum, failed rewards replaced
    metrics: dict  # {metric key: (B,)} the rules' weighted sum, and each rule's scores when there are several
    texts: list  # the responses as text
    failed: int  # how many responses' rewards failed


@torch.no_grad()
def score_responses(scorer, input_ids, attention_mask, P, rows, args, stops=None):
    """The raw score of each response input_ids[:, P:] (B,): every reward model read at its last token, their minimum,
    plus the rules' weighted sum. A failed reward is a reason to stop (in stops), or replaced (--on_reward_error); a
    rule's None is "does not apply", as in TRL."""
    texts = scorer.tokenizer.batch_decode(input_ids[:, P:], skip_special_tokens=True)
    last = attention_mask[:, P:].sum(1) - 1  # (B,) the final response token: its EOS, or where it was cut off
    size = args.micro_batch_size
    rm_scores = []  # K x (B,)
    for reward_model, own_tokenizer in scorer.reward_models:
        if own_tokenizer is None:  # the policy's tokens: the head at every position, read at the last token
            values = in_chunks(
                lambda i, m, p, rm=reward_model: head_outputs(rm, i, m)[:, p:], size, input_ids, attention_mask, P
            )  # (B, T)
            rm_scores.append(values[torch.arange(len(texts)), last])
        else:  # the prompt and the text in its own tokens, left-padded: the last column is every row's last token
            prompts = [row[args.prompt_field] for row in rows]
            ids, mask = reward_model_inputs(own_tokenizer, prompts, texts, input_ids.device)
            last_column = in_chunks(
                lambda i, m, p, rm=reward_model: head_outputs(rm, i, m)[:, -1:], size, ids, mask, ids.shape[1] - 1
            )  # (B, 1)
            rm_scores.append(last_column[:, 0])
    rules = {}  # {name: (B,) its scores, nan where it failed}
    scored = {}  # {name: (B,) False where it returned None}
    failures = []  # ((B,) scores, why) of each rule, why None where nothing failed
    real = [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask)]  # each prompt and response, unpadded
    lengths = attention_mask[:, P:].sum(1).tolist()  # (B,) each response's tokens
    batch = dict(  # what a reward function may read, B of each: reward_reply passes what its form takes
        responses=texts,
        answers=[answer_of(row, args.answer_field) for row in rows],
        prompts=[row.get(args.prompt_field) for row in rows],  # as the data holds them: text or messages
        prompt_texts=scorer.tokenizer.batch_decode([x[: len(x) - n] for x, n in zip(real, lengths)]),
        queries=scorer.tokenizer.batch_decode(real),  # the prompt and response as the policy saw them
        completion_ids=[x[len(x) - n :].tolist() for x, n in zip(real, lengths)],
        columns=[{k: v for k, v in row.items() if k != args.prompt_field} for row in rows],
        step=scorer.state["iteration"],
        max_steps=args.num_iterations,
    )
    for spec, fn in scorer.reward_fns:
        name = spec.rpartition(":")[2]
        got, why = call_reward_fn(fn, batch, args.reward_timeout, stops)
        scored[name] = torch.tensor([x is not None for x in got], device=input_ids.device)
        rules[name] = torch.tensor([float("nan") if x is None else x for x in got], device=input_ids.device)
        if why is not None and len(scorer.reward_fns) > 1:  # which rule failed
            why = f"{why} (--reward_fn {spec})"
        failures.append((torch.where(scored[name], rules[name], 0.0), why))
    rule_reward = None  # (B,) the rules' weighted sum over those that scored each response, as TRL's
    if rules:
        weights = args.reward_weights or [1.0] * len(rules)
        terms = [torch.where(scored[name], w * x, 0.0) for w, (name, x) in zip(weights, rules.items())]
        rule_reward = functools.reduce(torch.add, terms)
        unscored = ~functools.reduce(torch.logical_or, scored.values())  # (B,) no rule scored it: it counts 0
        if unscored.any():
            message = "a response that no --reward_fn scored (each returned None) counts 0, as in TRL"
            warnings.warn(f"{message}; health/unscored_rewards logs their share.", stacklevel=2)
    score = combine_scores(rm_scores, rule_reward)
    score, failed = replace_failed_scores(score, failures, texts, scorer.tokenizer, input_ids[:, :P], args, stops)
    metrics = {}
    if rules:
        metrics["objective/rule_reward"] = rule_reward.nan_to_num(0.0)
        metrics["health/unscored_rewards"] = unscored.float()  # its mean: the share of responses no rule scored
    if len(rules) > 1:  # nan where a rule returned None: each mean is over the responses it scored
        for name, x in rules.items():
            metrics[f"reward/{name}"] = torch.where(scored[name], x.nan_to_num(0.0), float("nan"))
    return Scores(score, metrics, texts, failed)


def replace_failed_scores(score, failures, texts, tokenizer, prompt_ids, args, stops):
    """Scores (B,) that are not finite: a reason to stop (in stops; none given: raised), or with --on_reward_error
    penalty put below the batch's lowest. failures: score_responses'. Returns (B,) and how many failed."""
    bad = ~torch.isfinite(score)
    if not bad.any() or any(isinstance(r, int) for r in stops or ()):  # after a stop signal the batch goes unused
        return score, 0
    if args.on_reward_error == "penalty" and not bad.all():
        return torch.where(bad, score[~bad].min() - args.missing_eos_penalty, score), int(bad.sum())
    i = bad.nonzero()[0, 0].item()
    why = "not a finite number"  # a reward model's score, or the rules' sum past float32's range
    for scores, reason in failures:  # the first rule that failed on response i
        if not scores[i].isfinite():
            why = reason
            break
    which = f"the response {texts[i]!r} to the prompt {tokenizer.decode(prompt_ids[i], skip_special_tokens=True)!r}"
    if args.on_reward_error == "stop":
        failure = (
            f"the reward of {which} is {why}; fix the reward, or pass --on_reward_error penalty to score "
            "such responses below the rest of the batch."
        )
    else:  # every response failed: no valid score to put them below
        failure = f"every response of the batch failed its reward ({which} is {why}); fix the reward function."
    if stops is None:
        raise SystemExit(failure)
    stops.append(failure)
    return score, int(bad.sum())


def distinct_n(sequences, n):
    """Distinct-n: unique n-grams over all n-grams in a batch of token lists (1.0 = no repetition)."""
    ngrams = [tuple(s[i : i + n]) for s in sequences for i in range(len(s) - n + 1)]
    return len(set(ngrams)) / max(len(ngrams), 1)


def arithmetic_reward(responses, answers):
    """Rule reward: 1 when the response, stripped, is exactly the answer, else 0."""
    return [float(r.strip() == str(a).strip()) for r, a in zip(responses, answers)]


def last_number(text):
    """The last number written in a text ('1,234', '-5', '2.50'), as a float; None when there is none."""
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    if not numbers:
        return None
    return float(numbers[-1].replace(",", ""))


def gsm8k_reward(responses, answers):
    """Rule reward for GSM8K: 1 when the response's last number is the reference's final one (after '####')."""
    truths = [last_number(str(a).split("####")[-1]) for a in answers]
    return [float(last_number(r) is not None and last_number(r) == t) for r, t in zip(responses, truths)]


REWARD_FNS = {"arithmetic": arithmetic_reward, "gsm8k": gsm8k_reward}


def load_reward_fns(args):
    """Each --reward_fn as (spec, its function or RewardProcess, started with the function loaded)."""
    return [(spec, load_reward_fn(spec, args.reward_timeout)) for spec in args.reward_fn]


def load_reward_fn(spec, timeout):
    """A --reward_fn: a built-in (run here: this file's pure functions), or file.py:function or module:function in
    one of reward_form's forms, loaded in a RewardProcess of its own within timeout seconds (0: no limit)."""
    if spec in REWARD_FNS:
        return REWARD_FNS[spec]
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise SystemExit(
            f"unknown --reward_fn '{spec}'; choose one of {sorted(REWARD_FNS)}, or pass your own as "
            "path/to/file.py:function or package.module:function."
        )
    process = RewardProcess(spec)
    failures = [f for f in all_processes(process.start(timeout, None)) if f]  # any process's: every one stops
    if failures:
        raise SystemExit(failures[0][1])
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"--reward_fn {spec}: {process.form} form")
    return process


class RewardProcess:
    """Your --reward_fn in a fresh interpreter (never a fork of this one, whose threads may hold locks), in a process
    group of its own that a timeout or a stop kills whole; started again at the next call; it ends with the trainer.
    form: whose form the function is in (reward_form); required: the arguments it names without a default."""

    def __init__(self, spec):
        self.spec = spec
        self.process = None
        self.connection = None
        self.form = None
        self.required = []

    def start(self, timeout, stops):
        """Starts the process and loads the function there, bounded as a call: None, or (kind, the sentence why not)."""
        ours, theirs = multiprocessing.Pipe()
        program = f"{reward_process_code()}\nserve_rewards({theirs.fileno()})"
        # -P: the working folder is not first on its path, where a random.py would shadow the standard library's
        command = [sys.executable, "-P", "-u", "-c", program]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, pass_fds=[theirs.fileno()], start_new_session=True
        )
        theirs.close()
        self.connection = ours
        kind, got = self.ask((sys.path, self.spec), timeout, stops)
        if kind == "loaded":
            self.form, self.required = got
            return None
        if self.process is not None:  # resolve_reward_fn's sentence: the process ends
            self.kill()
        if kind == "timeout":  # a grader whose import waits for a service that is down
            got = f"loading it gave {got}; check what its import waits for, or pass a longer --reward_timeout."
        return kind, f"--reward_fn {self.spec}: {got}"

    def call(self, batch, timeout, stops):
        """ask's answer to batch (score_responses'), the process started first where it is not."""
        if stops and any(isinstance(r, int) for r in stops):  # the run is stopping: no call begins
            return "stopped", None
        if self.process is None:
            failed = self.start(timeout, stops)
            if failed:
                return failed
        return self.ask(batch, timeout, stops)

    def ask(self, message, timeout, stops):
        """Sends message and gives the process's answer, or ("stopped", None) as soon as stops holds a signal,
        ("timeout", why) after timeout seconds (0: no limit), ("raised", why) if it ended: its group then killed."""
        try:
            self.connection.send(message)
            end = time.monotonic() + timeout
            while not self.connection.poll(0.1):  # a tenth of a second: a stop is seen at once
                if stops and any(isinstance(r, int) for r in stops):
                    self.kill()
                    return "stopped", None
                if timeout and time.monotonic() > end:
                    self.kill()
                    return "timeout", f"no answer within --reward_timeout {timeout:g} s"
            return self.connection.recv()
        except (EOFError, OSError):  # it ended: os._exit(), a crash, a kill from outside (a broken pipe)
            return "raised", f"the process running it ended (exit code {self.kill()})"

    def kill(self):
        """Kills the process group: the process and what its function started (unless that left the group)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # every member had ended
            pass
        code = self.process.wait()
        self.process.stdin.close()
        self.connection.close()
        self.process = None
        return code


@functools.cache  # read once: the file may be edited or replaced while the run goes on
def reward_process_code():
    """The reward process's program: the functions of this file that it runs, as they were when the run began."""
    imports = "import hashlib, importlib.util, inspect, multiprocessing.connection, os, pathlib, pkgutil, signal, sys"
    imports += ", types"
    shipped = (reward_module, resolve_reward_fn, reward_form, reward_reply, call_in_form, call_with, serve_rewards)
    return "\n".join([imports, *map(inspect.getsource, shipped)])


def reward_module(path):
    """In the reward process: a user's reward file as a module named after its stem and resolved path, so that it
    shadows nothing (a math.py, two grader.py); in sys.modules for a forked pool, its folder last on sys.path."""
    resolved = os.path.realpath(path)
    name = f"{pathlib.Path(path).stem}_{hashlib.sha1(resolved.encode()).hexdigest()[:12]}"
    sys.path.append(os.path.dirname(resolved))  # for the modules beside it
    found = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module
    found.loader.exec_module(module)
    return module


def resolve_reward_fn(spec):
    """In the reward process: (the function spec names, its form), or (None, why not: start puts the --reward_fn
    first)."""
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            module = reward_module(where)
        else:
            module = pkgutil.resolve_name(where)
    except BaseException as e:  # sys.exit() at import too
        return None, (
            f"'{where}' could not be loaded ({type(e).__name__}: {e}); fix it, or check the module's name and that it "
            "is importable from here."
        )
    fn = getattr(module, name, None)
    if not callable(fn):
        return None, f"'{where}' has no function '{name}'; name one it defines."
    form = reward_form(fn)
    if form is None:
        return None, (
            f"{name}{inspect.signature(fn)} is in none of the forms taken: fn(responses, answers) (this project's), "
            "fn(prompts, completions, **kwargs) (TRL's), compute_score(data_source, solution_str, ground_truth, "
            "extra_info) (verl's), reward_func(queries, prompts, labels) (OpenRLHF's)."
        )
    return fn, form


def reward_form(fn):
    """Whose convention fn is written in, told by its arguments' names: verl's names solution_str, OpenRLHF's
    queries, TRL's completions (or takes keywords alone), this project's fn(responses, answers); None: no one's."""
    try:
        arguments = inspect.signature(fn).parameters
    except ValueError:  # a callable whose signature cannot be read (a builtin): taken as this project's
        return "this project's"
    if "solution_str" in arguments:
        return "verl's"
    if "queries" in arguments:
        return "OpenRLHF's"
    if "completions" in arguments or [a.kind for a in arguments.values()] == [inspect.Parameter.VAR_KEYWORD]:
        return "TRL's"
    try:
        inspect.signature(fn).bind(["a response"], ["its answer"])
    except TypeError:
        return None
    return "this project's"


def reward_reply(fn, form, batch):
    """fn called in its form on batch as ("scores", a float or None each: a generator consumed here), ("returned",
    the type's name) when that is not a sequence of scores, or ("raised", "Type: message")."""
    try:
        got = call_in_form(fn, form, batch)
        if not hasattr(got, "__iter__") or isinstance(got, (str, bytes, dict)):
            return "returned", type(got).__name__
        return "scores", [None if x is None else float(x) for x in got]
    except BaseException as e:  # sys.exit() or KeyboardInterrupt in reward code too: a failure, never the run's exit
        return "raised", f"{type(e).__name__}: {e}"


def call_in_form(fn, form, batch):
    """fn's answer for batch (score_responses'), called as the project whose form it is calls it."""
    if form == "TRL's":  # as TRL's GRPOTrainer: the prompts as the data holds them, a chat's completions as messages
        columns = {key: [row.get(key) for row in batch["columns"]] for key in batch["columns"][0]}
        completions = batch["responses"]
        if isinstance(batch["prompts"][0], list):
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        trainer_state = types.SimpleNamespace(global_step=batch["step"], max_steps=batch["max_steps"])
        given = dict(prompts=batch["prompts"], completions=completions, completion_ids=batch["completion_ids"])
        return call_with(fn, {**columns, **given, "trainer_state": trainer_state})
    if form == "verl's":  # each response alone, as verl's reward manager: a number, or a dict with it as "score"
        scores = []
        for text, answer, row in zip(batch["responses"], batch["answers"], batch["columns"]):
            given = dict(solution_str=text, ground_truth=answer, extra_info=row.get("extra_info"))
            got = call_with(fn, {"data_source": row.get("data_source"), **given})
            scores.append(got["score"] if isinstance(got, dict) else got)
        return scores
    if form == "OpenRLHF's":  # a tensor, a list, or a dict with them as "rewards"
        got = call_with(fn, dict(queries=batch["queries"], prompts=batch["prompt_texts"], labels=batch["answers"]))
        return got["rewards"] if isinstance(got, dict) else got
    return fn(batch["responses"], batch["answers"])


def call_with(fn, given):
    """fn(**given), leaving out the keywords it does not take, unless it takes **kwargs."""
    arguments = inspect.signature(fn).parameters
    if not any(a.kind is inspect.Parameter.VAR_KEYWORD for a in arguments.values()):
        given = {key: value for key, value in given.items() if key in arguments}
    return fn(**given)


def serve_rewards(fd):
    """The reward process: loads the function, says whether it could (and its form and required arguments), then
    answers each batch sent. It ends with the trainer, however that ends: its watcher kills the process group once
    the trainer's stdin closes."""
    if os.fork() == 0:  # the watcher, before any reward code: a thread would make every later fork (a pool) a risk
        os.close(fd)  # the trainer's connection: its end is seen to close when the reward process ends
        os.read(0, 1)
        os.killpg(0, signal.SIGKILL)
    connection = multiprocessing.connection.Connection(fd)
    search_path, spec = connection.recv()
    sys.path[:] = search_path  # the trainer's: its modules found as they would be there
    fn, form = resolve_reward_fn(spec)
    if fn is None:
        connection.send(("raised", form))
        return
    arguments = inspect.signature(fn).parameters.values() if form == "TRL's" else []
    required = [a.name for a in arguments if a.default is a.empty and a.kind not in (a.VAR_POSITIONAL, a.VAR_KEYWORD)]
    connection.send(("loaded", (form, required)))
    while True:
        try:
            batch = connection.recv()
        except EOFError:  # the trainer ended
            return
        connection.send(reward_reply(fn, form, batch))


def reward_call(reward_fn, batch, timeout, stops):
    """reward_reply's answer: a built-in rule's from here, yours from its RewardProcess."""
    if isinstance(reward_fn, RewardProcess):
        return reward_fn.call(batch, timeout, stops)
    return reward_reply(reward_fn, "this project's", batch)


def call_reward_fn(reward_fn, batch, timeout, stops=None):
    """A rule's scores on batch (score_responses'), None where it does not apply, nan where it gave none, and why it
    failed (None when nothing did). When the batch's call raises, each response is scored alone until a timeout or a
    stop, so that the error is pinned on one."""
    n = len(batch["responses"])
    kind, got = reward_call(reward_fn, batch, timeout, stops)
    if kind != "raised":
        return checked_scores(kind, got, n, "the batch's call")
    scores = [float("nan")] * n
    first = None  # why the first response that failed alone did
    for i in range(n):
        alone = {key: x[i : i + 1] if isinstance(x, list) else x for key, x in batch.items()}
        kind, got_alone = reward_call(reward_fn, alone, timeout, stops)
        score, why = checked_scores(kind, got_alone, 1, "its call alone")
        scores[i] = score[0]
        if first is None:
            first = why
        if kind in ("timeout", "stopped"):  # the rest could hang as long; a stop ends the call
            break
    if first is not None:
        return scores, first
    why = (
        f"nan: the batch's call raised ({got}) but no single response's did; make the reward score a batch as it "
        "scores each response"
    )
    return [float("nan")] * n, why


def checked_scores(kind, got, n, call):
    """reward_call's answer for n responses as (a score each, None where it does not apply, nan where none) and why
    it failed (None: nothing)."""
    failed = [float("nan")] * n
    if kind == "stopped":
        return failed, "stopped by a signal"
    if kind == "timeout":
        return failed, f"an error (TimeoutError: {got})"
    if kind == "raised":
        return failed, f"an error ({got})"
    if kind == "returned":  # one float per response, nothing else
        return failed, f"nan: {call} returned a {got} for {n} responses"
    if len(got) != n:
        return failed, f"nan: {call} returned {len(got)} scores for {n} responses"
    given = [x for x in got if x is not None]  # None: "does not apply", as in TRL
    large = [x for x in given if 3.4e38 < abs(x) < float("inf")]  # finite, but inf in float32
    if large:
        return got, f"{large[0]:g}, past float32's range"
    if not all(math.isfinite(x) for x in given):
        return got, "not a finite number"
    return got, None


def answer_of(row, field):
    """A row's --answer_field: a column, or a dotted path into nested ones (verl's reward_model.ground_truth)."""
    for key in field.split("."):
        row = row.get(key) if isinstance(row, dict) else None
    return row


def check_reward_columns(reward_fns, rows, path, args):
    """Your functions against the data's columns (its first row's), before any model loads: a TRL function's keywords
    and columns, and a warning where yours takes answers and no row has one."""
    columns = [key for key in rows[0] if key != args.prompt_field]
    for spec, fn in reward_fns:
        if not isinstance(fn, RewardProcess):  # a built-in: load_prompts checks each row's answer
            continue
        if fn.form == "TRL's":
            keywords = ["prompts", "completions", "completion_ids", "trainer_state"]
            named = [c for c in columns if c in keywords] + [a for a in fn.required if a not in columns + keywords]
            if named:
                raise SystemExit(
                    f"--reward_fn {spec} is in TRL's form, which passes the keywords {', '.join(keywords)} and "
                    f"each column of '{path}' ({', '.join(columns)}) by name: '{named[0]}' is either both or "
                    "neither; rename the column or the argument."
                )
        elif all(answer_of(row, args.answer_field) is None for row in rows):
            warnings.warn(
                f"--reward_fn {spec} takes answers, but '{path}' has no '{args.answer_field}' (its columns: "
                f"{', '.join(rows[0])}): every answer is None; pass --answer_field with the answers' column.",
                stacklevel=2,
            )


def reward_model_inputs(own_tokenizer, prompts, texts, device):
    """A reward model's own tokens of each prompt and response (through its chat template where it has one)."""
    sequences = []
    for prompt, text in zip(prompts, texts):
        if own_tokenizer.chat_template is not None:
            if isinstance(prompt, str):
                messages = [{"role": "user", "content": prompt}]
            else:
                messages = list(prompt)
            messages.append({"role": "assistant", "content": text})
            rendered = own_tokenizer.apply_chat_template(messages, tokenize=False)
            sequences.append(own_tokenizer(rendered, add_special_tokens=False)["input_ids"])
        else:
            if not isinstance(prompt, str):  # chat messages, as plain text
                prompt = "\n".join(m["content"] for m in prompt)
            sequences.append(own_tokenizer(prompt + text)["input_ids"])
    return left_pad(sequences, own_tokenizer.pad_token_id, device)


@torch.no_grad()
def evaluate(policy, scorer, sampling, held_out, args, stops):
    """Mean raw score on the held-out set, sampled (fixed draws per prompt) and greedy; {} when a reward failed."""
    prompts, rows = held_out
    rank = int(os.environ.get("RANK", 0))
    device = sampling.stop_ids.device
    uniforms = torch.rand(len(prompts), args.response_length, generator=torch.Generator().manual_seed(args.seed))
    # a contiguous share each, the last topped up with uncounted copies of the last prompt: the same batches (FSDP)
    share = -(-len(prompts) // args.world_size)
    mine = range(rank * share, (rank + 1) * share)
    counted = torch.tensor([i < len(prompts) for i in mine], device=device).float()
    result = {}
    for name, greedy in (("eval/score", False), ("eval/score_greedy", True)):
        scores = []
        for start in range(0, share, args.eval_batch_size):
            idx = [min(i, len(prompts) - 1) for i in mine[start : start + args.eval_batch_size]]
            prompt_ids, prompt_mask = left_pad([prompts[i] for i in idx], sampling.pad_token_id, device)
            draws = None if greedy else uniforms[idx].to(device)
            responses, _, response_mask = generate(policy, prompt_ids, prompt_mask, sampling, draws)
            input_ids = torch.cat([prompt_ids, responses], 1)
            attention_mask = torch.cat([prompt_mask, response_mask], 1)
            P = prompt_ids.shape[1]
            batch_rows = [rows[i] for i in idx]
            scores.append(score_responses(scorer, input_ids, attention_mask, P, batch_rows, args, stops).raw)
        result[name] = global_mean(torch.cat(scores), counted)
    failed = any(isinstance(r, str) for r in stops)  # a failed reward (a stop's unanswered call is nan too)
    if failed or not all(map(math.isfinite, result.values())):
        return {}
    return result


# ---- checks and alarms
def require(args, names, rule, ok):
    """Stop with one sentence when an argument breaks its rule, e.g. "--temperature must be positive (got 0.0)."."""
    for name in names:
        if not ok(getattr(args, name)):
            raise SystemExit(f"--{name} {rule} (got {getattr(args, name)}).")


def check_common_args(args, responses_per_iteration):
    """The checks every script shares, before any model loads; nothing is created or started here."""
    embedded = [f"--{f.name}" for f in fields(args) if ASSETS in str(f.default) and getattr(args, f.name) == f.default]
    if embedded and not os.path.isdir(ASSETS):  # this file copied alone
        raise SystemExit(
            f"{', '.join(embedded)} default to the embedded example in '{ASSETS}', which is not beside "
            "this file; pass your own (a model folder or hub name, a .jsonl file or hub dataset)."
        )
    most = torch.finfo(torch.float32).max  # a float option meets float32 tensors (a clamp's bound, a weight)
    within = f"finite and within +-{most:.3g}"
    floats = [f.name for f in fields(args) if f.type is float]
    require(args, floats, f"must be {within}", lambda v: abs(v) <= most)  # nan fails it too
    require(args, ("seed",), "must lie in [0, 9e12] (iteration i draws from seed * 1e6 + i)", lambda v: 0 <= v <= 9e12)
    require(args, ("eval_every", "save_every"), "must be 0 (never) or more", lambda v: v >= 0)
    timeout_range = "must be 0 (no limit) or from 0.1 s (how often a call is checked) to 1e6 s"
    require(args, ("reward_timeout",), timeout_range, lambda v: v == 0 or 0.1 <= v <= 1e6)
    require(
        args,
        (
            "rollout_batch_size",
            "total_episodes",
            "minibatch_size",
            "micro_batch_size",
            "num_epochs",
            "response_length",
            "max_prompt_length",
            "eval_batch_size",
            "log_samples_every",
            "keep_checkpoints",
            "max_bad_steps",
        ),
        "must be at least 1",
        lambda v: v >= 1,
    )
    require(args, ("max_grad_norm", "temperature", "lora_alpha"), "must be positive", lambda v: v > 0)
    require(args, ("ent_coef", "missing_eos_penalty", "lora_r"), "must be zero or more", lambda v: v >= 0)
    require(args, ("dual_clip",), "must be 0 (off) or more than 1 (the paper uses 3)", lambda v: v == 0 or v > 1)
    require(args, ("lora_dropout",), "must lie in [0, 1)", lambda v: 0 <= v < 1)
    if args.save_adapters_only and not args.lora_r:
        raise SystemExit("--save_adapters_only needs adapters: pass --lora_r (the LoRA rank, e.g. 16) too.")
    shared = f"must be a multiple of the {args.world_size} processes (each samples whole groups of prompts)"
    require(args, ("rollout_batch_size", "minibatch_size"), shared, lambda v: v % args.world_size == 0)
    divides = f"must divide the {responses_per_iteration} responses per iteration"
    require(args, ("minibatch_size",), divides, lambda v: responses_per_iteration % v == 0)
    local_minibatch = args.minibatch_size // args.world_size
    # or at least it: the defaults hold under torchrun
    divides = f"must divide the per-process minibatch of {local_minibatch}, or be at least it (one micro-batch)"
    require(args, ("micro_batch_size",), divides, lambda v: v >= local_minibatch or local_minibatch % v == 0)
    one_rollout = f"must be at least one rollout ({responses_per_iteration} responses)"
    require(args, ("total_episodes",), one_rollout, lambda v: v >= responses_per_iteration)
    if not args.reward_model_path and not args.reward_fn:
        raise SystemExit("no reward: pass --reward_model_path, --reward_fn, or both.")
    names = [spec.rpartition(":")[2] for spec in args.reward_fn]
    same_name = "gives two functions one name, and each logs its scores as reward/<name>; rename one"
    require(args, ("reward_fn",), same_name, lambda v: len(set(names)) == len(names))
    require(args, ("reward_weights",), "needs one weight per --reward_fn", lambda v: len(v) in (0, len(names)))
    require(args, ("reward_weights",), f"must each be {within}", lambda v: all(abs(w) <= most for w in v))
    if args.mixed_precision and args.model_dtype != "float32":
        raise SystemExit("--mixed_precision keeps float32 master weights and computes in bf16; drop --model_dtype.")
    config = check_model_path(args.model_name_or_path, "causal LM", "--model_name_or_path")
    positions = getattr(config, "max_position_embeddings", None) or float("inf")
    fit = f"plus --max_prompt_length must fit the policy's {positions} positions"
    require(args, ("response_length",), fit, lambda v: v + args.max_prompt_length <= positions)
    if args.lora_r and args.lora_target_modules != ("all-linear",):  # peft skips a name it lacks if another is found
        with torch.device("meta"):  # matched as peft does (a whole name or its end), on a weightless model
            names = ["." + name for name, _ in AutoModelForCausalLM.from_config(config).named_modules()]
        rule = "must each end the name of a module of the policy, or be all-linear"
        require(args, ("lora_target_modules",), rule, lambda v: all(any(n.endswith("." + t) for n in names) for t in v))
    for path in args.reward_model_path:
        check_model_path(path, "sequence classifier", "--reward_model_path")
    existing = os.path.abspath(args.output_dir)
    while not os.path.exists(existing):  # its nearest existing folder, where it will be made
        existing = os.path.dirname(existing)
    try:  # a folder that cannot be written fails now, not at the first save; nothing is left behind
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise SystemExit(
            f"--output_dir '{args.output_dir}' cannot be created or written to ({e.strerror}); pass a "
            "folder you can write."
        ) from None


def failure_alarms(m, state, args):
    """Which failure signatures show in m, against first values and the value loss's moving average (in state)."""
    for key, metric in (
        ("first_entropy", "policy/entropy"),
        ("first_distinct2", "response/distinct2"),
        ("first_value_loss", "val/loss"),
    ):
        if state.get(key) is None:
            state[key] = m.get(metric)
    if "val/loss" in m:
        ema = state.get("value_loss_ema")
        state["value_loss_ema"] = m["val/loss"] if ema is None else 0.9 * ema + 0.1 * m["val/loss"]

    def fell(metric, first):  # below --alarm_collapse of its first value
        return m.get(metric) is not None and state[first] is not None and m[metric] < args.alarm_collapse * state[first]

    rising = "val/loss" in m and m["iteration"] > 10 and state["value_loss_ema"] > state["first_value_loss"]
    state["zero_signal_run"] = state.get("zero_signal_run", 0) + 1 if m["health/zero_signal"] >= 0.9 else 0
    return {
        "kl_explosion": m.get("objective/kl", 0.0) > args.alarm_kl,
        "clip_fraction": m.get("policy/clipfrac", 0.0) > args.alarm_clipfrac,
        "entropy_collapse": fell("policy/entropy", "first_entropy"),
        "value_divergence": rising,  # the value loss rising, not falling
        "diversity_collapse": fell("response/distinct2", "first_distinct2"),
        "zero_signal": state["zero_signal_run"] >= 10,  # 10 iterations in a row
    }


ALARMS = {
    "kl_explosion": "KL to the reference past --alarm_kl: raise --kl_coef (or --kl_target), lower the learning rate.",
    "clip_fraction": "over --alarm_clipfrac of tokens clipped: lower the learning rate or --num_epochs.",
    "entropy_collapse": "entropy under --alarm_collapse of its first value: add --ent_coef, raise --kl_coef, stop.",
    "value_divergence": "the value loss rose above its start: keep --normalize_reward, lower --value_learning_rate.",
    "diversity_collapse": "distinct-2 under --alarm_collapse of its first value: raise --kl_coef, or stop earlier.",
    "zero_signal": "for 10 iterations, 90% of the groups drawn (PPO: the batch) scored alike, leaving nothing to "
    "learn: check the reward on a few responses, then try an easier task, a stronger policy or a higher --temperature.",
}

# ---- checkpoints, stop signals and bad steps
# What may differ between a run and its resumption (the number of processes too); every other argument must match.
RESUMABLE = (
    "resume",
    "num_iterations",
    "world_size",
    "output_dir",
    "total_episodes",
    "save_every",
    "keep_checkpoints",
    "max_bad_steps",
    "on_reward_error",
    "reward_timeout",
    "micro_batch_size",
    "track",
    "wandb_project",
    "exp_name",
    "log_samples_every",
    "decode",
)
USUAL_CAUSES = (
    "the usual causes are a learning rate too high (lower it), rewards of a large scale (normalise them), "
    "bf16 or fp16 overflow (--model_dtype float32)"
)


def checkpoints_in(folder):
    """The finished checkpoints in folder, oldest first (a save cut short is left under a '.tmp' name)."""
    names = [n for n in os.listdir(folder) if re.fullmatch(r"checkpoint-\d+", n)] if os.path.isdir(folder) else []
    return [os.path.join(folder, n) for n in sorted(names, key=lambda n: int(n[11:]))]


def all_processes(value):
    """Every process's value (a small picklable object) in rank order, on every process; [value] in a plain run."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def read_json(path):
    """The JSON in a file, or None where it is missing or not JSON."""
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return None


def checkpoint_problem(path):
    """What keeps a checkpoint from resuming, in words, or None: its files at the sizes saved (a stat: no shard is
    read), its JSON files readable, its state of the iteration in its name."""
    manifest = read_json(os.path.join(path, "manifest.json"))
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return "its manifest.json is missing or damaged"
    for name, entry in manifest["files"].items():
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name} is missing"
        if os.path.getsize(os.path.join(path, name)) != entry["bytes"]:
            return f"{name} is not of the size it was saved with"
    if read_json(os.path.join(path, "args.json")) is None:
        return "its args.json cannot be read"
    state = read_json(os.path.join(path, "state.json"))
    if not isinstance(state, dict):
        return "its state.json cannot be read"
    named = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(path))  # a folder renamed, or a state of another
    if named and state.get("iteration") != int(named[1]):
        return f"its name says iteration {named[1]}, its state.json {state.get('iteration')}"
    return None


def sound_checkpoints(folder):
    """The checkpoints in folder with no checkpoint_problem, newest first."""
    return [path for path in reversed(checkpoints_in(folder)) if checkpoint_problem(path) is None]


def resume_instead(path):
    """What to do in place of resuming path: the newest sound checkpoint beside it, or a start afresh."""
    for other in sound_checkpoints(os.path.dirname(path)):
        if other != path:
            return f"resume from {other}, the newest whole checkpoint beside it"
    return "no checkpoint beside it is whole, so start afresh in another --output_dir"


def find_checkpoint(args):
    """--resume checked before any model loads: a sound checkpoint of this script and these arguments, in a folder
    of its own run ('auto' stays, load_checkpoint taking the newest sound one that loads, or None where none is)."""
    say = int(os.environ.get("RANK", 0)) == 0
    held = checkpoints_in(args.output_dir)
    path = args.resume
    if args.resume == "auto":
        path = None
        for other in reversed(held):
            problem = checkpoint_problem(other)
            if problem is None:
                path = other
                break
            if say:
                print(f"--resume auto: skipping {other}: {problem}")
        if held and not path:
            raise SystemExit(f"--resume auto: no checkpoint in {args.output_dir} is whole; pass another --output_dir.")
        if not path:
            args.resume = None
        if say and path:
            print(f"--resume auto: resuming from {path}")
        elif say:
            print(f"--resume auto: no checkpoint in {args.output_dir}, starting afresh")
    elif args.resume:  # a path: a whole checkpoint, or one sentence with the newest whole one beside it
        args.resume = os.path.normpath(args.resume)
        path = args.resume
        problem = checkpoint_problem(path)
        if problem is not None:
            raise SystemExit(f"--resume '{path}' is not a whole checkpoint: {problem}; {resume_instead(path)}.")
    if held and (not path or os.path.realpath(os.path.dirname(path)) != os.path.realpath(args.output_dir)):
        raise SystemExit(  # a new run, or a checkpoint from elsewhere, would mix with that run's
            f"--output_dir '{args.output_dir}' holds the checkpoints of a run (the newest: "
            f"{os.path.basename(held[-1])}); pass --resume auto to continue it, or another --output_dir."
        )
    if not path:
        return
    script = os.path.basename(__file__)
    made_by = read_json(os.path.join(path, "manifest.json")).get("script")
    if made_by != script:
        raise SystemExit(
            f"'{path}' is a checkpoint of {made_by}, not of {script}; resume it with {made_by}, "
            f"or start {script} in another --output_dir."
        )
    saved = read_json(os.path.join(path, "args.json"))
    now = json.loads(json.dumps(asdict(args)))  # tuples as lists, as in the saved file
    changed = [k for k in saved if k not in RESUMABLE and saved[k] != now.get(k)]
    if changed:
        raise SystemExit(
            f"'{path}' was made with other values of {', '.join('--' + k for k in changed)}; pass "
            f"those of its args.json (only {', '.join('--' + k for k in RESUMABLE[3:])} may change)."
        )


def trainer_state_dicts(models, optimizers):
    """Each trained model's and optimiser's state, keyed by parameter name (under FSDP2, this process's shards)."""
    return {k: dict(zip(("model", "optimizer"), get_state_dict(models[k], optimizers[k]))) for k in models}


def save_checkpoint(args, models, optimizers, state, rank):
    """What a resumed run needs, in a .tmp folder renamed once every process wrote; all but --keep_checkpoints go."""
    path = os.path.join(args.output_dir, f"checkpoint-{state['iteration']}")
    tmp = path + ".tmp"
    saved = rank == 0 and read_json(os.path.join(path, "state.json")) == json.loads(json.dumps(state))
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this iteration cut short, gone before the gather below
    if all_processes(saved and checkpoint_problem(path) is None)[0]:  # a stop just after a save
        return path
    error = first_error_anywhere(dcp.save, trainer_state_dicts(models, optimizers), checkpoint_id=tmp)
    if error is None:
        error = first_error_anywhere(complete_checkpoint, tmp, path, args, state, here=rank == 0)
    if error is None:
        return path
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(write_failure(f"writing {path}", error, args))
    raise SystemExit(1)


def first_error_anywhere(step, *inputs, here=True, **options):
    """step(*inputs, **options) where here is true; on every process, the first process's error as text, or None."""
    error = None
    try:
        if here:
            step(*inputs, **options)
    except (OSError, RuntimeError, dcp.CheckpointException) as e:  # a full disk shows as any of these
        if isinstance(e, dcp.CheckpointException):
            e = next(iter(e.failures.values()))[0]  # each process's error, with its traceback
        error = f"{type(e).__name__}: {e}"[:300]
    errors = [e for e in all_processes(error) if e]
    if errors:
        return errors[0]
    return None


def load_shards(path, models, optimizers):
    """Every process: its shards of the models and optimisers, as saved (for any process count)."""
    saved = trainer_state_dicts(models, optimizers)
    dcp.load(saved, checkpoint_id=path)
    for k in models:
        set_state_dict(
            models[k], optimizers[k], model_state_dict=saved[k]["model"], optim_state_dict=saved[k]["optimizer"]
        )


def complete_checkpoint(tmp, path, args, state):
    """Rank 0: beside the shards, the log so far, the arguments, the state and a manifest (the script, each file's
    size), flushed to disk; the folder renamed over a stale checkpoint-N; then the oldest and any save cut short go."""
    shutil.copy(os.path.join(args.output_dir, "metrics.jsonl"), tmp)
    pathlib.Path(tmp, "args.json").write_text(json.dumps(asdict(args), indent=2))
    pathlib.Path(tmp, "state.json").write_text(json.dumps(state, indent=2))
    files = {name: {"bytes": os.path.getsize(os.path.join(tmp, name))} for name in sorted(os.listdir(tmp))}
    manifest = {"script": os.path.basename(__file__), "files": files}
    pathlib.Path(tmp, "manifest.json").write_text(json.dumps(manifest, indent=2))
    for name in ("args.json", "state.json", "metrics.jsonl", "manifest.json", "."):  # dcp.save flushed its own
        flush_to_disk(os.path.join(tmp, name))
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)
    flush_to_disk(args.output_dir)  # the rename
    cut_short = list(pathlib.Path(args.output_dir).glob("checkpoint-*.tmp"))
    for old in checkpoints_in(args.output_dir)[: -args.keep_checkpoints] + cut_short:
        if os.path.islink(old):
            os.remove(old)  # a link goes, never what it points to
        else:
            shutil.rmtree(old)


def flush_to_disk(path):
    """A file's or a folder's entries written through to the disk (fsync), so that a crash cannot undo a save."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def write_failure(what, error, args):
    """One sentence for a failed write, with the checkpoint to go on from."""
    newest = (checkpoints_in(args.output_dir) or [None])[-1]
    then = f"go on from {newest}, the last good checkpoint, with --resume auto" if newest else "start again"
    return f"{what} failed ({error}); free some space on '{args.output_dir}' (or make it writable again) and {then}."


def new_state(**algorithm_state):
    """A run's state at its start: the bookkeeping every script keeps, then the algorithm's own entries."""
    state = dict(iteration=0, episodes=0, data_position=(0, 0), alarms_on=[], bad_steps=0, skipped_steps=0, elapsed=0.0)
    state.update(algorithm_state)
    return state


def load_checkpoint(args, models, optimizers):
    """Models and optimisers as saved, and the state (every draw is seeded by the iteration); under --resume auto a
    checkpoint that fails to load gives way to the one before it, every process taking the same; --resume is set."""
    paths = [args.resume]
    if args.resume == "auto":
        paths = sound_checkpoints(args.output_dir)
    for path in paths:
        error = first_error_anywhere(load_shards, path, models, optimizers)
        if error is None:
            break
        if args.resume != "auto":
            raise SystemExit(
                f"checkpoint '{path}' could not be loaded ({error}); {resume_instead(path)}, or if the models "
                "changed size, resume with those it was trained from."
            )
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"--resume auto: {path} could not be loaded ({error}); trying the one before it")
    if error is not None:
        raise SystemExit(
            f"--resume auto: no checkpoint in '{args.output_dir}' could be loaded (the last: {error}); if the "
            "models changed size, resume with those it was trained from, or start afresh in another --output_dir."
        )
    if path != paths[0] and int(os.environ.get("RANK", 0)) == 0:
        print(f"--resume auto: resuming from {path}")
    args.resume = path
    state = read_json(os.path.join(path, "state.json"))
    if state["iteration"] == 0:  # saved before any step: its Adam state is get_state_dict's zero-gradient step
        for optimizer in optimizers.values():
            optimizer.state.clear()  # (step 1, no moments), not one the run took; so Adam starts as the run did
    return state


def catch_stop_signals():
    """SIGTERM or Ctrl-C stops the run where it can save, a second at once: the list of reasons to stop (signals)."""
    stops = []

    def on_signal(signum, frame):
        if any(isinstance(r, int) for r in stops):
            os._exit(128 + signum)
        stops.append(signum)
        print(f"\n{signal.Signals(signum).name}: stopping to save a checkpoint (again: quit at once)", flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stops


def stop_if_asked(stops, state, models, optimizers, args):
    """When a process has a reason to stop (a signal, a failed reward, --max_bad_steps), all save and exit."""
    signum = next((r for r in stops if isinstance(r, int)), 0)
    failure = next((r for r in stops if isinstance(r, str)), None)
    reasons = {"signal": signum, "failure": failure is not None, "bad_steps": state["bad_steps"] >= args.max_bad_steps}
    found = torch.tensor(list(reasons.values()), device=next(models["policy"].parameters()).device)
    if dist.is_initialized():
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    reasons = dict(zip(reasons, found.tolist()))
    if not any(reasons.values()):
        return
    if reasons["failure"]:  # the message of the first process that failed
        failure = next(f for f in all_processes(failure) if f)
    elif reasons["bad_steps"]:
        failure = (
            f"{state['bad_steps']} optimiser steps in a row had a non-finite loss or gradient (iteration "
            f"{state['iteration']}); {USUAL_CAUSES}."
        )
        state = dict(state, bad_steps=0)
    rank = int(os.environ.get("RANK", 0))
    path = save_checkpoint(args, models, optimizers, state, rank)
    command = "python"
    if args.world_size > 1:
        command = f"torchrun --nproc_per_node={args.world_size}"
    argv = [arg for arg in sys.argv if not arg.startswith("--resume=")]  # this run's --resume, replaced by path
    while "--resume" in argv:
        del argv[argv.index("--resume") : argv.index("--resume") + 2]
    if rank == 0:
        print(
            f"stopped after iteration {state['iteration']}; to go on:\n  {command} {shlex.join(argv)} --resume {path}",
            flush=True,
        )
    if failure is None:  # a signal: the exit code of a process it ended
        raise SystemExit(128 + reasons["signal"])
    if rank == 0:  # said once, however main was called
        raise SystemExit(failure)
    raise SystemExit(1)


def step_is_finite(grad_norms, stats, state, iteration, args):
    """Whether to step: not on a nan or inf gradient norm, nor after --max_bad_steps in a row (norms into stats)."""
    grad_norms = {k: n.full_tensor() if isinstance(n, DTensor) else n for k, n in grad_norms.items()}  # FSDP2: all
    for name, norm in grad_norms.items():
        stats[f"grad_norm/{name}"] += norm.item()
    stats["steps"] += 1
    if state["bad_steps"] >= args.max_bad_steps:
        state["skipped_steps"] += 1
        return False
    if all(torch.isfinite(n) for n in grad_norms.values()):
        state["bad_steps"] = 0
    else:
        state["bad_steps"] += 1
        state["skipped_steps"] += 1
    if state["bad_steps"] == 1:
        print(f"iteration {iteration}: a non-finite loss or gradient; steps are skipped until a finite one", flush=True)
    return state["bad_steps"] == 0


# ---- dashboard and log
NOT_SUMS = ("tokens", "steps", "ratio_max", "first_ratio_dev")  # the keys of stats that are not sums over tokens


@torch.no_grad()
def add_token_stats(stats, mask, ratio, logprobs, logprobs_old, terms):
    """Add a micro-batch's per-token terms (micro, T), the ratio's and the approximate KL, to the iteration's sums."""
    log_ratio = (logprobs - logprobs_old) * mask
    terms = {**terms, "policy/ratio_mean": ratio, "policy/approx_kl": (ratio - 1) - log_ratio}
    for key, x in terms.items():
        stats[key] += (x * mask).sum().item()
    stats["tokens"] += mask.sum().item()
    stats["ratio_max"] = max(stats["ratio_max"], (ratio * mask).max().item())
    if "first_ratio_dev" not in stats:  # ~0 unless logprobs_old went stale: a free sanity check
        stats["first_ratio_dev"] = ((ratio - 1).abs() * mask).max().item()


def global_mean(x, mask=None):
    """Mean of a per-sequence statistic (B,) over every process's batch (where mask is 1), as a float."""
    if mask is None:
        mask = torch.ones_like(x).float()
    total = torch.stack([(x.float() * mask).sum(), mask.sum()]).double()
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).float().item()


def dashboard(stats, state, scores, rollout, clock, args):
    """The metrics every script logs, over all processes, from the stats, Scores, rollout and Stopwatch."""
    device = scores.raw.device
    sums = sorted(k for k in stats if k not in NOT_SUMS)
    totals = [stats[k] for k in sums] + [stats["tokens"], stats["steps"]]
    totals = torch.tensor(totals, device=device, dtype=torch.float64)
    ratio_max = torch.tensor(stats["ratio_max"], device=device)
    if args.world_size > 1:
        dist.all_reduce(totals)
        dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
    n_tokens = totals[-2].item()
    n_steps = totals[-1].item()
    P = rollout["input_ids"].shape[1] - rollout["response_mask"].shape[1]  # the prompts' columns
    lengths = rollout["response_mask"].sum(1).float()  # (N,) every process's responses
    has_eos = rollout["has_eos"]  # (N,) 1.0 where a stop token ended the response
    token_lists = [r[: int(n)].tolist() for r, n in zip(rollout["input_ids"][:, P:], lengths)]
    failed = torch.tensor([float(scores.failed)], device=device)
    m = {
        "iteration": state["iteration"],
        "episodes": state["episodes"],
        "objective/score": global_mean(scores.raw),
        "policy/first_ratio_dev": stats.get("first_ratio_dev"),
        "policy/ratio_max": ratio_max.item(),
        "response/length": lengths.mean().item(),
        "response/eos_rate": has_eos.mean().item(),
        "response/distinct1": distinct_n(token_lists, 1),
        "response/distinct2": distinct_n(token_lists, 2),
    }
    if args.mask_truncated:
        m["response/truncated_left_out"] = (1 - has_eos).mean().item()
    for phase, seconds in clock.seconds.items():
        m[f"time/{phase}"] = seconds
    m["time/iteration"] = time.time() - clock.start
    m["health/reward_errors"] = args.world_size * global_mean(failed)
    m["health/skipped_steps"] = state["skipped_steps"]
    for key, x in scores.metrics.items():  # the rules' weighted sum, and each when there are several (nan: unscored)
        m[key] = global_mean(x.nan_to_num(0.0), x.isfinite().float())
    for key, total in zip(sums, totals.tolist()):
        if key.startswith("grad_norm"):
            m[key] = total / n_steps
        else:
            m[key] = total / n_tokens
    m["time/tokens_per_second"] = len(lengths) * (P + m["response/length"]) / m["time/iteration"]
    return m


class Stopwatch:
    """An iteration's phases: the seconds each took in all (lap(phase) ends one), in the order they first ran."""

    def __init__(self):
        self.start = time.time()
        self.last = self.start
        self.seconds = {}

    def lap(self, phase):
        now = time.time()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now


def lock_output_dir(args):
    """One run per folder: rank 0 locks an existing --output_dir before anything there is read, the others waiting."""
    if os.path.isdir(args.output_dir) and int(os.environ.get("RANK", 0)) == 0:
        take_lock(args.output_dir)
    all_processes(None)


@functools.cache  # held from the first call until the process ends
def take_lock(folder):
    """One run per folder: rank 0 locks run.lock, naming its process (the system unlocks it when the process ends);
    returns the file, and the line that says this run takes over the lock of a process that ended ("" if none)."""
    path = os.path.join(folder, "run.lock")
    me = f"process {os.getpid()} on {os.uname().nodename}"
    try:  # open's "a+", but a link is never followed: written through, the file it names would be emptied
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o666)
    except OSError as e:  # a link, a folder of that name, a file or folder without write permission
        why = e.strerror
        if os.path.islink(path):  # said so, not as O_NOFOLLOW's "Too many levels of symbolic links"
            why = "it is a symbolic link, which is never written through"
        raise SystemExit(
            f"--output_dir '{folder}' cannot be locked: its run.lock cannot be opened for writing ({why}); "
            "remove it or make it writable, or pass another --output_dir."
        ) from None
    f = os.fdopen(fd, "a+")
    before = os.pread(f.fileno(), 1000, 0).decode(errors="replace")  # the process holding it, or that held it last
    try:
        os.lockf(f.fileno(), os.F_TLOCK, 0)
    except (BlockingIOError, PermissionError):
        raise SystemExit(
            f"--output_dir '{folder}' is in use by another run ({before}, its {path}); wait for it to "
            "end, or pass another --output_dir."
        ) from None
    except OSError as e:  # ENOLCK: a file system without locks (NFS without its lock service)
        print(f"{path}: this file system cannot lock ({e.strerror}): a second run here would not be refused")
    taken_over = ""  # said by Log once the run writes here, past the checks that may refuse the folder
    if before not in ("", me):
        taken_over = f"{path}: {before} has ended; this run takes the folder over"
    f.truncate(0)
    print(me, file=f, end="", flush=True)
    return f, taken_over


class Log:
    """What rank 0 shows and keeps: args.json, metrics.jsonl, a line per iteration, samples, a progress bar, wandb."""

    def __init__(self, args, state, rank, tokenizer):
        self.args = args
        self.tokenizer = tokenizer
        self.on = rank == 0  # rank 0 alone prints and writes
        self.file = None
        self.wandb = None
        if self.on:
            os.makedirs(args.output_dir, exist_ok=True)
            self.lock, taken_over = take_lock(args.output_dir)  # before anything is written there
            if taken_over:
                print(taken_over)
            pathlib.Path(args.output_dir, "args.json").write_text(json.dumps(asdict(args), indent=2))
            metrics = os.path.join(args.output_dir, "metrics.jsonl")
            if args.resume:  # the log cut back to the checkpoint's rows, then on from there
                shutil.copy(os.path.join(args.resume, "metrics.jsonl"), metrics)
                self.file = open(metrics, "a")
            else:
                self.file = open(metrics, "w")
            if args.track:  # offline where WANDB_MODE=offline; a resumed run goes on in its wandb run
                import wandb

                state["wandb_id"] = state.get("wandb_id") or os.urandom(8).hex()
                wandb.init(
                    project=args.wandb_project,
                    name=args.exp_name,
                    config=asdict(args),
                    id=state["wandb_id"],
                    resume="allow",
                    dir=args.output_dir,
                    save_code=True,
                )
                self.wandb = wandb
        if state["iteration"] >= args.num_iterations and self.on:  # a resume with nothing left to train
            print(f"--total_episodes {args.total_episodes} ends at iteration {args.num_iterations}: no step is taken")
        self.t_start = time.time() - state["elapsed"]
        self.progress = tqdm(
            total=args.num_iterations,
            initial=state["iteration"],
            unit="iter",
            dynamic_ncols=True,
            disable=not self.on or not sys.stderr.isatty(),
        )

    def write(self, m, step):
        """Rank 0: a row of metrics.jsonl (flushed: a checkpoint copies the file as it stands), and to wandb."""
        try:
            print(json.dumps(m), file=self.file, flush=True)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
            raise SystemExit(write_failure(f"writing {self.file.name}", error, self.args)) from None
        if self.wandb:
            self.wandb.log(m, step=step)

    def evaluation(self, evaluation, state):
        """The starting policy's held-out score, in a row of its own (none where its reward failed)."""
        if evaluation and self.on:
            m = {"iteration": state["iteration"], "episodes": state["episodes"], **evaluation}
            m["time/elapsed"] = time.time() - self.t_start
            print(
                f"iter 0 (before training) | held-out score sampled {m['eval/score']:+.3f} greedy "
                f"{m['eval/score_greedy']:+.3f}",
                flush=True,
            )
            self.write(m, step=state["episodes"])

    def iteration(self, m, state, prompt_ids, texts, scores):
        """The alarms, the printed line, the bar, the log; sample rows (prompt, response, score) now and then."""
        args = self.args
        iteration = m["iteration"]
        state["elapsed"] = time.time() - self.t_start
        m["time/elapsed"] = state["elapsed"]
        firing = failure_alarms(m, state, args)
        m.update({f"alarm/{k}": float(v) for k, v in firing.items()})
        if self.on:
            shown = " ".join(f"{label} {m[key]:{fmt}}" for label, key, fmt in PRINTED if key in m)
            shown += "".join(f" {key[7:]} {x:.2f}" for key, x in m.items() if key.startswith("reward/"))  # each rule's
            if m["health/reward_errors"]:
                shown += f" failed {m['health/reward_errors']:.0f}"
            tqdm.write(
                f"iter {iteration}/{args.num_iterations} ep {state['episodes']} | {shown} | "
                f"{m['time/iteration']:.1f}s gen {m['time/generate'] / m['time/iteration']:.0%}"
            )
            if not any(key.startswith("grad_norm/") for key in m):  # every minibatch skipped
                tqdm.write(f"iter {iteration}: no optimiser step: every response was left out of the loss")
            for name in [name for name, on in firing.items() if on and name not in state["alarms_on"]]:
                tqdm.write(f"ALARM {name}: {ALARMS[name]}")
            self.progress.set_postfix(
                {label: f"{m[key]:{fmt}}" for label, key, fmt in PRINTED if key in m and key.startswith("objective/")},
                refresh=False,
            )
            self.progress.update()
            self.write(m, step=state["episodes"])
            if iteration % args.log_samples_every == 0 or iteration == 1:
                prompts = self.tokenizer.batch_decode(prompt_ids[:3], skip_special_tokens=True)
                samples = list(zip(prompts, texts[:3], scores[:3].tolist()))
                print("\n".join(f"    {s:+.2f} | {p!r} -> {r!r}" for p, r, s in samples))
                if self.wandb:
                    table = self.wandb.Table(columns=["prompt", "response", "score"], data=[list(x) for x in samples])
                    self.wandb.log({"samples": table}, step=state["episodes"])
        state["alarms_on"] = [name for name, on in firing.items() if on]


def finish(policy, tokenizer, log, state, args, rank):
    """The policy and tokenizer saved for from_pretrained, unless its last steps were not finite; all closed."""
    if state["bad_steps"] and rank != 0:
        raise SystemExit(1)
    if state["bad_steps"]:
        raise SystemExit(
            f"the last {state['bad_steps']} optimiser step(s) had a non-finite loss or gradient, so the "
            f"policy is not saved to {args.output_dir}; {USUAL_CAUSES}."
        )
    weights = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        try:
            if args.lora_r:
                lora_policy_to_save(weights, args).save_pretrained(args.output_dir)
            else:
                named = dict(policy.named_parameters()) | dict(policy.named_buffers())
                policy.save_pretrained(args.output_dir, state_dict={k: v for k, v in weights.items() if k in named})
            tokenizer.save_pretrained(args.output_dir)
            mode = os.stat(os.path.join(args.output_dir, "args.json")).st_mode  # the umask's; safetensors writes 0600
            for weights_file in pathlib.Path(args.output_dir).glob("*.safetensors"):
                weights_file.chmod(mode)
        except OSError as e:
            raise SystemExit(write_failure("saving the policy", f"{type(e).__name__}: {e}", args)) from None
        print(f"saved the policy to {args.output_dir}")
        log.file.close()
        if log.wandb:
            log.wandb.finish()
    log.progress.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    warnings.formatwarning = lambda message, category, *where: f"{category.__name__}: {message}\n"  # no source line
    code = 0  # the process's exit code
    try:
        if any(arg.split("=")[0] in ("--num_iterations", "--num-iterations") for arg in sys.argv[1:]):  # TRL's name
            raise SystemExit(
                "--num_iterations (TRL's passes over each rollout) is --num_epochs here; the number of iterations "
                "follows from --total_episodes."
            )
        main(tyro.cli(Args, use_underscores=True))
    except SystemExit as e:  # a sentence that stops the run: said once, by rank 0; every process exits with 1
        code = 1 if isinstance(e.code, str) else e.code
        if isinstance(e.code, str) and int(os.environ.get("RANK", 0)) == 0:
            print(e.code, file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # Ctrl-C before the run catches it (while the models load): one line, not a traceback
        code = 130
        if int(os.environ.get("RANK", 0)) == 0:
            print("stopped by Ctrl-C while starting: nothing was saved", file=sys.stderr, flush=True)
    if "WORLD_SIZE" in os.environ:  # under torchrun: leave before the interpreter's teardown, where gloo's threads,
        sys.stdout.flush()  # still freeing a collective's tensors, now and then abort a process that has ended
        os._exit(code or 0)
    raise SystemExit(code)
