"""GRPO with tools in one file: the policy calls tools in a conversation, reads their answers and goes on; each
response is the whole conversation after the prompt, scored at its end, and only the policy's own tokens train.

This is grpo.py (`diff grpo.py grpo_tools.py` shows every change) with a multi-turn rollout, converse: the policy
writes a turn up to its end of turn; the calls in it, Hermes' <tool_call>{"name": ..., "arguments": {...}}</tool_call>
(Qwen's and many templates' form; a tokenizer's own response parser where it has one), run each in a process of its
own; their answers, or their errors as text, are rendered by the chat template as tool messages and appended; the
policy writes its next turn, until a turn calls no tool, --max_turns, or the length limit. The tools' tokens are
context, not actions: they are masked out of the loss, the KL term and the entropy (train_mask), as in TRL's
tool-calling GRPOTrainer and in the papers that train on tool use (Search-R1, Jin et al. 2025, arXiv:2503.09516;
ReTool, Feng et al. 2025, arXiv:2504.11536; ARTIST, Singh et al. 2025, arXiv:2505.01441). logprobs_old are recorded
while sampling, on the policy's tokens only, and the reference reads the same positions.

What the rollout keeps, and why:
- Token in, token out: the policy's sampled tokens are kept as they are, and only the tool messages are tokenised
  (the template's text after an assistant's turn), so the tokens that train are the tokens that were sampled: no
  re-tokenised text can drift from them, and log-probs at sampling equal the teacher-forced ones.
- Each turn is sampled by grpo.py's generate, its prompt the conversation so far (the KV cache rebuilt each turn; on
  the embedded default, keeping it saves 9 to 12%, bench/tool_cache.md), with the draws of the response's positions:
  a row's tokens do not depend on the rows beside it, so 2 processes sample what 1 does and a resume repeats a turn.
- A call that cannot be read, names no tool, has wrong arguments, raises or hangs (--tool_timeout) gets a tool
  message saying so: the policy learns from it, the metrics count it (tools/...), and the run goes on.

Commands: `python grpo_tools.py` (the embedded default: products with a multiply tool, CPU, minutes); docs/recipes.md
has a hub recipe (a small instruct model with a tool, one GPU); `torchrun --nproc_per_node=8 grpo_tools.py --args ...`.
"""

import importlib.util
from collections import defaultdict
from dataclasses import dataclass, field, replace
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
    exp_name: str = "grpo_tools"
    """name of the run (wandb run name)"""
    output_dir: str = "runs/grpo_tools"
    """where metrics.jsonl, args.json and the final policy are written"""
    dataset: str = f"{runtime.ASSETS}/multiply/train.jsonl"
    """training prompts: a local .jsonl, .json, .csv, .tsv or .parquet file (.gz/.bz2/.xz too), or a hub dataset"""
    reward_model_path: tuple[str, ...] = ()
    """reward models (sequence classifiers, one label); with several, the score is their minimum"""
    reward_fn: tuple[str, ...] = (f"{runtime.ASSETS}/tools.py:final_answer",)
    """rules, weighted, added to reward models' minimum: arithmetic, gsm8k, f.py:fn (TRL's, verl's, OpenRLHF's too);
    a rule reads the whole conversation (TRL's as messages, the others as the text of every turn)"""
    tools: tuple[str, ...] = (f"{runtime.ASSETS}/tools.py:multiply",)
    """the tools, f.py:fn or module:fn: typed Python functions with a docstring (TRL's convention)"""
    max_turns: int = 3
    """most turns of the policy per response; the last runs no tools"""
    tool_timeout: float = 10.0
    """seconds a tool call may take before its process is killed and the policy told so (0: no limit)"""
    max_total_length: int = 0
    """most tokens of a prompt and its whole response (the model's context); 0: --response_length is the only limit"""

    # GRPO: groups, the clipped surrogate, the KL term in the loss
    total_episodes: int = 25600
    """responses sampled over the whole run"""
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
    clip_range_high: float = 0.2
    """ratios above 1 + clip_range_high stop pushing a token up (DAPO's clip-higher raises it, e.g. to 0.28)"""
    policy_loss: Literal["clip", "gspo", "cispo"] = "clip"
    """the surrogate: PPO's clipped ratio per token; GSPO's one clipped ratio per response (the paper: --clip_range_low
    3e-4 --clip_range_high 4e-4); CISPO's clipped, detached weight on every token's log pi (no lower bound: low 1)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide r - mean(group) by the group's std (GRPO), the whole batch's std, or nothing (Dr. GRPO)"""
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    """how token losses become the minibatch loss: DAPO's token mean, GRPO's mean of sequence means, Dr. GRPO's
    constant divisor"""
    kl_coef: float = 0.04
    """beta of the KL term in the loss; 0 skips the reference model entirely"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """the per-token KL estimate in the loss (see kl_penalty)"""
    drop_zero_signal_groups: bool = False
    """leave groups whose responses all scored the same out of the loss"""

    # generation and the shared loss terms
    response_length: int = 48
    """most tokens per response: the policy's turns and the tools' messages together"""
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

    run: tyro.conf.OmitArgPrefixes[runtime.RunSettings] = field(
        default_factory=lambda: runtime.RunSettings(model_name_or_path=f"{runtime.ASSETS}/tiny-tools")
    )
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


@dataclass
class Conversing(Sampling):
    """What converse adds to generate's Sampling: the tools, the tokenizer that reads the calls and writes the tool
    messages, and the limits of a conversation (max_new_tokens: its whole response, --response_length)."""

    tools: object = None  # rlhf_runtime.Tools: each tool's process, their schemas
    tokenizer: object = None
    max_turns: int = 1
    max_total_length: int = 0  # a prompt and its response together; 0: no limit but max_new_tokens


@dataclass
class Turns:
    """What converse records of each response (B rows) besides its tokens."""

    policy_mask: torch.Tensor  # (B, T) 1 on the policy's own tokens; 0 on the tools' messages and past the end
    finished: torch.Tensor  # (B,) its last turn ended with a stop token: not cut by a length limit
    counts: dict  # {name: (B,)} turns, calls, calls parsed, failed and timed out, calls left at --max_turns


@torch.no_grad()
def converse(policy, prompt_ids, prompt_mask, sampling, uniforms=None):
    """Sample conversations with tools: each row's turn by generate, up to its end of turn; the calls in it run, their
    answers appended as the chat template's tool message; again, until a turn calls no tool, --max_turns (whose turn
    runs none) or the length limit. Rows that are done wait. Returns generate's three (B, T) over the whole response
    (logprobs_old 0 on the tools' tokens), each response as messages (TRL's form) and Turns. Token t of a row's
    response is drawn by uniforms[b, t], whichever turn it falls in; none: greedy."""
    tools, tokenizer, device, T = sampling.tools, sampling.tokenizer, prompt_ids.device, sampling.max_new_tokens
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
    limit = [min(T, sampling.max_total_length - len(p)) if sampling.max_total_length else T for p in prompts]
    tokens, logprobs, own, messages = ([[] for _ in prompts] for _ in range(4))  # each row's response so far
    counts = {k: torch.zeros(len(prompts)) for k in ("turns", "calls", "parsed", "failed", "timed_out", "unanswered")}
    finished = torch.zeros(len(prompts), dtype=torch.bool)
    stop_ids = set(sampling.stop_ids.tolist())
    active = list(range(len(prompts)))  # the rows whose conversation goes on
    for turn in range(1, sampling.max_turns + 1):
        # every process takes the same turns: under FSDP2 each generate gathers the weights, a collective
        if not runtime.global_mean(torch.tensor([float(len(active))], device=device)):
            break
        rows = active or [0]  # a process whose rows are all done samples one again, and keeps nothing of it
        ids, mask = runtime.left_pad([prompts[b] + tokens[b] for b in rows], sampling.pad_token_id, device)
        steps = max([limit[b] - len(tokens[b]) for b in active] or [1])
        draws = None  # (rows, steps): each row's draws from its response's next position on
        if uniforms is not None:
            at = torch.tensor([len(tokens[b]) for b in rows])[:, None] + torch.arange(steps)  # (rows, steps)
            draws = uniforms[rows].gather(1, at.clamp(max=T - 1).to(device))
        new, new_logprobs, new_mask = generate(policy, ids, mask, replace(sampling, max_new_tokens=steps), draws)
        going_on = []
        for row, b in enumerate(active):
            n = min(int(new_mask[row].sum()), limit[b] - len(tokens[b]))  # its turn, cut at its length limit
            turn_ids = new[row, :n].tolist()
            tokens[b] += turn_ids
            logprobs[b] += new_logprobs[row, :n].tolist()
            own[b] += [1] * n
            text = tokenizer.decode(turn_ids, skip_special_tokens=True)
            calls = runtime.parse_tool_calls(text, tokenizer)
            messages[b].append(runtime.assistant_message(text, calls))
            counts["turns"][b] += 1
            ended = n > 0 and turn_ids[-1] in stop_ids
            finished[b] = ended
            if not ended or not calls:  # cut by the length limit, or its answer
                continue
            if turn == sampling.max_turns:  # the last turn runs no tools: its calls stay unanswered
                counts["unanswered"][b] += len(calls)
                continue
            answers, called = runtime.run_tool_calls(tools, calls)
            for key, value in called.items():
                counts[key][b] += value
            counts["calls"][b] += len(calls)
            message = runtime.tool_message_ids(tokenizer, tools.schemas, answers, tokenizer.decode(turn_ids[-1]))
            if len(tokens[b]) + len(message) >= limit[b]:  # no room for the answer and a turn after it: cut
                finished[b] = False
                continue
            tokens[b] += message
            logprobs[b] += [0.0] * len(message)
            own[b] += [0] * len(message)
            messages[b] += answers
            going_on.append(b)
        active = going_on
    pad = [[sampling.pad_token_id] * (T - len(t)) for t in tokens]
    responses = torch.tensor([t + p for t, p in zip(tokens, pad)], device=device)  # (B, T)
    logprobs = torch.tensor([x + [0.0] * len(p) for x, p in zip(logprobs, pad)], device=device)  # (B, T)
    response_mask = torch.tensor([[1] * len(t) + [0] * len(p) for t, p in zip(tokens, pad)], device=device)
    policy_mask = torch.tensor([x + [0] * len(p) for x, p in zip(own, pad)], device=device)  # (B, T)
    counts = {key: count.to(device) for key, count in counts.items()}  # (B,) each, where the means are taken
    return responses, logprobs, response_mask, messages, Turns(policy_mask, finished.to(device), counts)


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
    runtime.require(args, ("kl_coef", "tool_timeout", "max_total_length"), "must be zero or more", lambda v: v >= 0)
    runtime.require(args, ("max_turns",), "must be at least 1 (the last turn runs no tools)", lambda v: v >= 1)
    if 0 < args.max_total_length <= args.run.max_prompt_length:
        raise SystemExit(
            f"--max_total_length {args.max_total_length} leaves no room for a response after a prompt of "
            f"--max_prompt_length {args.run.max_prompt_length}; raise it, or lower --max_prompt_length."
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
    ("tool", "tools/used", ".2f"),
    ("calls", "tools/calls_per_response", ".2f"),
    ("held-out", "eval/score", "+.3f"),
]


def main(args):
    # --- 0. set-up: one process per device under torchrun (a plain run needs none); the data checked first ---
    run = args.run  # the run's settings (rlhf_runtime.RunSettings): data, evaluation, checkpoints, precision, ...
    rank, device = runtime.start_processes(run)
    validate(args)  # every argument checked: nothing is created or started before
    runtime.lock_output_dir(args.output_dir)  # one run per folder
    reward_fns = runtime.load_reward_fns(args.reward_fn, run.reward_timeout)  # yours, each in a process of its own
    tools = runtime.load_tools(args.tools, args.tool_timeout)  # each in a process of its own, its schema read there
    runtime.find_checkpoint(args)  # --resume: which checkpoint to go on from
    torch.manual_seed(run.seed)  # the same on every process: new weights (a head, adapters) start the same
    tokenizer, prompts, rows, held_out, stop_ids = runtime.load_task(args, device, reward_fns, tools.schemas)
    decode_graphs = runtime.graphs_decode(run.decode, device)  # rlhf_kernels' CUDA graphs, on one GPU
    sampling = Conversing(args.response_length, args.temperature, stop_ids, tokenizer.pad_token_id, decode_graphs)
    limits = dict(max_turns=args.max_turns, max_total_length=args.max_total_length)
    sampling = replace(sampling, tools=tools, tokenizer=tokenizer, **limits)  # what converse adds to generate's
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
    tools.stops = stops  # a stop signal ends a tool's call at once
    if held_out[0] and not run.resume:  # the starting policy's score: the curves' first point
        log.evaluation(runtime.evaluate(converse, policy, scorer, sampling, held_out, args, stops), state)
        runtime.stop_if_asked(stops, state, models, optimizers, args)

    for iteration in range(state["iteration"] + 1, run.num_iterations + 1):
        clock = runtime.Stopwatch()
        rng = torch.Generator().manual_seed(run.seed * 1_000_000 + iteration)  # the same on every process
        # --- 1. prompts: the same shuffled order on every process, each taking its own slice ---
        # width: the longest prompt of every process's
        idx, width, data_position = runtime.next_prompts(
            prompts, state["data_position"], args.rollout_batch_size, run.seed, run.world_size, rank
        )
        idx = [i for i in idx for _ in range(G)]  # each prompt G times in a row: a group stays on one process
        prompt_ids, prompt_mask = runtime.left_pad([prompts[i] for i in idx], tokenizer.pad_token_id, device, width)
        P = prompt_ids.shape[1]  # (B, P), B = local prompts x G

        # --- 2. converse with the tools, recording logprobs_old as the policy samples; 3. score the conversations ---
        # (B, response_length): this process's rows of the draws made for every process
        uniforms = runtime.row_uniforms(rng, len(idx), args.response_length, run.world_size, rank).to(device)
        responses, logprobs_old, response_mask, messages, turns = converse(
            policy, prompt_ids, prompt_mask, sampling, uniforms
        )  # (B, T) each over the policy's turns and the tools' messages; the messages for TRL's form of reward
        input_ids = torch.cat([prompt_ids, responses], 1)  # (B, P + T)
        attention_mask = torch.cat([prompt_mask, response_mask], 1)  # (B, P + T)
        clock.lap("generate")
        scorer.completions = messages  # for TRL's form of reward: each conversation as messages
        scores = runtime.score_responses(scorer, input_ids, attention_mask, P, [rows[i] for i in idx], args, stops)
        has_eos = turns.finished  # (B,) its last turn ended by EOS or the end of turn
        # (B, T) what the loss, the KL term and the entropy read: the policy's own tokens, never a tool's
        train_mask = turns.policy_mask * (has_eos | (not args.mask_truncated))[:, None]
        runtime.stop_if_asked(stops, state, models, optimizers, args)  # a failed reward, a signal: before step 1

        with torch.no_grad():
            score = torch.where(has_eos | args.mask_truncated, scores.raw, scores.raw - args.missing_eos_penalty)

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
            policy_mask=turns.policy_mask,
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
                            kl = (micro["logprobs_old"] - logprobs_ref) * micro["policy_mask"]
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
        state["iteration"] = iteration
        state["episodes"] += responses_per_iteration
        state["data_position"] = data_position
        m = runtime.dashboard(stats, state, scores, rollout, clock, args.mask_truncated, run.world_size)
        m["memory/model_states_mb"] = runtime.megabytes_held(all_models, optimizers.values())  # rank 0's share
        m["objective/group_reward_std"] = runtime.global_mean(group_std)
        m["adv/zero_signal_fraction"] = runtime.global_mean(zero_signal)
        m["health/zero_signal"] = m["adv/zero_signal_fraction"]  # of the groups drawn: all of them here
        m["adv/abs_mean"] = runtime.global_mean(advantages.abs())
        calls = turns.counts["calls"]  # (B,) the calls run in each response; the shares below are of all calls
        m["tools/calls_per_response"] = runtime.global_mean(calls)
        for key in ("parsed", "failed", "timed_out"):
            m[f"tools/{key}"] = runtime.global_mean(turns.counts[key] / calls.clamp(min=1), calls)
        answered = turns.counts["parsed"] - turns.counts["failed"] - turns.counts["timed_out"]  # (B,) tools' answers
        m["tools/used"] = runtime.global_mean((answered > 0).float())  # the share of responses a tool answered
        m["tools/turns_per_response"] = runtime.global_mean(turns.counts["turns"])
        m["tools/unanswered_at_max_turns"] = runtime.global_mean((turns.counts["unanswered"] > 0).float())
        m["response/cut_by_length"] = runtime.global_mean((~has_eos).float())
        if ref_policy is not None:  # nats per response, as in ppo.py
            m["objective/kl"] = runtime.global_mean(seq_kl, kl_read)
            m["objective/kl_coef"] = args.kl_coef

        # --- 7. held-out score, alarms for the classic failure modes, the log; 8. a checkpoint ---
        if held_out[0] and (iteration % run.eval_every == 0 or iteration == run.num_iterations):
            m.update(runtime.evaluate(converse, policy, scorer, sampling, held_out, args, stops))
        log.iteration(m, state, prompt_ids, scores.texts, scores.raw)
        if (run.save_every and iteration % run.save_every == 0) or iteration == run.num_iterations:
            runtime.save_checkpoint(args, models, optimizers, state, rank)
        runtime.stop_if_asked(stops, state, models, optimizers, args)

    # --- last: the final policy where from_pretrained can load it (under FSDP2, gathered from the shards) ---
    runtime.finish(policy, tokenizer, log, state, args, rank)


if __name__ == "__main__":
    runtime.launch(main, Args)
