"""DAPO in one file: GRPO with its four changes for long reasoning runs. Sample a group of responses per prompt, keep
drawing prompts until the batch is full of groups whose scores differ, and push each response up or down by how it
scored against its group, with a higher upper clip, every token weighted alike, and no KL term.

Decoupled Clip and Dynamic sAmpling Policy Optimisation (Yu et al. 2025, arXiv:2503.14476) is grpo.py with:
- clip-higher: the ratio's upper bound 1 + 0.28 above its lower 1 - 0.2, so that unlikely tokens can still rise
  (--clip_range_high; section 3.1);
- dynamic sampling: groups whose responses all score the same have no advantage and teach nothing, so prompts are
  drawn and sampled in rounds until --rollout_batch_size groups with signal fill the batch (section 3.2, eq. 11);
- the token-level loss, every token of the batch weighted alike (--loss_aggregation token_mean; section 3.3);
- the soft overlong punishment: a response in the last --overlong_buffer tokens before --response_length loses up
  to --overlong_penalty, linearly (section 3.4, eq. 13);
- no KL term to a reference (--kl_coef 0), as the paper removes it. `diff grpo.py dapo.py` shows exactly this.

Where this file departs from the paper, and why:
- Sizes fit the embedded task on a CPU: 8 responses per prompt (the paper: 16), 32 prompts per rollout (512), a
  buffer of 4 of 24 tokens (4,096 of 20,480); the answers are a few tokens, so the punishment rarely fires.
- The rounds stop after --max_sampling_rounds (the paper draws until the batch is full); groups without signal then
  fill the rest of the batch, in the order drawn.
- A response that never reaches its stop token pays --missing_eos_penalty as in grpo.py, on top of the punishment.
- --total_episodes counts the responses trained on, as in grpo.py: it sets the number of iterations. The responses
  generated, dropped groups included, are logged as episodes.

Commands: `python dapo.py` (the embedded default: arithmetic with its checker, CPU, minutes); `python dapo.py
--model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --dataset_config main --prompt_field question
--chat_template --reward_fn gsm8k --mixed_precision --learning_rate 1e-6` (one GPU); `torchrun --nproc_per_node=8
dapo.py --args ...` (one process per GPU).
"""

import importlib.util
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

if importlib.util.find_spec("rlhf_runtime") is None:  # this file copied without the folder beside it
    raise SystemExit(f"{__file__} needs the folder rlhf_runtime/ beside it: copy it from this project too.")
import rlhf_runtime as runtime  # noqa: E402 (after the check above) the plumbing the scripts share, written once

try:  # rlhf_kernels/ beside this file: the fused log-softmax-gather, and generate's decode steps as CUDA graphs
    from rlhf_kernels import static_decode, token_logprobs
except ImportError:  # copied without it: generate's own decode loop, and the same log-probs from plain torch
    static_decode = None

    def token_logprobs(logits, tokens, temperature=1.0, return_entropy=False, check_range=True):
        """log softmax(logits / temperature) (..., V) at tokens (...), in float32, and the entropy (...)."""
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (..., V)
        chosen = logp.gather(-1, tokens[..., None]).squeeze(-1)  # (...)
        entropy = -(logp.exp() * logp.clamp(min=-1e4)).sum(-1)  # the clamp: 0 * -inf would be nan
        return (chosen, entropy) if return_entropy else chosen


@dataclass
class Args:
    # the task: what is trained on, how it is scored, where it is written
    exp_name: str = "dapo"
    """name of the run (wandb run name)"""
    output_dir: str = "runs/dapo"
    """where metrics.jsonl, args.json and the final policy are written"""
    dataset: str = f"{runtime.ASSETS}/arithmetic/train.jsonl"
    """training prompts: a local .jsonl, .json, .csv, .tsv or .parquet file (.gz/.bz2/.xz too), or a hub dataset"""
    reward_model_path: tuple[str, ...] = ()
    """reward models (sequence classifiers, one label); with several, the score is their minimum"""
    reward_fn: tuple[str, ...] = ("arithmetic",)
    """rules, weighted, added to reward models' minimum: arithmetic, gsm8k, f.py:fn (TRL's, verl's, OpenRLHF's too)"""

    # DAPO: groups with signal, clip-higher, the token-level loss, the overlong punishment
    total_episodes: int = 64000
    """responses trained on over the whole run (those generated, dropped groups included, are logged as episodes)"""
    rollout_batch_size: int = 32
    """prompts per iteration, over all processes; each is sampled num_generations times"""
    num_generations: int = 8
    """G, responses per prompt: the group whose mean (and std) is each response's baseline"""
    minibatch_size: int = 64
    """responses per optimiser step, over all processes"""
    micro_batch_size: int = 64
    """responses per forward/backward in one process (gradient accumulation makes up the minibatch; a value at least
    the per-process minibatch is one micro-batch, so the defaults hold under torchrun)"""
    num_epochs: int = 1
    """passes over each rollout (typically 1 to 4; more and the data goes stale)"""
    learning_rate: float = 2e-4
    """policy learning rate (hub-sized models want 1e-6 to 5e-6)"""
    clip_range_low: float = 0.2
    """ratios below 1 - clip_range_low stop pushing a token down"""
    clip_range_high: float = 0.28
    """ratios above 1 + clip_range_high stop pushing a token up: clip-higher, above the lower range (the paper's)"""
    policy_loss: Literal["clip", "gspo", "cispo"] = "clip"
    """the surrogate: PPO's clipped ratio per token; GSPO's one clipped ratio per response (the paper: --clip_range_low
    3e-4 --clip_range_high 4e-4); CISPO's clipped, detached weight on every token's log pi (no lower bound: low 1)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide r - mean(group) by the group's std (GRPO), the whole batch's std, or nothing (Dr. GRPO)"""
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    """how token losses become the minibatch loss: DAPO's token mean, GRPO's mean of sequence means, Dr. GRPO's
    constant divisor"""
    kl_coef: float = 0.0
    """beta of the KL term in the loss; 0, the paper's, skips the reference model entirely"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """the per-token KL estimate in the loss (see kl_penalty)"""
    drop_zero_signal_groups: bool = False
    """leave groups whose responses all scored the same out of the loss"""
    max_sampling_rounds: int = 8
    """the most rounds of sampling in an iteration (the paper: until the batch is full); then groups without signal
    fill the rollout"""
    overlong_buffer: int = 4
    """the soft overlong punishment: over the last this many tokens before --response_length a response's score falls
    linearly to -overlong_penalty; one cut off there gets -overlong_penalty (with --mask_truncated: nothing); 0: off
    (the paper: 4,096 of 20,480 tokens; here 4 of 24)"""
    overlong_penalty: float = 1.0
    """the soft overlong punishment at --response_length (the paper's 1), added to --missing_eos_penalty"""

    # generation and the shared loss terms
    response_length: int = 24
    """most new tokens per response"""
    temperature: float = 1.0
    """sampling temperature; the log-probs of training and KL use the same temperature"""
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

    run: tyro.conf.OmitArgPrefixes[runtime.RunSettings] = field(default_factory=runtime.RunSettings)
    """the run's settings, alike in every script: models and data, evaluation, logging, alarms, checkpoints, LoRA"""


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


def overlong_penalty(lengths, has_eos, max_length, buffer, factor, truncated_left_out):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), each response's (B,): 0 up to the last buffer tokens
    before max_length, then falling linearly to -factor at it; -factor when cut off there without a stop token, unless
    truncated_left_out (--mask_truncated leaves it out of the loss). lengths (B,) count the stop token; has_eos (B,)."""
    if not buffer:
        return torch.zeros_like(lengths, dtype=torch.float)
    over = ((lengths - max_length) / buffer + 1).clamp(0, 1)  # (B,) 0 before the buffer, 1 at max_length
    penalty = -factor * torch.where(has_eos, over, 1.0)
    if truncated_left_out:  # a cut-off response is left out of the loss, not punished
        penalty = torch.where(has_eos, penalty, 0.0)
    return penalty


def rows_with_signal_first(signal, n):
    """Dynamic sampling's rollout (Yu et al. 2025, eq. 11): the indices (n,) of the first n rows whose group has signal,
    in the order drawn, then of those without. signal (R,): 1.0 on the rows of groups whose scores differ."""
    return (1 - signal).argsort(stable=True)[:n]


def group_advantages(scores, group_size, scale_rewards, eps=1e-8):
    """GRPO's advantage of each response (Shao et al. 2024, eq. 3 with outcome rewards; its A_i):
    A_i = (r_i - mean(r_group)) / std(r_group), the population std; 'batch' divides by the std of all the scores
    instead, 'none' by nothing (Dr. GRPO: the std overweights prompts that are nearly solved
    or nearly hopeless). scores (B,) hold consecutive groups of group_size. Returns (B,)."""
    grouped = scores.view(-1, group_size)  # (groups, G)
    centred = grouped - grouped.mean(1, keepdim=True)
    # A group whose scores are all equal has no signal: exactly 0. Centred, its scores are 0 only up to rounding (the
    # float32 mean of eight 0.3s is not 0.3), and a std of 0 + eps would blow that up to order 1.
    centred = torch.where(zero_signal_groups(scores, group_size)[:, None], 0.0, centred)
    if scale_rewards == "group":
        centred = centred / (grouped.std(1, unbiased=False, keepdim=True) + eps)
    elif scale_rewards == "batch":
        centred = centred / (masked_var(scores, torch.ones_like(scores)) ** 0.5 + eps)
    return centred.reshape(-1)


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
        position_ids=runtime.position_ids_from(attention_mask),
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


@dataclass
class Sampling:
    """How generate samples (stop_ids (S,): the tokens that end a response; kernel_decode: rlhf_kernels' decode)."""

    max_new_tokens: int
    temperature: float
    stop_ids: torch.Tensor
    pad_token_id: int
    kernel_decode: bool = False


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
    runtime.hold_full_parameters(policy, hold=True)
    cache = DynamicCache()
    unique, copies = torch.unique_consecutive(torch.cat([prompt_ids, prompt_mask], 1), dim=0, return_inverse=True)
    ids, mask = unique.tensor_split([prompt_ids.shape[1]], 1)  # (U, P) each: the U prompts unlike the row before
    logits = policy(
        input_ids=ids,
        attention_mask=mask,
        position_ids=runtime.position_ids_from(mask),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[copies, -1]  # the last position's alone: (B, V)
    cache.reorder_cache(copies)  # a group's prompt encoded once, its keys and values repeated for its rows: (B, ...)
    next_position = runtime.position_ids_from(prompt_mask)[:, -1:] + 1  # (B, 1)
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
    runtime.hold_full_parameters(policy, hold=False)
    return torch.stack(tokens, 1), torch.stack(logprobs, 1), torch.stack(masks, 1).long()


def build_models(args, tokenizer, device):
    """Load the policy, its frozen reference and the reward models, in eval mode (no dropout). With
    --kl_coef 0 nothing reads the reference, so it is not loaded at all."""
    policy = runtime.load_model(AutoModelForCausalLM, args.run.model_name_or_path, args.run, device, trained=True)
    ref_policy = runtime.load_reference(args.run, policy, device) if args.kl_coef > 0 else None
    reward_models = runtime.load_reward_models(args.reward_model_path, tokenizer, args.run, device)
    return policy, ref_policy, reward_models


def validate(args):
    """Everything that can be checked before a model loads: one sentence for each mistake, naming the fix."""
    runtime.require(
        args, ("num_generations",), "must be at least 2 (the others are each one's baseline)", lambda v: v >= 2
    )
    runtime.require(args, ("learning_rate", "clip_range_low", "clip_range_high"), "must be positive", lambda v: v > 0)
    runtime.require(args, ("kl_coef", "overlong_penalty"), "must be zero or more", lambda v: v >= 0)
    runtime.require(args, ("max_sampling_rounds",), "must be at least 1", lambda v: v >= 1)
    runtime.require(
        args, ("overlong_buffer",), "must lie in [0, --response_length]", lambda v: 0 <= v <= args.response_length
    )
    if args.dual_clip and args.policy_loss != "clip":
        raise SystemExit(
            f"--dual_clip bounds the clipped loss of a token's ratio; --policy_loss {args.policy_loss} has "
            "no such per-token term to bound (GSPO's ratio is per response, CISPO's weight is clipped already)."
        )
    runtime.check_common_args(args, responses_per_iteration=args.rollout_batch_size * args.num_generations)


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
    ("rounds", "rollout/sampling_rounds", "d"),
    ("groups with signal", "rollout/groups_kept", "d"),
    ("held-out", "eval/score", "+.3f"),
]


def main(args):
    # --- 0. set-up: one process per device under torchrun (a plain run needs none); the data checked first ---
    run = args.run  # the run's settings (rlhf_runtime.RunSettings): data, evaluation, checkpoints, precision, ...
    rank, device = runtime.start_processes(run)
    validate(args)  # every argument checked: nothing is created or started before
    runtime.lock_output_dir(args.output_dir)  # one run per folder
    reward_fns = runtime.load_reward_fns(args.reward_fn, run.reward_timeout)  # yours, each in a process of its own
    runtime.find_checkpoint(args)  # --resume: which checkpoint to go on from
    torch.manual_seed(run.seed)  # the same on every process: new weights (a head, adapters) start the same
    tokenizer, prompts, rows, held_out, stop_ids = runtime.load_task(args, device, reward_fns)
    decode_graphs = runtime.graphs_decode(run.decode, device)  # rlhf_kernels' CUDA graphs, on one GPU
    sampling = Sampling(args.response_length, args.temperature, stop_ids, tokenizer.pad_token_id, decode_graphs)
    G = args.num_generations
    responses_per_iteration = args.rollout_batch_size * G
    run.num_iterations = args.total_episodes // responses_per_iteration
    policy, ref_policy, reward_models = build_models(args, tokenizer, device)
    models = {"policy": policy}
    adamw = dict(eps=1e-5, weight_decay=0.0, fused=True)  # no weight decay (TRL, OpenRLHF): no signal, no change
    optimizers = {"policy": torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, **adamw)}
    all_models = [m for m in (policy, ref_policy, *[rm for rm, _ in reward_models]) if m is not None]
    if run.resume:  # the state: everything besides the model and optimiser that a resumed run needs
        state = runtime.load_checkpoint(args, models, optimizers)
    else:
        state = runtime.new_state()
    scorer = runtime.Scorer(reward_models, reward_fns, tokenizer, state, combine_scores)  # state: for TRL's functions
    log = runtime.Log(args, state, rank, tokenizer, PRINTED)
    stops = runtime.catch_stop_signals()  # the reasons to stop that come up: a signal, a failed reward
    if held_out[0] and not run.resume:  # the starting policy's score: the curves' first point
        log.evaluation(runtime.evaluate(generate, policy, scorer, sampling, held_out, args, stops), state)
        runtime.stop_if_asked(stops, state, models, optimizers, args)

    for iteration in range(state["iteration"] + 1, run.num_iterations + 1):
        clock = runtime.Stopwatch()
        rng = torch.Generator().manual_seed(run.seed * 1_000_000 + iteration)  # the same on every process
        data_position = state["data_position"]  # each round draws the next prompts
        drawn = []  # each round's responses, of every process
        reward_failures = 0  # this process's, over the rounds
        for _round in range(args.max_sampling_rounds):
            # --- 1. prompts: the same shuffled order on every process, each taking its own slice ---
            # width: the longest prompt of every process's
            idx, width, data_position = runtime.next_prompts(
                prompts, data_position, args.rollout_batch_size, run.seed, run.world_size, rank
            )
            idx = [i for i in idx for _ in range(G)]  # each prompt G times in a row: a group stays on one process
            prompt_ids, prompt_mask = runtime.left_pad([prompts[i] for i in idx], tokenizer.pad_token_id, device, width)
            P = prompt_ids.shape[1]  # (B, P), B = local prompts x G

            # --- 2. generate with the current policy, recording logprobs_old as we sample; 3. score the responses ---
            # (B, response_length): this process's rows of the draws made for every process
            uniforms = runtime.row_uniforms(rng, len(idx), args.response_length, run.world_size, rank).to(device)
            responses, logprobs_old, response_mask = generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
            input_ids = torch.cat([prompt_ids, responses], 1)  # (B, P + T)
            attention_mask = torch.cat([prompt_mask, response_mask], 1)  # (B, P + T)
            clock.lap("generate")
            scores = runtime.score_responses(scorer, input_ids, attention_mask, P, [rows[i] for i in idx], args, stops)
            has_eos = torch.isin(responses, sampling.stop_ids).any(1)  # (B,) ended by EOS or the end of turn
            train_mask = response_mask * (has_eos | (not args.mask_truncated))[:, None]  # (B, T) what the loss reads
            runtime.stop_if_asked(stops, state, models, optimizers, args)  # a failed reward, a signal: before step 1
            # Dynamic sampling (Yu et al. 2025, eq. 11): rounds until rollout_batch_size groups have scores that differ
            overlong = overlong_penalty(
                response_mask.sum(1),
                has_eos,
                args.response_length,
                args.overlong_buffer,
                args.overlong_penalty,
                args.mask_truncated,
            )  # (B,)
            penalised = scores.raw - args.missing_eos_penalty * ~(has_eos | args.mask_truncated) + overlong  # (B,)
            signal = ~zero_signal_groups(penalised, G).repeat_interleave(G)  # (B,) rows of groups with signal
            reward_failures += scores.failed
            round_rows = dict(
                prompt_ids=prompt_ids,
                prompt_mask=prompt_mask,
                response_ids=responses,
                response_mask=response_mask,
                logprobs_old=logprobs_old,
                train_mask=train_mask,
                has_eos=has_eos.float(),
                overlong=overlong,
                signal=signal.float(),
                raw=scores.raw,
                **scores.metrics,
            )
            drawn.append(runtime.gather_rows(round_rows))  # every process's rows, in the order one process draws them
            groups_with_signal = int(sum(rows["signal"].sum().item() for rows in drawn)) // G
            clock.lap("score")  # this round's scoring, kept apart from the next round's generation
            if groups_with_signal >= args.rollout_batch_size:
                break
        # The first rollout_batch_size groups with signal in the order drawn (then those without); each its slice
        signal = torch.cat([rows["signal"] for rows in drawn])  # (rounds x N,) every round's rows, every process's
        order = rows_with_signal_first(signal, responses_per_iteration)  # (N,) of every round's rows
        kept, scores = runtime.keep_rows(drawn, order, scores.metrics, reward_failures, tokenizer, run.world_size, rank)
        prompt_ids = kept["prompt_ids"]
        P = prompt_ids.shape[1]
        input_ids = kept["input_ids"]
        attention_mask = kept["attention_mask"]
        response_mask = kept["response_mask"]
        logprobs_old = kept["logprobs_old"]
        train_mask = kept["train_mask"]
        has_eos = kept["has_eos"]
        overlong = kept["overlong"]

        with torch.no_grad():
            score = torch.where(has_eos | args.mask_truncated, scores.raw, scores.raw - args.missing_eos_penalty)
            if args.overlong_buffer:
                score = score + overlong  # DAPO's soft overlong punishment

            # --- 4. group-relative advantages, one per response (the reference is read beside the policy, in step 5) --
            every_score = runtime.gather_rows({"score": score})["score"]  # (N,) every process's: --scale_rewards batch
            advantages = group_advantages(every_score, G, args.scale_rewards).chunk(run.world_size)[rank]  # (B,)
            group_std = score.view(-1, G).std(1, unbiased=False)  # (B / G,)
            zero_signal = zero_signal_groups(score, G)  # (B / G,)
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
        rollout = runtime.gather_rows(rollout)
        stats = defaultdict(float)  # sums over tokens of what the dashboard shows
        seq_kl = torch.zeros(responses_per_iteration, device=device)  # (N,) log pi_old - log pi_ref, summed
        kl_read = torch.zeros(responses_per_iteration, device=device)  # (N,) 1 where this process read the reference
        runtime.adapter_dropout(models.values(), on=True)  # --lora_dropout, in the training forward only
        for epoch in range(args.num_epochs):
            perm = torch.randperm(responses_per_iteration, generator=rng).to(device)
            for mb_start in range(0, responses_per_iteration, args.minibatch_size):
                mb_idx = perm[mb_start : mb_start + args.minibatch_size]
                mb_mask = rollout["train_mask"][mb_idx]
                mb_tokens = mb_mask.sum().item()  # valid tokens in the global minibatch
                mb_sequences = mb_mask.amax(1).sum().item()  # responses it trains on
                mine = mb_idx.chunk(run.world_size)[rank]  # this process's share
                if mb_tokens == 0:  # every response left out: no step, not even Adam's momentum
                    continue
                for micro_idx in runtime.by_length(mine, rollout["attention_mask"]).split(args.micro_batch_size):
                    micro, p = runtime.cut_padding({k: v[micro_idx] for k, v in rollout.items()}, P)  # (micro, p + T')
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
                    per_token = pg_loss - args.ent_coef * entropy  # (micro, T)
                    terms = {"policy/loss": pg_loss, "policy/entropy": entropy, "policy/clipfrac": pg_clipped}
                    if args.dual_clip:
                        terms["policy/dual_clipfrac"] = dual_clipped
                    if ref_policy is not None:  # on the same micro-batch: equal weights give equal log-probs, bit
                        with (
                            torch.no_grad()
                        ):  # for bit, so an unchanged policy's KL term is exactly 0, its gradient too
                            logprobs_ref = response_logprobs(
                                ref_policy, micro["input_ids"], micro["attention_mask"], p, args.temperature
                            )  # (micro, T')
                        terms["policy/kl_term"] = kl_penalty(logprobs, logprobs_ref, args.kl_estimator, mask)
                        per_token = per_token + args.kl_coef * terms["policy/kl_term"]
                        if epoch == 0:  # the dashboard's KL: nats per response, of the sampled tokens
                            kl = (micro["logprobs_old"] - logprobs_ref) * micro["response_mask"]
                            seq_kl[micro_idx], kl_read[micro_idx] = kl.sum(1), 1.0
                    weights = loss_weights(mask, args.loss_aggregation, args.response_length, mb_sequences, mb_tokens)
                    loss = (per_token * weights).sum()
                    loss.backward()  # under FSDP2, also sums the gradients over the processes
                    runtime.add_token_stats(stats, mask, ratio, logprobs, micro["logprobs_old"], terms)
                runtime.optimizer_step(
                    models, optimizers, stats, state, iteration, args.max_grad_norm, run.max_bad_steps
                )
        runtime.adapter_dropout(models.values(), on=False)
        clock.lap("optimize")

        # --- 6. the dashboard: batch statistics over all processes ---
        state["episodes"] += (len(drawn) - 1) * responses_per_iteration  # every round's responses are generated
        state["iteration"] = iteration
        state["episodes"] += responses_per_iteration
        state["data_position"] = data_position
        m = runtime.dashboard(stats, state, scores, rollout, clock, args.mask_truncated, run.world_size)
        m["memory/model_states_mb"] = runtime.megabytes_held(all_models, optimizers.values())  # rank 0's share
        if args.overlong_buffer:
            m["objective/overlong_penalty"] = runtime.global_mean(overlong)
        m["rollout/sampling_rounds"] = len(drawn)
        m["rollout/groups_drawn"] = len(drawn) * args.rollout_batch_size
        m["rollout/groups_kept"] = min(groups_with_signal, args.rollout_batch_size)
        m["objective/group_reward_std"] = runtime.global_mean(group_std)
        m["adv/zero_signal_fraction"] = runtime.global_mean(zero_signal)
        m["health/zero_signal"] = 1 - groups_with_signal / m["rollout/groups_drawn"]  # of the groups drawn
        m["adv/abs_mean"] = runtime.global_mean(advantages.abs())
        if ref_policy is not None:  # nats per response, as in ppo.py
            m["objective/kl"] = runtime.global_mean(seq_kl, kl_read)
            m["objective/kl_coef"] = args.kl_coef

        # --- 7. held-out score, alarms for the classic failure modes, the log; 8. a checkpoint ---
        if held_out[0] and (iteration % run.eval_every == 0 or iteration == run.num_iterations):
            m.update(runtime.evaluate(generate, policy, scorer, sampling, held_out, args, stops))
        log.iteration(m, state, prompt_ids, scores.texts, scores.raw)
        if (run.save_every and iteration % run.save_every == 0) or iteration == run.num_iterations:
            runtime.save_checkpoint(args, models, optimizers, state, rank)
        runtime.stop_if_asked(stops, state, models, optimizers, args)

    # --- last: the final policy where from_pretrained can load it (under FSDP2, gathered from the shards) ---
    runtime.finish(policy, tokenizer, log, state, args, rank)


if __name__ == "__main__":
    runtime.launch(main, Args)
