"""The TRL side of bench/bench_trl.py: one TRL trainer run configured like one of our scripts, run in a peer virtual
environment that has trl (see bench/bench_trl.py for how to make them).

It takes the same flags, with the same meanings, as ppo.py, grpo.py and rloo.py (the subset the benchmark sets), maps
them onto TRL's config in `trl_config` (plain values, importable without trl), trains, and writes one JSON row per
iteration (one rollout and its updates) to <output_dir>/metrics.jsonl: the wall time from the end of the previous
iteration to the end of this one (`time/iteration`) and the optimiser steps it took (`optimizer_steps`, counted by a
hook on the torch optimiser, so steps that accumulation skipped are not counted).

    python bench/trl_runner.py grpo --output_dir runs/bench_trl/x ...    # normally run by bench/bench_trl.py
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def arguments(argv=None):
    """The flags of our scripts that the benchmark sets, with their meanings there."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("algorithm", choices=["ppo", "grpo", "rloo"])
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--reward_model_path", nargs="*", default=[])
    p.add_argument("--reward_fn", nargs="*", default=[], help="rule rewards by name, each added to the score")
    p.add_argument("--dataset", required=True)
    p.add_argument("--total_episodes", type=int, required=True)
    p.add_argument("--rollout_batch_size", type=int, required=True, help="prompts per iteration")
    p.add_argument("--num_generations", type=int, default=1, help="responses per prompt (GRPO, RLOO)")
    p.add_argument("--minibatch_size", type=int, required=True, help="responses per optimiser step")
    p.add_argument("--micro_batch_size", type=int, required=True, help="responses per forward/backward")
    p.add_argument("--num_epochs", type=int, required=True)
    p.add_argument("--response_length", type=int, required=True)
    p.add_argument("--learning_rate", type=float, required=True)
    p.add_argument("--kl_coef", type=float, required=True)
    p.add_argument("--missing_eos_penalty", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--model_dtype", default="float32")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--ppo_steps",
        choices=["per_minibatch", "as_released"],
        default="per_minibatch",
        help="PPO only: one optimiser step per minibatch as ppo.py takes (set on the trainer's Accelerator "
        "after construction), or TRL 1.12 as configured, whose accumulation counter steps once every "
        "num_mini_batches minibatches",
    )
    a = p.parse_args(argv)
    a.reward_fn = tuple(a.reward_fn)  # as our scripts hold it
    return a


def responses_per_iteration(a):
    return a.rollout_batch_size * (a.num_generations if a.algorithm != "ppo" else 1)


def steps_per_iteration(a):
    """Optimiser steps in one of our iterations: epochs x minibatches."""
    return a.num_epochs * responses_per_iteration(a) // a.minibatch_size


def trl_config(a):
    """The TRL config (keyword arguments of PPOConfig / GRPOConfig / RLOOConfig) that matches our flags.
    TRL's defaults that differ from our scripts are overridden here; bench/trl.md lists what cannot be."""
    common = dict(
        output_dir=a.output_dir,
        seed=a.seed,
        learning_rate=a.learning_rate,
        lr_scheduler_type="constant",  # TRL: linear decay to 0; ours: constant
        adam_epsilon=1e-5,
        weight_decay=0.0,  # ours: torch.optim.AdamW(eps=1e-5, weight_decay=0.0)
        bf16=False,
        fp16=False,  # TRL defaults to bf16; the comparison is fp32
        gradient_checkpointing=False,  # TRL defaults to on; our scripts do not checkpoint
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        temperature=a.temperature,
    )
    n = responses_per_iteration(a)
    if a.algorithm == "ppo":
        return dict(
            common,
            per_device_train_batch_size=a.micro_batch_size,
            # so that the rollout is per_device x accumulation = n prompts
            gradient_accumulation_steps=n // a.micro_batch_size,
            num_mini_batches=n // a.minibatch_size,
            num_ppo_epochs=a.num_epochs,
            total_episodes=a.total_episodes,
            local_rollout_forward_batch_size=n,
            response_length=a.response_length,
            stop_token="eos",
            missing_eos_penalty=a.missing_eos_penalty,
            kl_coef=a.kl_coef,
            kl_estimator="k1",
            cliprange=0.2,
            cliprange_value=0.2,
            gamma=1.0,
            lam=0.95,
            whiten_rewards=False,
            vf_coef=0.2,  # TRL's value loss is 0.5 (V - R)^2, ours (V - R)^2 with vf_coef 0.1
            num_sample_generations=0,
            logging_steps=1,
        )
    steps = steps_per_iteration(a)
    if a.algorithm == "grpo":
        own = dict(scale_rewards="group", loss_type="dapo")
    else:
        own = dict(normalize_advantages=False)
    return dict(
        common,
        per_device_train_batch_size=a.micro_batch_size,
        gradient_accumulation_steps=a.minibatch_size // a.micro_batch_size,
        steps_per_generation=n // a.micro_batch_size,
        num_iterations=a.num_epochs,
        num_generations=a.num_generations,
        max_completion_length=a.response_length,
        top_k=0,
        top_p=1.0,
        beta=a.kl_coef,
        epsilon=0.2,
        max_grad_norm=1.0,
        disable_dropout=True,
        max_steps=a.total_episodes // n * steps,
        logging_steps=steps,
        model_init_kwargs={"dtype": a.model_dtype, "use_kernels": False},
        shuffle_dataset=True,
        log_completions=False,
        **own,
    )


def main():
    a = arguments()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    os.makedirs(a.output_dir, exist_ok=True)
    log = open(os.path.join(a.output_dir, "metrics.jsonl"), "w")
    # trainer steps (on_step_end calls) per iteration
    per_iteration = 1 if a.algorithm == "ppo" else steps_per_iteration(a)

    class IterationTimer(TrainerCallback):
        """One row per iteration: wall time since the previous iteration ended, and the optimiser steps taken."""

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            self.steps = 0
            self.iteration = 0
            self.last = time.perf_counter()
            getattr(optimizer, "optimizer", optimizer).register_step_post_hook(self.count_step)

        def count_step(self, *_):
            """The torch optimiser's hook after each step it takes."""
            self.steps += 1

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % per_iteration == 0:
                now = time.perf_counter()
                self.iteration += 1
                log.write(
                    json.dumps(
                        {"iteration": self.iteration, "time/iteration": now - self.last, "optimizer_steps": self.steps}
                    )
                    + "\n"
                )
                log.flush()
                self.last = now
                self.steps = 0

    tokenizer = AutoTokenizer.from_pretrained(a.model_name_or_path, padding_side="left")
    rows = [json.loads(line) for line in open(a.dataset) if line.strip()]
    dtype = getattr(torch, a.model_dtype)
    reward_models = []
    for path in a.reward_model_path:
        rm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype, use_kernels=False)
        rm.config.pad_token_id = tokenizer.pad_token_id
        reward_models.append(rm)
    config = trl_config(a)
    if a.algorithm == "ppo":
        from trl.experimental.ppo import PPOConfig, PPOTrainer

        def causal():
            return AutoModelForCausalLM.from_pretrained(a.model_name_or_path, dtype=dtype, use_kernels=False)

        value = AutoModelForSequenceClassification.from_pretrained(
            a.reward_model_path[0], num_labels=1, dtype=dtype, use_kernels=False
        )
        value.config.pad_token_id = tokenizer.pad_token_id
        ids = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        train = Dataset.from_dict({"input_ids": ids})
        trainer = PPOTrainer(
            args=PPOConfig(**config),
            processing_class=tokenizer,
            model=causal(),
            ref_model=causal(),
            reward_model=reward_models[0],
            value_model=value,
            train_dataset=train,
            eval_dataset=train.select(range(8)),
            callbacks=[IterationTimer()],
        )
        if a.ppo_steps == "per_minibatch":
            trainer.accelerator.gradient_accumulation_steps = 1
    else:
        if a.algorithm == "grpo":
            from trl import GRPOConfig as Config
            from trl import GRPOTrainer as Trainer
        else:
            from trl import RLOOConfig as Config
            from trl import RLOOTrainer as Trainer
        sys.path.insert(0, ROOT)
        from rlhf_runtime.rewards import REWARD_FNS  # the very rule our scripts use

        funcs = list(reward_models)
        for name in a.reward_fn:

            def rule_reward(completions, answer, rule=REWARD_FNS[name], **kwargs):
                return rule(completions, answer)

            rule_reward.__name__ = name
            funcs.append(rule_reward)
        train = Dataset.from_list([{k: r[k] for k in ("prompt", "answer") if k in r} for r in rows])
        trainer = Trainer(
            model=a.model_name_or_path,
            reward_funcs=funcs,
            args=Config(**config),
            train_dataset=train,
            processing_class=tokenizer,
            reward_processing_classes=[tokenizer] * len(funcs) if reward_models else None,
            callbacks=[IterationTimer()],
        )
    trainer.train()
    log.close()


if __name__ == "__main__":
    main()
