"""Rewards: each response scored by the reward models (read at its last token) and your rules, their combination
(the script's), a failed reward named with its response and prompt or replaced, the built-in rules, the checks of
your functions against the data, and the held-out evaluation. The guarantee: a reward that raises, hangs or is not a
finite number stops the run in one sentence (or is penalised, as asked), and a rule's None means "does not apply".
"""

import functools
import math
import os
import re
import warnings
from dataclasses import dataclass

import torch

from rlhf_runtime.batches import head_outputs, in_chunks, join_rounds, left_pad
from rlhf_runtime.processes import all_processes, global_mean
from rlhf_runtime.reward_process import RewardProcess, reward_reply


@dataclass
class Scorer:
    """What scores a response: the reward models, each with its own tokenizer (None where it reads the policy's
    tokens), the rules as (--reward_fn, its function or process), the policy's tokenizer that decodes them, and the
    run's state (TRL's functions read its iteration)."""

    reward_models: list
    reward_fns: list
    tokenizer: object
    state: dict
    combine: object  # the script's combine_scores: the reward models' scores and the rules' sum into one (B,)
    completions: list = None  # each response of the next batch as messages, where it is a conversation with tools


@dataclass
class Scores:
    """What score_responses returns for a batch of B responses."""

    raw: torch.Tensor  # (B,) the reward models' minimum plus the rules' weighted sum, failed rewards replaced
    metrics: dict  # {metric key: (B,)} the rules' weighted sum, each rule's scores when there are several, their logs
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
            prompts = [row[args.run.prompt_field] for row in rows]
            ids, mask = reward_model_inputs(own_tokenizer, prompts, texts, input_ids.device)
            last_column = in_chunks(
                lambda i, m, p, rm=reward_model: head_outputs(rm, i, m)[:, -1:], size, ids, mask, ids.shape[1] - 1
            )  # (B, 1)
            rm_scores.append(last_column[:, 0])
    rules = {}  # {name: (B,) its scores, nan where it failed}
    scored = {}  # {name: (B,) False where it returned None}
    failures = []  # ((B,) scores, why) of each rule, why None where nothing failed
    logged = {}  # {metric key: (B,)} what a rule asks to log (OpenRLHF's extra_logs), as OpenRLHF logs it
    real = [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask)]  # each prompt and response, unpadded
    lengths = attention_mask[:, P:].sum(1).tolist()  # (B,) each response's tokens
    batch = dict(  # what a reward function may read, B of each: reward_reply passes what its form takes
        responses=texts,
        answers=[answer_of(row, args.run.answer_field) for row in rows],
        prompts=[row.get(args.run.prompt_field) for row in rows],  # as the data holds them: text or messages
        prompt_texts=scorer.tokenizer.batch_decode([x[: len(x) - n] for x, n in zip(real, lengths)]),
        queries=scorer.tokenizer.batch_decode(real),  # the prompt and response as the policy saw them
        completion_ids=[x[len(x) - n :].tolist() for x, n in zip(real, lengths)],
        columns=[{k: v for k, v in row.items() if k != args.run.prompt_field} for row in rows],
        completion_messages=scorer.completions,  # grpo_tools.py's conversations; None: one assistant's turn each
        step=scorer.state["iteration"],
        max_steps=args.run.num_iterations,
    )
    for spec, fn in scorer.reward_fns:
        name = spec.rpartition(":")[2]
        logs = {}
        got, why = call_reward_fn(fn, batch, args.run.reward_timeout, stops, logs)
        for key, values in logs.items():  # nan where it gave none: the dashboard's mean leaves it out
            logged[f"reward/{name}/{key}"] = torch.tensor(values, device=input_ids.device)
        scored[name] = torch.tensor([x is not None for x in got], device=input_ids.device)
        rules[name] = torch.tensor([float("nan") if x is None else x for x in got], device=input_ids.device)
        if why is not None and len(scorer.reward_fns) > 1:  # which rule failed
            why = f"{why} (--reward_fn {spec})"
        failures.append((torch.where(scored[name], rules[name], 0.0), why))
    rule_reward = None  # (B,) the rules' weighted sum over those that scored each response, as TRL's
    if rules:
        weights = args.run.reward_weights or [1.0] * len(rules)
        terms = [torch.where(scored[name], w * x, 0.0) for w, (name, x) in zip(weights, rules.items())]
        rule_reward = functools.reduce(torch.add, terms)
        unscored = ~functools.reduce(torch.logical_or, scored.values())  # (B,) no rule scored it: it counts 0
        if unscored.any():
            message = "a response that no --reward_fn scored (each returned None) counts 0, as in TRL"
            warnings.warn(f"{message}; health/unscored_rewards logs their share.", stacklevel=2)
    score = scorer.combine(rm_scores, rule_reward)
    score, failed = replace_failed_scores(score, failures, texts, scorer.tokenizer, input_ids[:, :P], args, stops)
    metrics = {}
    if rules:
        metrics["objective/rule_reward"] = rule_reward.nan_to_num(0.0)
        metrics["health/unscored_rewards"] = unscored.float()  # its mean: the share of responses no rule scored
    if len(rules) > 1:  # nan where a rule returned None: each mean is over the responses it scored
        for name, x in rules.items():
            metrics[f"reward/{name}"] = torch.where(scored[name], x.nan_to_num(0.0), float("nan"))
    return Scores(score, {**metrics, **logged}, texts, failed)


def keep_rows(rounds, order, metrics, failed, tokenizer, world_size, rank):
    """Rounds of rows (each every process's) joined, the rows order names kept, this process's slice of them with its
    input_ids and attention_mask (B, P + T) rebuilt, and their Scores (metrics: the keys; failed: this process's)."""
    drawn = join_rounds(rounds, tokenizer.pad_token_id)
    kept = {key: x[order.chunk(world_size)[rank]] for key, x in drawn.items()}  # (B, ...) each
    responses = torch.where(kept["response_mask"].bool(), kept["response_ids"], tokenizer.pad_token_id)
    kept["input_ids"] = torch.cat([kept["prompt_ids"], responses], 1)  # (B, P + T)
    kept["attention_mask"] = torch.cat([kept["prompt_mask"], kept["response_mask"]], 1)  # (B, P + T)
    kept["has_eos"] = kept["has_eos"].bool()
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    return kept, Scores(kept["raw"], {key: kept[key] for key in metrics}, texts, failed)


def replace_failed_scores(score, failures, texts, tokenizer, prompt_ids, args, stops):
    """Scores (B,) that are not finite: a reason to stop (in stops; none given: raised), or with --on_reward_error
    penalty put below the batch's lowest. failures: score_responses'. Returns (B,) and how many failed."""
    bad = ~torch.isfinite(score)
    if not bad.any() or any(isinstance(r, int) for r in stops or ()):  # after a stop signal the batch goes unused
        return score, 0
    if args.run.on_reward_error == "penalty" and not bad.all():
        return torch.where(bad, score[~bad].min() - args.missing_eos_penalty, score), int(bad.sum())
    i = bad.nonzero()[0, 0].item()
    why = "not a finite number"  # a reward model's score, or the rules' sum past float32's range
    for scores, reason in failures:  # the first rule that failed on response i
        if not scores[i].isfinite():
            why = reason
            break
    which = f"the response {texts[i]!r} to the prompt {tokenizer.decode(prompt_ids[i], skip_special_tokens=True)!r}"
    if args.run.on_reward_error == "stop":
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


def load_reward_fns(specs, timeout):
    """Each --reward_fn as (spec, its function or RewardProcess, started with the function loaded)."""
    return [(spec, load_reward_fn(spec, timeout)) for spec in specs]


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


def reward_call(reward_fn, batch, timeout, stops):
    """reward_reply's answer: a built-in rule's from here, yours from its RewardProcess."""
    if isinstance(reward_fn, RewardProcess):
        return reward_fn.call(batch, timeout, stops)
    return reward_reply(reward_fn, "this project's", batch)


def call_reward_fn(reward_fn, batch, timeout, stops=None, logs=None):
    """A rule's scores on batch (score_responses'), None where it does not apply, nan where it gave none, and why it
    failed (None when nothing did); logs (a dict) gets what it asks to log, {key: a value each, nan where none}. When
    the batch's call raises, each response is scored alone until a timeout or a stop, so that the error is pinned."""
    n = len(batch["responses"])
    if logs is None:
        logs = {}
    kind, got = reward_call(reward_fn, batch, timeout, stops)
    if kind == "scores":
        got, extra_logs = got
        logs.update(extra_logs)
    if kind != "raised":
        return checked_scores(kind, got, n, "the batch's call")
    scores = [float("nan")] * n
    first = None  # why the first response that failed alone did
    for i in range(n):
        alone = {key: x[i : i + 1] if isinstance(x, list) else x for key, x in batch.items()}
        kind, got_alone = reward_call(reward_fn, alone, timeout, stops)
        if kind == "scores":
            got_alone, extra_logs = got_alone
            for key, values in extra_logs.items():
                logs.setdefault(key, [float("nan")] * n)[i] = values[0]
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
        return failed, f"nan: {call} returned {got} for {n} responses"
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
    """A row's --answer_field: the column of that name, else a dotted path into nested ones (verl's
    reward_model.ground_truth, which a csv or datasets' flatten() of its data names a column)."""
    if field in row:
        return row[field]
    for key in field.split("."):
        row = row.get(key) if isinstance(row, dict) else None
    return row


def check_reward_columns(reward_fns, rows, path, prompt_field, answer_field):
    """Your functions against the data's columns (load_prompts gives every row each), before any model loads: a TRL
    function's keywords and columns, and a warning where yours takes answers and no row has one."""
    columns = [key for key in rows[0] if key != prompt_field]
    for spec, fn in reward_fns:
        if not isinstance(fn, RewardProcess):  # a built-in: load_prompts checks each row's answer
            continue
        if fn.form == "TRL's":
            keywords = ["prompts", "completions", "completion_ids", "trainer_state"]
            clash = [c for c in columns if c in keywords]
            if clash:
                raise SystemExit(
                    f"'{path}' has a column '{clash[0]}', but --reward_fn {spec} is in TRL's form, which passes "
                    f"{', '.join(keywords)} itself; rename the column."
                )
            missing = [a for a in fn.required if a not in columns + keywords]
            if missing:
                raise SystemExit(
                    f"--reward_fn {spec} (TRL's form) takes '{missing[0]}', but '{path}' has no column of that name "
                    f"(its columns besides the prompts: {', '.join(columns) or 'none'}); pass data with that "
                    "column, or give the argument a default."
                )
        elif all(answer_of(row, answer_field) is None for row in rows):
            warnings.warn(
                f"--reward_fn {spec} takes answers, but '{path}' has no '{answer_field}' (its columns: "
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
def evaluate(generate, policy, scorer, sampling, held_out, args, stops):
    """Mean raw score on the held-out set, sampled with the script's generate (fixed draws per prompt) and greedy; {}
    when a reward failed."""
    prompts, rows = held_out
    rank = int(os.environ.get("RANK", 0))
    device = sampling.stop_ids.device
    uniforms = torch.rand(len(prompts), args.response_length, generator=torch.Generator().manual_seed(args.run.seed))
    # a contiguous share each, the last topped up with uncounted copies of the last prompt: the same batches (FSDP)
    share = -(-len(prompts) // args.run.world_size)
    mine = range(rank * share, (rank + 1) * share)
    counted = torch.tensor([i < len(prompts) for i in mine], device=device).float()
    result = {}
    for name, greedy in (("eval/score", False), ("eval/score_greedy", True)):
        scores = []
        for start in range(0, share, args.run.eval_batch_size):
            idx = [min(i, len(prompts) - 1) for i in mine[start : start + args.run.eval_batch_size]]
            prompt_ids, prompt_mask = left_pad([prompts[i] for i in idx], sampling.pad_token_id, device)
            draws = None if greedy else uniforms[idx].to(device)
            # a fourth output, where generate gives one: each response as messages (grpo_tools.py's tool turns)
            responses, _, response_mask, *completions = generate(policy, prompt_ids, prompt_mask, sampling, draws)
            input_ids = torch.cat([prompt_ids, responses], 1)
            attention_mask = torch.cat([prompt_mask, response_mask], 1)
            P = prompt_ids.shape[1]
            batch_rows = [rows[i] for i in idx]
            scorer.completions = completions[0] if completions else None
            scores.append(score_responses(scorer, input_ids, attention_mask, P, batch_rows, args, stops).raw)
        result[name] = global_mean(torch.cat(scores), counted)
    failed = any(isinstance(r, str) for r in stops)  # a failed reward (a stop's unanswered call is nan too)
    if failed or not all(map(math.isfinite, result.values())):
        return {}
    return result
