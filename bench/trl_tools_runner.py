"""The TRL side of bench/bench_trl_tools.py: TRL 1.16's GRPOTrainer with tools, configured like grpo_tools.py, run in
the peer virtual environment that has trl (see bench/bench_trl.py for how to make it).

It takes grpo_tools.py's flags that the benchmark sets, with their meanings there, maps them onto GRPOConfig (through
bench/trl_runner.py's `trl_config`, plus what tools add in `tools_config`), trains, and writes to
<output_dir>/metrics.jsonl one row per iteration (one rollout and its updates): the wall time from the end of the
previous iteration to the end of this one (`time/iteration`), the optimiser steps it took, and TRL's own tool metric
(`tools/calls_per_response`, TRL's tools/call_frequency); and to <output_dir>/eval.json the held-out score before and
after training (`eval/score`, TRL's evaluation: each held-out prompt answered once at the training temperature).

Two things TRL needs that grpo_tools.py does not:
- prompts as conversations: TRL runs tools only for a conversational dataset, so each row's text becomes a user's
  message (grpo_tools.py renders a text prompt as a user's turn too);
- a response template on the tokenizer (`response_template`), with which transformers' parse_response reads the
  policy's tool calls. TRL's add_response_schema knows only the templates of the models it lists (Qwen, Llama 3.1,
  GLM, ...) and refuses any other with "Unrecognized chat template"; TRL's docs say to set one on the tokenizer then.

    python bench/trl_tools_runner.py --output_dir runs/bench_trl_tools/x ...   # normally run by bench_trl_tools.py
"""

import argparse
import importlib.util
import json
import os
import sys
import time

from trl_runner import trl_config  # the mapping of grpo.py's flags onto GRPOConfig, importable without trl


def response_template(eos_token):
    """Hermes' calls, <tool_call>{"name": ..., "arguments": {...}}</tool_call>, in transformers' response-template
    format (transformers >= 5.13, docs "Response parsing"): the fields of TRL's Qwen3 template, with two changes for a
    chat template that writes no assistant header and ends a turn with EOS. The policy's turn starts where the prompt
    (or the tool's response) ends, so the anchor is the end of that text; the turn's text closes at eos_token."""
    return {
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": r"\Z",
        "fields": {
            "tool_calls": {
                "open": "<tool_call>",
                "close_pattern": r"</tool_call>\s*",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {"close": eos_token, "content": "text"},
        },
    }


def arguments(argv=None):
    """grpo_tools.py's flags that the benchmark sets, with their meanings there."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--eval_dataset", required=True, help="held-out prompts, scored once after training")
    p.add_argument("--reward_fn", required=True, help="f.py:fn, called as fn(responses, answers)")
    p.add_argument("--tools", required=True, help="f.py:fn, a typed function with a docstring")
    p.add_argument("--max_turns", type=int, required=True, help="most turns of the policy; the last runs no tools")
    p.add_argument("--total_episodes", type=int, required=True)
    p.add_argument("--rollout_batch_size", type=int, required=True, help="prompts per iteration")
    p.add_argument("--num_generations", type=int, required=True, help="responses per prompt")
    p.add_argument("--minibatch_size", type=int, required=True, help="responses per optimiser step")
    p.add_argument("--micro_batch_size", type=int, required=True, help="responses per forward/backward")
    p.add_argument("--num_epochs", type=int, required=True)
    p.add_argument("--response_length", type=int, required=True, help="the policy's and the tools' tokens together")
    p.add_argument("--learning_rate", type=float, required=True)
    p.add_argument("--kl_coef", type=float, required=True)
    p.add_argument("--missing_eos_penalty", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--eval_batch_size", type=int, default=100)
    p.add_argument("--model_dtype", default="float32")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    if a.missing_eos_penalty:
        p.error("TRL's GRPOTrainer has no missing-EOS penalty: run both sides with --missing_eos_penalty 0.")
    a.algorithm = "grpo"  # what trl_config reads
    return a


def tools_config(a):
    """GRPOConfig's keyword arguments: trl_runner's for grpo.py, with grpo_tools.py's differences."""
    return dict(
        trl_config(a),
        weight_decay=0.0,  # grpo_tools.py's AdamW has none
        # a tool-calling iteration runs the calls of one turn and samples the next: max_turns - 1 of them
        max_tool_calling_iterations=a.max_turns - 1,
        per_device_eval_batch_size=a.eval_batch_size,
        num_generations_eval=1,  # each held-out prompt once, as grpo_tools.py's eval/score
        eval_strategy="no",  # evaluated once, after training, outside the timed iterations
    )


def load_function(spec):
    """The function of a spec f.py:fn."""
    path, name = spec.rsplit(":", 1)
    module_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def conversations(path):
    """A .jsonl of {"prompt": text, "answer": ...} rows as TRL's conversational rows."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]


def evaluation(trainer, iteration):
    """TRL's evaluation on the held-out set: the mean score and the tool calls per response."""
    metrics = trainer.evaluate()
    return {
        "iteration": iteration,
        "eval/score": metrics["eval_rewards/final_answer/mean"],
        "eval/tools/calls_per_response": metrics["eval_tools/call_frequency"],
    }


def main():
    a = arguments()
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    os.makedirs(a.output_dir, exist_ok=True)
    log = open(os.path.join(a.output_dir, "metrics.jsonl"), "w")
    config = tools_config(a)
    per_iteration = config["logging_steps"]  # trainer steps (on_step_end calls) per iteration

    class IterationTimer(TrainerCallback):
        """One row per iteration, written at its log: wall time since the previous iteration ended (taken at the
        step's end), the optimiser steps taken, and TRL's calls per response."""

        def __init__(self):
            self.steps = 0
            self.iteration = 0
            self.last = None
            self.seconds = None  # the iteration that ended at the last step, until its log writes it

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            self.last = time.perf_counter()
            getattr(optimizer, "optimizer", optimizer).register_step_post_hook(self.count_step)

        def count_step(self, *_):
            """The torch optimiser's hook after each step it takes."""
            self.steps += 1

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % per_iteration == 0:
                now = time.perf_counter()
                self.seconds = now - self.last
                self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.seconds is None or "tools/call_frequency" not in logs:  # not an iteration's training log
                return
            self.iteration += 1
            row = {
                "iteration": self.iteration,
                "time/iteration": self.seconds,
                "optimizer_steps": self.steps,
                "objective/score": logs["reward"],
                "tools/calls_per_response": logs["tools/call_frequency"],
                "tools/failure_frequency": logs["tools/failure_frequency"],
            }
            log.write(json.dumps(row) + "\n")
            log.flush()
            self.seconds = None
            self.steps = 0

    tokenizer = AutoTokenizer.from_pretrained(a.model_name_or_path, padding_side="left")
    tokenizer.response_template = response_template(tokenizer.eos_token)
    rule = load_function(a.reward_fn)

    def final_answer(completion_ids, answer, **kwargs):
        """The rule on each response's text decoded as grpo_tools.py decodes it: every token after the prompt (the
        policy's turns and the tools' responses), special tokens left out."""
        return rule(tokenizer.batch_decode(completion_ids, skip_special_tokens=True), answer)

    trainer = GRPOTrainer(
        model=a.model_name_or_path,
        reward_funcs=[final_answer],
        args=GRPOConfig(**config),
        train_dataset=Dataset.from_list(conversations(a.dataset)),
        eval_dataset=Dataset.from_list(conversations(a.eval_dataset)),
        processing_class=tokenizer,
        tools=[load_function(a.tools)],
        callbacks=[IterationTimer()],
    )
    held_out = [evaluation(trainer, 0)]  # the starting policy's, as grpo_tools.py's first row
    trainer.train()
    log.close()
    held_out.append(evaluation(trainer, trainer.state.global_step // per_iteration))
    with open(os.path.join(a.output_dir, "eval.json"), "w") as f:
        json.dump(held_out, f)


if __name__ == "__main__":
    sys.exit(main())
