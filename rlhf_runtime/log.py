"""The log: the dashboard's metrics over every process, an iteration's phase times, the alarms for the classic
failure modes, and what rank 0 shows and keeps (args.json, metrics.jsonl, a line per iteration, sample rows, a
progress bar, wandb); at the end, the policy saved for from_pretrained. The guarantee: every metric is the whole
batch's, the log a checkpoint copies is the log so far, and a failed write is said in one sentence.
"""

import json
import os
import pathlib
import shutil
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from tqdm import tqdm

from rlhf_runtime.checkpoints import USUAL_CAUSES, take_lock, write_failure
from rlhf_runtime.loading import lora_policy_to_save
from rlhf_runtime.processes import global_mean
from rlhf_runtime.settings import flat_options

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


def dashboard(stats, state, scores, rollout, clock, mask_truncated, world_size):
    """The metrics every script logs, over all processes, from the stats, Scores, rollout and Stopwatch."""
    device = scores.raw.device
    sums = sorted(k for k in stats if k not in NOT_SUMS)
    totals = [stats[k] for k in sums] + [stats["tokens"], stats["steps"]]
    totals = torch.tensor(totals, device=device, dtype=torch.float64)
    ratio_max = torch.tensor(stats["ratio_max"], device=device)
    if world_size > 1:
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
    if mask_truncated:
        m["response/truncated_left_out"] = (1 - has_eos).mean().item()
    for phase, seconds in clock.seconds.items():
        m[f"time/{phase}"] = seconds
    m["time/iteration"] = time.time() - clock.start
    m["health/reward_errors"] = world_size * global_mean(failed)
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


def distinct_n(sequences, n):
    """Distinct-n: unique n-grams over all n-grams in a batch of token lists (1.0 = no repetition)."""
    ngrams = [tuple(s[i : i + n]) for s in sequences for i in range(len(s) - n + 1)]
    return len(set(ngrams)) / max(len(ngrams), 1)


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


def failure_alarms(m, state, alarm_kl, alarm_clipfrac, alarm_collapse):
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
        return m.get(metric) is not None and state[first] is not None and m[metric] < alarm_collapse * state[first]

    rising = "val/loss" in m and m["iteration"] > 10 and state["value_loss_ema"] > state["first_value_loss"]
    state["zero_signal_run"] = state.get("zero_signal_run", 0) + 1 if m["health/zero_signal"] >= 0.9 else 0
    return {
        "kl_explosion": m.get("objective/kl", 0.0) > alarm_kl,
        "clip_fraction": m.get("policy/clipfrac", 0.0) > alarm_clipfrac,
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


class Log:
    """What rank 0 shows and keeps: args.json, metrics.jsonl, a line per iteration, samples, a progress bar, wandb."""

    def __init__(self, args, state, rank, tokenizer, printed):
        self.args = args
        self.printed = printed  # the script's PRINTED: (label, metric key, format) of the line per iteration
        self.tokenizer = tokenizer
        self.on = rank == 0  # rank 0 alone prints and writes
        self.file = None
        self.wandb = None
        if self.on:
            os.makedirs(args.output_dir, exist_ok=True)
            self.lock, taken_over = take_lock(args.output_dir)  # before anything is written there
            if taken_over:
                print(taken_over)
            pathlib.Path(args.output_dir, "args.json").write_text(json.dumps(flat_options(args), indent=2))
            metrics = os.path.join(args.output_dir, "metrics.jsonl")
            if args.run.resume:  # the log cut back to the checkpoint's rows, then on from there
                shutil.copy(os.path.join(args.run.resume, "metrics.jsonl"), metrics)
                self.file = open(metrics, "a")
            else:
                self.file = open(metrics, "w")
            if args.run.track:  # offline where WANDB_MODE=offline; a resumed run goes on in its wandb run
                import wandb

                state["wandb_id"] = state.get("wandb_id") or os.urandom(8).hex()
                wandb.init(
                    project=args.run.wandb_project,
                    name=args.exp_name,
                    config=flat_options(args),
                    id=state["wandb_id"],
                    resume="allow",
                    dir=args.output_dir,
                    save_code=True,
                )
                self.wandb = wandb
        if state["iteration"] >= args.run.num_iterations and self.on:  # a resume with nothing left to train
            print(
                f"--total_episodes {args.total_episodes} ends at iteration {args.run.num_iterations}: no step is taken"
            )
        self.t_start = time.time() - state["elapsed"]
        self.progress = tqdm(
            total=args.run.num_iterations,
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
            raise SystemExit(write_failure(f"writing {self.file.name}", error, self.args.output_dir)) from None
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
        firing = failure_alarms(m, state, args.run.alarm_kl, args.run.alarm_clipfrac, args.run.alarm_collapse)
        m.update({f"alarm/{k}": float(v) for k, v in firing.items()})
        if self.on:
            shown = " ".join(f"{label} {m[key]:{fmt}}" for label, key, fmt in self.printed if key in m)
            shown += "".join(f" {key[7:]} {x:.2f}" for key, x in m.items() if key.startswith("reward/"))  # each rule's
            if m["health/reward_errors"]:
                shown += f" failed {m['health/reward_errors']:.0f}"
            tqdm.write(
                f"iter {iteration}/{args.run.num_iterations} ep {state['episodes']} | {shown} | "
                f"{m['time/iteration']:.1f}s gen {m['time/generate'] / m['time/iteration']:.0%}"
            )
            if not any(key.startswith("grad_norm/") for key in m):  # every minibatch skipped
                tqdm.write(f"iter {iteration}: no optimiser step: every response was left out of the loss")
            for name in [name for name, on in firing.items() if on and name not in state["alarms_on"]]:
                tqdm.write(f"ALARM {name}: {ALARMS[name]}")
            self.progress.set_postfix(
                {
                    label: f"{m[key]:{fmt}}"
                    for label, key, fmt in self.printed
                    if key in m and key.startswith("objective/")
                },
                refresh=False,
            )
            self.progress.update()
            self.write(m, step=state["episodes"])
            if iteration % args.run.log_samples_every == 0 or iteration == 1:
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
            if args.run.lora_r:
                lora_policy_to_save(weights, args.run).save_pretrained(args.output_dir)
            else:
                named = dict(policy.named_parameters()) | dict(policy.named_buffers())
                policy.save_pretrained(args.output_dir, state_dict={k: v for k, v in weights.items() if k in named})
            tokenizer.save_pretrained(args.output_dir)
            mode = os.stat(os.path.join(args.output_dir, "args.json")).st_mode  # the umask's; safetensors writes 0600
            for weights_file in pathlib.Path(args.output_dir).glob("*.safetensors"):
                weights_file.chmod(mode)
        except OSError as e:
            raise SystemExit(write_failure("saving the policy", f"{type(e).__name__}: {e}", args.output_dir)) from None
        print(f"saved the policy to {args.output_dir}")
        log.file.close()
        if log.wandb:
            log.wandb.finish()
    log.progress.close()
    if dist.is_initialized():
        dist.destroy_process_group()
