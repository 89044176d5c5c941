"""The run's settings, shared by every script (the models and data, evaluation, logging, alarms, checkpoints,
precision, LoRA), and the checks of the options every script has. The guarantee: every mistake in the options is
said in one sentence that names the fix, before anything is created, started or loaded."""

import os
import pathlib
import tempfile
from dataclasses import asdict, dataclass, fields
from typing import Literal

import torch
import tyro
from transformers import AutoConfig, AutoModelForCausalLM

# The embedded example, beside the scripts (this folder's parent): the defaults of the tiny models and prompts.
ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


@dataclass
class RunSettings:
    """the run: the models and the data, evaluation, logging, alarms, checkpoints, precision, LoRA"""

    # the models and the data
    model_name_or_path: str = f"{ASSETS}/tiny-sft"
    """the starting policy (a causal LM); the frozen reference is a copy of it"""
    model_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the models' weights"""
    hub_kernels: bool = False
    """let transformers replace layers with kernels it downloads from the Hugging Face Hub (GPU; needs the network)"""
    decode: Literal["auto", "plain"] = "auto"
    """auto: on one GPU, rlhf_kernels' decode step, each one CUDA graph; plain (and elsewhere): generate's own loop"""
    dataset_split: str = "train"
    """split of a hub --dataset"""
    dataset_config: str | None = None
    """configuration of a hub --dataset and --eval_dataset, for those that have several (openai/gsm8k: main)"""
    reward_weights: tuple[float, ...] = ()
    """the weight of each --reward_fn, in order (none given: 1 each)"""
    prompt_field: str = "prompt"
    """the dataset column holding the prompts: text, or chat messages (a list of {"role", "content"})"""
    chat_template: bool = False
    """render each text prompt as one user message through the tokenizer's chat template (chat messages always are)"""
    answer_field: str = "answer"
    """the column of the reference answers (for the rules): a column of that name, else a.b reads a nested one (verl's
    reward_model.ground_truth)"""
    max_prompt_length: int = 64
    """longest prompt in tokens"""
    truncate_prompts: bool = False
    """cut longer prompts to their last max_prompt_length tokens (with a warning) instead of stopping"""
    seed: int = 1
    """random seed, the same on every process (each draws every process's numbers and keeps its own)"""

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
    """iterations in the run: --total_episodes over the responses each iteration samples"""


def require(options, names, rule, ok):
    """Stop with one sentence when an option breaks its rule, e.g. "--temperature must be positive (got 0.0)."."""
    for name in names:
        if not ok(getattr(options, name)):
            raise SystemExit(f"--{name} {rule} (got {getattr(options, name)}).")


def check_common_args(args, responses_per_iteration):
    """The checks every script shares, before any model loads; nothing is created or started here. It reads many
    options: the script's batches, generation and reward (args) and the run's settings (args.run)."""
    run = args.run
    embedded = [
        f"--{f.name}"
        for options in (args, run)
        for f in fields(options)
        if ASSETS in str(f.default) and getattr(options, f.name) == f.default
    ]
    if embedded and not os.path.isdir(ASSETS):  # the script copied without assets/
        raise SystemExit(
            f"{', '.join(embedded)} default to the embedded example in '{ASSETS}', which is not beside "
            "this file; pass your own (a model folder or hub name, a .jsonl file or hub dataset)."
        )
    most = torch.finfo(torch.float32).max  # a float option meets float32 tensors (a clamp's bound, a weight)
    within = f"finite and within +-{most:.3g}"
    for options in (args, run):
        floats = [f.name for f in fields(options) if f.type is float]
        require(options, floats, f"must be {within}", lambda v: abs(v) <= most)  # nan fails it too
    require(run, ("seed",), "must lie in [0, 9e12] (iteration i draws from seed * 1e6 + i)", lambda v: 0 <= v <= 9e12)
    require(run, ("eval_every", "save_every"), "must be 0 (never) or more", lambda v: v >= 0)
    timeout_range = "must be 0 (no limit) or from 0.1 s (how often a call is checked) to 1e6 s"
    require(run, ("reward_timeout",), timeout_range, lambda v: v == 0 or 0.1 <= v <= 1e6)
    sizes = ("rollout_batch_size", "total_episodes", "minibatch_size", "micro_batch_size", "num_epochs")
    require(args, (*sizes, "response_length"), "must be at least 1", lambda v: v >= 1)
    counts = ("max_prompt_length", "eval_batch_size", "log_samples_every", "keep_checkpoints", "max_bad_steps")
    require(run, counts, "must be at least 1", lambda v: v >= 1)
    require(args, ("max_grad_norm", "temperature"), "must be positive", lambda v: v > 0)
    require(run, ("lora_alpha",), "must be positive", lambda v: v > 0)
    require(args, ("ent_coef", "missing_eos_penalty"), "must be zero or more", lambda v: v >= 0)
    require(run, ("lora_r",), "must be zero or more", lambda v: v >= 0)
    require(args, ("dual_clip",), "must be 0 (off) or more than 1 (the paper uses 3)", lambda v: v == 0 or v > 1)
    require(run, ("lora_dropout",), "must lie in [0, 1)", lambda v: 0 <= v < 1)
    if run.save_adapters_only and not run.lora_r:
        raise SystemExit("--save_adapters_only needs adapters: pass --lora_r (the LoRA rank, e.g. 16) too.")
    shared = f"must be a multiple of the {run.world_size} processes (each samples whole groups of prompts)"
    require(args, ("rollout_batch_size", "minibatch_size"), shared, lambda v: v % run.world_size == 0)
    divides = f"must divide the {responses_per_iteration} responses per iteration"
    require(args, ("minibatch_size",), divides, lambda v: responses_per_iteration % v == 0)
    local_minibatch = args.minibatch_size // run.world_size
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
    require(run, ("reward_weights",), "needs one weight per --reward_fn", lambda v: len(v) in (0, len(names)))
    require(run, ("reward_weights",), f"must each be {within}", lambda v: all(abs(w) <= most for w in v))
    if run.mixed_precision and run.model_dtype != "float32":
        raise SystemExit("--mixed_precision keeps float32 master weights and computes in bf16; drop --model_dtype.")
    config = check_model_path(run.model_name_or_path, "causal LM", "--model_name_or_path")
    positions = getattr(config, "max_position_embeddings", None) or float("inf")
    fit = f"plus --max_prompt_length must fit the policy's {positions} positions"
    require(args, ("response_length",), fit, lambda v: v + run.max_prompt_length <= positions)
    if run.lora_r and run.lora_target_modules != ("all-linear",):  # peft skips a name it lacks if another is found
        with torch.device("meta"):  # matched as peft does (a whole name or its end), on a weightless model
            names = ["." + name for name, _ in AutoModelForCausalLM.from_config(config).named_modules()]
        rule = "must each end the name of a module of the policy, or be all-linear"
        require(run, ("lora_target_modules",), rule, lambda v: all(any(n.endswith("." + t) for n in names) for t in v))
    for path in args.reward_model_path:
        check_model_path(path, "sequence classifier", "--reward_model_path")
    if run.track and int(os.environ.get("RANK", 0)) == 0:  # rank 0 alone logs to wandb
        check_wandb_login()
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


WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")  # what wandb's WANDB_MODE accepts


def check_wandb_login():
    """--track: WANDB_MODE one of wandb's modes and, where wandb logs online, an API key that it finds, looked up as
    wandb.init does (the environment, the netrc file, its settings files) with no network and no prompt."""
    mode = os.environ.get("WANDB_MODE")
    if mode is not None and mode not in WANDB_MODES:  # wandb's own error is a pydantic traceback
        raise SystemExit(
            f"--track: WANDB_MODE is {mode!r}, not a mode of wandb; set it to online, offline (to log locally) or "
            "disabled, or unset it."
        )
    from wandb.errors import AuthenticationError

    try:  # wandb's own look-up, as of wandb 0.31; another version keeps wandb.init's own error
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth import authenticate_session

        settings = wandb_setup.singleton().settings  # the mode and the server, `wandb offline` included
        if settings.mode in ("offline", "dryrun", "disabled"):  # no key needed
            return
        found = authenticate_session(host=settings.base_url, source="--track", prompt=False, update_session=False)
    except (ImportError, TypeError):
        return
    except AuthenticationError as e:  # a key of the wrong form, or two ways of logging in at once
        raise SystemExit(f"--track: wandb cannot use its credentials ({str(e).rstrip('.')}); correct them.") from None
    if found is None:
        raise SystemExit(
            "--track: wandb finds no API key here (`wandb login` was never run on this machine); run `wandb login`, "
            "set WANDB_API_KEY, or set WANDB_MODE=offline to log locally (`wandb sync` uploads the run later)."
        )


def flat_options(args):
    """Every option by its name, the script's and the run's together: what args.json and wandb's config hold."""
    options = asdict(args)
    run = options.pop("run")
    return {**options, **run}
