"""PPO for RLHF in one file: sample, score, take clipped policy-gradient steps on the same rollout.

The policy (a causal LM) samples responses to prompts; a reward model (or a rule) scores each whole
response; a per-token KL penalty against a frozen copy of the starting model turns that score into
per-token rewards; a learned critic and GAE turn rewards into advantages; and the clipped surrogate of
PPO (Schulman et al., 2017, arXiv:1707.06347) takes several minibatch steps on the rollout without
letting any token's probability move far from where it was sampled. The RLHF form is that of
Ziegler et al. (2019, arXiv:1909.08593) and Ouyang et al. (2022, arXiv:2203.02155).

Where this file departs from the papers, and why:
- The KL penalty is folded into the per-token reward (Ziegler et al.), not added to the loss, so the
  critic and the advantages see it token by token.
- The log-probs of the rollout policy (logprobs_old) are recorded while sampling, from the very logits
  that were sampled from. Recomputing them later in a second forward pass is the classic bug: after any
  update every ratio is 1 and clipping never engages.
- The critic is a separate model initialised from the (first) reward model, as in Ouyang et al.: it
  already reads text in terms of the score it must predict. With a rule reward it starts from the policy.
- Scores can be normalised by running moments and several reward models are combined by their minimum,
  the fixes for value divergence and reward exploitation; a response that never ends pays a penalty.
- Dropout stays off in every model (eval mode), so that the ratio on the first minibatch is exactly 1.

Commands: `python ppo.py` (the embedded default: tiny models, CPU, minutes); `python ppo.py --model_name_or_path
Qwen/Qwen2.5-0.5B-Instruct --reward_model_path <rm> --dataset <prompts.jsonl> --mixed_precision` (one GPU, hub
models); `torchrun --nproc_per_node=8 ppo.py --args ...` (one process per GPU, every model sharded with FSDP2).
"""

import importlib.util
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import tyro
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
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
    exp_name: str = "ppo"
    """name of the run (wandb run name)"""
    output_dir: str = "runs/ppo"
    """where metrics.jsonl, args.json and the final policy are written"""
    dataset: str = f"{runtime.ASSETS}/reviews/train.jsonl"
    """training prompts: a local .jsonl, .json, .csv, .tsv or .parquet file (.gz/.bz2/.xz too), or a hub dataset"""
    reward_model_path: tuple[str, ...] = (f"{runtime.ASSETS}/tiny-rm",)
    """reward models (sequence classifiers, one label); with several, the score is their minimum"""
    reward_fn: tuple[str, ...] = ()
    """rules, weighted, added to reward models' minimum: arithmetic, gsm8k, f.py:fn (TRL's, verl's, OpenRLHF's too)"""

    # PPO: batches, the critic, GAE, the KL penalty in the reward
    total_episodes: int = 9600
    """responses sampled over the whole run"""
    rollout_batch_size: int = 64
    """prompts (= responses) per iteration, over all processes"""
    minibatch_size: int = 16
    """responses per optimiser step, over all processes"""
    micro_batch_size: int = 16
    """responses per forward/backward in one process (gradient accumulation makes up the minibatch; a value at least
    the per-process minibatch is one micro-batch, so the defaults hold under torchrun)"""
    num_epochs: int = 4
    """passes over each rollout (typically 1 to 4; more and the data goes stale)"""
    learning_rate: float = 1e-4
    """policy learning rate (hub-sized models want 1e-6 to 5e-6)"""
    clip_range: float = 0.2
    """epsilon of the clipped surrogate: ratios are held inside [1-eps, 1+eps]"""
    value_model_path: str | None = None
    """where the critic is initialised from; default: the first reward model, else the policy"""
    shared_backbone: bool = False
    """the critic as a scalar head on the policy's own trunk: one model fewer, one trunk pass for both in training"""
    value_learning_rate: float = 1e-4
    """critic learning rate"""
    value_clip_range: float = 0.2
    """values may move at most this far from the rollout's values in one rollout"""
    vf_coef: float = 0.1
    """weight of the value loss (c1)"""
    gamma: float = 1.0
    """discount; 1.0 because every token serves the one final score"""
    lam: float = 0.95
    """GAE lambda"""
    kl_coef: float = 0.1
    """beta: the per-token KL penalty coefficient (the starting value when adaptive)"""
    adaptive_kl: bool = True
    """adapt beta towards kl_target (Ziegler et al. 2019); off keeps beta fixed"""
    kl_target: float = 3.0
    """target KL to the reference, summed over a response, in nats"""
    kl_horizon: int = 2000
    """episodes over which the adaptive controller may move beta by its full step"""
    normalize_reward: bool = True
    """normalise scores by the running mean and std of all scores seen so far"""

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


def masked_whiten(x, mask, eps=1e-8):
    """(x - mean) / std over the valid tokens of this batch; padding stays 0. x and mask (B, T); returns (B, T).
    Per batch, never over the whole run: a batch of easy prompts must not produce inflated advantages."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def per_token_rewards(scores, logprobs_old, logprobs_ref, response_mask, kl_coef):
    """The KL-shaped reward of Ziegler et al. (2019): r_t = -beta * (log pi_old - log pi_ref) on every token, plus
    the score on the last token. scores (B,), logprobs_* and response_mask (B, T) with mask a prefix of ones;
    returns rewards (B, T) and the per-token KL estimate (B, T)."""
    kl = (logprobs_old - logprobs_ref) * response_mask  # (B, T)
    rewards = -kl_coef * kl
    last = response_mask.sum(1).long() - 1  # (B,) index of the final (EOS or cut-off) token
    rewards[torch.arange(len(scores)), last] += scores
    return rewards, kl


def gae_advantages(rewards, values, response_mask, gamma, lam):
    """Generalised advantage estimation over response tokens (Schulman et al. 2016):
    delta_t = r_t + gamma V(s_{t+1}) - V(s_t),   A_t = sum_k (gamma lam)^k delta_{t+k},
    with V = 0 after the last token. rewards, values, response_mask (B, T); returns the advantages (B, T) and
    returns = A + V (B, T), the critic's regression target."""
    rewards = rewards * response_mask  # (B, T); zero past the end
    values = values * response_mask  # (B, T)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)  # V(s_{t+1}); 0 after the last token
    deltas = rewards + gamma * next_values - values  # (B, T)
    advantages = torch.zeros_like(rewards)
    last_gae = 0.0
    for t in reversed(range(rewards.shape[1])):
        last_gae = deltas[:, t] + gamma * lam * last_gae  # 0 past the end, as every delta is
        advantages[:, t] = last_gae
    return advantages, advantages + values


def value_loss(values, values_old, returns, clip_range):
    """Per-token value loss with the prediction clipped around the rollout's value (the usual fix for
    value divergence): max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2). Inputs (B, T); returns the
    loss (B, T) and whether the clipped term was the larger (B, T)."""
    values_clipped = torch.clamp(values, values_old - clip_range, values_old + clip_range)  # V where the clip is idle
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (values_clipped - returns) ** 2
    return torch.max(loss_unclipped, loss_clipped), (loss_clipped > loss_unclipped).float()


def adaptive_kl_coef(kl_coef, kl, kl_target, horizon, n_episodes):
    """Ziegler et al. (2019) proportional controller: e = clip(KL / target - 1, -0.2, 0.2), beta <- beta (1 + e n /
    horizon). KL above target raises beta, below lowers it; a non-finite KL (a broken policy's) leaves it. Floats."""
    if not math.isfinite(kl):
        return kl_coef
    error = min(max(kl / kl_target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_episodes / horizon)


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


class ValueHead(torch.nn.Module):
    """--shared_backbone: the critic as a head `score` on the policy's trunk, a model fewer (the risk: the value loss
    reaches the trunk the policy samples from). Trained on the log-prob forward's trunk output (hooked at the head)."""

    _no_split_modules = []  # FSDP2: the head is one unit of its own (the policy's blocks are the policy's)

    def __init__(self, policy):
        super().__init__()
        self.__dict__["policy"] = policy  # not registered: the trunk's weights belong to the policy and its optimiser
        self.score = torch.nn.Linear(policy.config.hidden_size, 1, bias=False, device=policy.device)
        torch.nn.init.zeros_(self.score.weight)  # V = 0 everywhere at the start
        policy.get_output_embeddings().register_forward_hook(self.keep_trunk_output)

    def keep_trunk_output(self, head, inputs, output):
        """A hook on the policy's LM head: the trunk's output it reads, (B, L, H), for the value head to read too."""
        self.trunk_output = inputs[0]

    def forward(self, hidden=None, **inputs):
        """V at every position (B, L, 1), from the trunk's output of a forward already run, or of its own."""
        if hidden is None:
            hidden = self.policy(**inputs, output_hidden_states=True, logits_to_keep=1).hidden_states[-1]  # (B, L, H)
        return self.score(hidden.to(self.score.weight.dtype))


def build_models(args, tokenizer, device):
    """The policy, its frozen reference, the reward models and the critic, all in eval mode (no dropout)."""
    policy = runtime.load_model(AutoModelForCausalLM, args.run.model_name_or_path, args.run, device, trained=True)
    ref_policy = runtime.load_reference(args.run, policy, device)
    reward_models = runtime.load_reward_models(args.reward_model_path, tokenizer, args.run, device)
    if args.shared_backbone:
        value_model = ValueHead(policy)
        runtime.shard(value_model, args.run.mixed_precision)  # under torchrun
        return policy, ref_policy, reward_models, value_model
    value_path = args.value_model_path  # by default the first reward model (Ouyang et al.), else the policy
    if value_path is None:
        value_path = args.reward_model_path[0] if args.reward_model_path else args.run.model_name_or_path
    if any(own is not None and path == value_path for (_, own), path in zip(reward_models, args.reward_model_path)):
        raise SystemExit(
            f"the critic would start from the reward model '{value_path}', whose tokenizer differs from the "
            "policy's; pass --value_model_path with a model of the policy's tokenizer."
        )
    value_model = runtime.load_model(
        AutoModelForSequenceClassification, value_path, args.run, device, trained=True, num_labels=1
    )
    value_model.config.pad_token_id = tokenizer.pad_token_id
    return policy, ref_policy, reward_models, value_model


def validate(args):
    """Everything that can be checked before a model loads: one sentence for each mistake, naming the fix."""
    positive = ("learning_rate", "clip_range", "value_learning_rate", "value_clip_range", "kl_target", "kl_horizon")
    runtime.require(args, positive, "must be positive", lambda v: v > 0)
    runtime.require(args, ("kl_coef", "vf_coef"), "must be zero or more", lambda v: v >= 0)
    runtime.require(args, ("gamma", "lam"), "must lie in [0, 1]", lambda v: 0 <= v <= 1)
    runtime.check_common_args(args, responses_per_iteration=args.rollout_batch_size)  # the policy and the reward models
    if args.value_model_path is not None:  # by default the first reward model or the policy, both checked
        runtime.check_model_path(args.value_model_path, "model", "--value_model_path")


# What the one line per iteration shows: (label, metric key, format); keys a run does not log are left out.
PRINTED = [
    ("score", "objective/score", "+.3f"),
    ("rule", "objective/rule_reward", ".3f"),
    ("kl", "objective/kl", ".2f"),
    ("beta", "objective/kl_coef", ".3f"),
    ("len", "response/length", ".1f"),
    ("eos", "response/eos_rate", ".2f"),
    ("d2", "response/distinct2", ".2f"),
    ("ent", "policy/entropy", ".2f"),
    ("clip", "policy/clipfrac", ".3f"),
    ("vloss", "val/loss", ".3f"),
    ("ev", "val/explained_variance", ".2f"),
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
    responses_per_iteration = args.rollout_batch_size
    run.num_iterations = args.total_episodes // responses_per_iteration
    policy, ref_policy, reward_models, value_model = build_models(args, tokenizer, device)
    models = {"policy": policy, "value": value_model}
    adamw = dict(eps=1e-5, weight_decay=0.0, fused=True)  # no weight decay (TRL, OpenRLHF): no signal, no change
    optimizers = {
        "policy": torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, **adamw),
        "value": torch.optim.AdamW(value_model.parameters(), lr=args.value_learning_rate, **adamw),
    }
    all_models = [policy, ref_policy, *[rm for rm, _ in reward_models], value_model]
    if run.resume:  # the state: everything besides the models and optimisers that a resumed run needs
        state = runtime.load_checkpoint(args, models, optimizers)
    else:
        state = runtime.new_state(kl_coef=args.kl_coef, score_moments=(0.0, 1.0, 0.0))
    scorer = runtime.Scorer(reward_models, reward_fns, tokenizer, state, combine_scores)  # state: for TRL's functions
    log = runtime.Log(args, state, rank, tokenizer, PRINTED)
    stops = runtime.catch_stop_signals()  # the reasons to stop that come up: a signal, a failed reward
    if held_out[0] and not run.resume:  # the starting policy's score: the curves' first point
        log.evaluation(runtime.evaluate(generate, policy, scorer, sampling, held_out, args, stops), state)
        runtime.stop_if_asked(stops, state, models, optimizers, args)

    for iteration in range(state["iteration"] + 1, run.num_iterations + 1):
        clock = runtime.Stopwatch()
        rng = torch.Generator().manual_seed(run.seed * 1_000_000 + iteration)  # the same on every process
        # --- 1. prompts: the same shuffled order on every process, each taking its own slice ---
        # width: the longest prompt of every process's
        idx, width, data_position = runtime.next_prompts(
            prompts, state["data_position"], args.rollout_batch_size, run.seed, run.world_size, rank
        )
        # (B, P), left-padded to the longest prompt of every process's
        prompt_ids, prompt_mask = runtime.left_pad([prompts[i] for i in idx], tokenizer.pad_token_id, device, width)
        P = prompt_ids.shape[1]

        # --- 2. generate with the current policy, recording logprobs_old as we sample; 3. score the full responses ---
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

        with torch.no_grad():
            score = scores.raw  # (B,)
            if args.normalize_reward:  # by the running mean and std of every process's scores so far
                every_score = runtime.gather_rows({"score": score})["score"]  # (N,)
                score, state["score_moments"] = normalize_scores(score, every_score, state["score_moments"])
            score = torch.where(has_eos | args.mask_truncated, score, score - args.missing_eos_penalty)

            # --- 4. reference log-probs, values, per-token rewards, GAE ---
            logprobs_ref = (
                runtime.in_chunks(
                    lambda i, m, p: response_logprobs(ref_policy, i, m, p, args.temperature),
                    args.micro_batch_size,
                    input_ids,
                    attention_mask,
                    P,
                )
                * response_mask
            )  # (B, T)
            values_old = (
                runtime.in_chunks(
                    lambda i, m, p: runtime.head_outputs(value_model, i, m)[:, p - 1 : -1],  # V(s_t) before t
                    args.micro_batch_size,
                    input_ids,
                    attention_mask,
                    P,
                )
                * response_mask
            )  # (B, T)
            rewards, kl = per_token_rewards(score, logprobs_old, logprobs_ref, response_mask, state["kl_coef"])
            raw_advantages, returns = gae_advantages(rewards, values_old, response_mask, args.gamma, args.lam)
        clock.lap("score")

        # --- 5. optimise: epochs of shuffled global minibatches, each process taking its share, in micro-batches ---
        rollout = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            has_eos=has_eos.float(),
            train_mask=train_mask,
            logprobs_old=logprobs_old,
            raw_advantages=raw_advantages,
            values_old=values_old,
            returns=returns,
        )
        rollout = runtime.gather_rows(rollout)
        # whitened over the whole rollout, every process's: (N, T)
        rollout["advantages"] = masked_whiten(rollout["raw_advantages"], rollout["response_mask"])
        stats = defaultdict(float)  # sums over tokens of what the dashboard shows
        runtime.adapter_dropout(models.values(), on=True)  # --lora_dropout, in the training forward only
        for _epoch in range(args.num_epochs):
            perm = torch.randperm(responses_per_iteration, generator=rng).to(device)
            for mb_start in range(0, responses_per_iteration, args.minibatch_size):
                mb_idx = perm[mb_start : mb_start + args.minibatch_size]
                mb_mask = rollout["train_mask"][mb_idx]
                mb_tokens = mb_mask.sum().item()  # valid tokens in the global minibatch
                mine = mb_idx.chunk(run.world_size)[rank]  # this process's share
                if mb_tokens == 0:  # every response left out: no step, not even Adam's momentum
                    continue
                for micro_idx in runtime.by_length(mine, rollout["attention_mask"]).split(args.micro_batch_size):
                    micro, p = runtime.cut_padding({k: v[micro_idx] for k, v in rollout.items()}, P)  # (micro, p + T')
                    mask = micro["train_mask"].float()  # (micro, T')
                    logprobs, entropy = response_logprobs(
                        policy, micro["input_ids"], micro["attention_mask"], p, args.temperature, return_entropy=True
                    )  # (micro, T') each
                    if args.shared_backbone:  # the trunk's output of the forward just above: no second pass
                        values = value_model(hidden=value_model.trunk_output).squeeze(-1).float()[:, :-1]
                    else:
                        values = runtime.head_outputs(value_model, micro["input_ids"], micro["attention_mask"])
                        values = values[:, p - 1 : -1]  # V(s_t) before each response token t
                    pg_loss, ratio, pg_clipped = clip_loss(
                        logprobs, micro["logprobs_old"], micro["advantages"], args.clip_range, args.clip_range
                    )
                    pg_loss, dual_clipped = dual_clip_loss(pg_loss, micro["advantages"], args.dual_clip)
                    vf_loss, vf_clipped = value_loss(
                        values, micro["values_old"], micro["returns"], args.value_clip_range
                    )
                    loss = ((pg_loss + args.vf_coef * vf_loss - args.ent_coef * entropy) * mask).sum() / mb_tokens
                    loss.backward()  # under FSDP2, also sums the gradients over the processes
                    terms = {
                        "policy/loss": pg_loss,
                        "val/loss": vf_loss,
                        "policy/entropy": entropy,
                        "policy/clipfrac": pg_clipped,
                        "val/clipfrac": vf_clipped,
                    }
                    if args.dual_clip:
                        terms["policy/dual_clipfrac"] = dual_clipped
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
        seq_kl = kl.sum(1)  # (B,) KL of each response to the reference, in nats
        valid = rollout["response_mask"]  # (N, T) every process's
        var_residual = masked_var(rollout["returns"] - rollout["values_old"], valid).item()
        var_returns = masked_var(rollout["returns"], valid).item()
        m.update(
            {
                "objective/score_normalized": runtime.global_mean(score),
                "objective/kl": runtime.global_mean(seq_kl),
                "objective/kl_coef": state["kl_coef"],
                "objective/non_score_reward": runtime.global_mean(-state["kl_coef"] * seq_kl),
                "objective/rlhf_reward": runtime.global_mean(scores.raw - state["kl_coef"] * seq_kl),
                "val/explained_variance": 1 - var_residual / max(var_returns, 1e-8),
                "val/mean": masked_mean(rollout["values_old"], valid).item(),
                "adv/mean": masked_mean(rollout["raw_advantages"], valid).item(),
                "adv/std": masked_var(rollout["raw_advantages"], valid).item() ** 0.5,
                "health/zero_signal": float((runtime.gather_rows({"s": scores.raw})["s"] == scores.raw[0]).all()),
            }
        )

        # --- 7. the adaptive KL controller steps on the measured KL of this rollout ---
        if args.adaptive_kl:
            state["kl_coef"] = adaptive_kl_coef(
                state["kl_coef"], m["objective/kl"], args.kl_target, args.kl_horizon, args.rollout_batch_size
            )

        # --- 8. held-out score, alarms for the classic failure modes, the log; 9. a checkpoint ---
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
