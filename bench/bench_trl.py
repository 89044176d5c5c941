"""ppo.py, grpo.py and rloo.py against the TRL trainers people use instead, on the CPU, in one invocation.

Each script runs against its TRL counterpart with the same models, prompts, group size, response length,
minibatches, updates per rollout and learning rate, in fp32: grpo.py against trl.GRPOTrainer and rloo.py against
trl.RLOOTrainer from TRL 1.16.0, ppo.py against trl.experimental.ppo.PPOTrainer from TRL 1.12.0 (the last release
that has it). The two sides alternate (ours then TRL's, TRL's then ours in the next repeat, and so on), because
the machine's speed drifts. Reported, as ratios ours / TRL:
- the median time per iteration (one rollout and all its updates), from the wall time between the ends of
  consecutive iterations: our metrics.jsonl's `time/elapsed`, and TRL's `on_step_end` callback in
  bench/trl_runner.py. Model loading is excluded, and so is the first iteration of every run (warm-up);
- the peak resident memory of each process (from wait4, bench/compare_algorithms.py's `measured`).
Two model sets: the embedded tiny ones (assets/tiny-sft, assets/tiny-rm) and a random-weight Llama of 23M parameters
(Llama-3.2-1B's shape scaled down: width and MLP / 4, 6 of 16 layers, 8 heads of 64 with 2 key-value heads, tied
embeddings) with the embedded tokenizer, built here with save_pretrained, as policy and reward model.
Every process runs with one thread (--threads): on a shared 2-core machine two OpenMP threads swing by 8x from one
second to the next (38 to 280 GFLOP/s on one 512 x 512 matmul loop), one thread by under 1.5x.

The peer environments, outside the repository: by default beside it (venv-trl116 and venv-trl112 in the folder that
holds the repository), elsewhere with --peer_venvs FOLDER or the environment variable RLHF_BENCH_VENVS. Made from
the Python that runs this repository, from its root, with the CPU build of torch first (so that pip does not fetch the
CUDA build) and tyro (so that bench/trl_runner.py can import the scripts' rule reward, rlhf_runtime.rewards.REWARD_FNS):

    python -m venv ../venv-trl116
    ../venv-trl116/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    ../venv-trl116/bin/pip install --dry-run trl==1.16.0 transformers==5.25.0 tyro==1.0.17   # check: torch stays
    ../venv-trl116/bin/pip install trl==1.16.0 transformers==5.25.0 tyro==1.0.17
    python -m venv ../venv-trl112
    ../venv-trl112/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    ../venv-trl112/bin/pip install trl==1.12.0 transformers==5.25.0 tyro==1.0.17

Commands:

    python bench/bench_trl.py --out bench/trl.md             # all of it: 17 minutes on 2 shared cores
    python bench/bench_trl.py --algorithms ppo --models embedded --repeats 2
    python bench/bench_trl.py --profile ppo                  # torch.profiler: the ops of ppo.py and of TRL's PPO step
    python bench/bench_trl.py --quick --sides ours           # a smoke test in seconds, without TRL
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_algorithms import ROOT, measured, report  # noqa: E402

# Each script's own batch shape and learning rate, the same on both sides, plus what aligns our script with TRL's
# semantics where TRL has no setting for ours (ours_only); bench/trl_runner.py's trl_config does the converse.
ALGORITHMS = {
    "ppo": dict(
        script="ppo.py",
        venv="venv-trl112",
        trainer="trl.experimental.ppo.PPOTrainer (TRL 1.12.0)",
        task="reviews",
        rollout_batch_size=64,
        num_generations=1,
        minibatch_size=16,
        num_epochs=4,
        learning_rate=1e-4,
        kl_coef=0.1,
        missing_eos_penalty=1.0,
        ours_only=["--no_adaptive_kl", "--no_normalize_reward"],
    ),
    "grpo": dict(
        script="grpo.py",
        venv="venv-trl116",
        trainer="trl.GRPOTrainer (TRL 1.16.0)",
        task="arithmetic",
        rollout_batch_size=32,
        num_generations=8,
        minibatch_size=64,
        num_epochs=1,
        learning_rate=2e-4,
        kl_coef=0.04,
        missing_eos_penalty=0.0,
        ours_only=[],
    ),
    "rloo": dict(
        script="rloo.py",
        venv="venv-trl116",
        trainer="trl.RLOOTrainer (TRL 1.16.0)",
        task="reviews",
        rollout_batch_size=16,
        num_generations=4,
        minibatch_size=64,
        num_epochs=1,
        learning_rate=3e-4,
        kl_coef=0.2,
        missing_eos_penalty=0.0,
        ours_only=["--no_normalize_reward"],
    ),
}

# The folder that holds the peer environments (the venv names above): RLHF_BENCH_VENVS, else the folder that holds
# the repository.
PEER_VENVS = os.environ.get("RLHF_BENCH_VENVS") or os.path.dirname(ROOT)


def peer_python(algorithm, peer_venvs=PEER_VENVS):
    """The Python of the peer environment that runs TRL's side of this algorithm."""
    return os.path.join(peer_venvs, ALGORITHMS[algorithm]["venv"], "bin", "python")


# Where TRL's semantics differ from ours: (algorithm, what, ours, TRL, how it is aligned here). Read from the trainers'
# source in the peer environments (trl/experimental/ppo/ppo_trainer.py of 1.12.0; trl/trainer/{grpo,rloo}_trainer.py
# of 1.16.0).
DIFFERENCES = [
    (
        "all",
        "precision, activation checkpointing",
        "fp32, none",
        "bf16 and gradient checkpointing on by default",
        "TRL: bf16=False, gradient_checkpointing=False",
    ),
    ("all", "learning-rate schedule", "constant", "linear decay to 0 by default", "TRL: lr_scheduler_type=constant"),
    (
        "all",
        "optimiser",
        "torch AdamW (fused), eps 1e-5, no weight decay; PPO: one per model",
        "Trainer's default adamw_torch_fused (torch >= 2.8), eps 1e-8, weight decay 0 "
        "(when set: not on biases and norms); PPO: one over policy and critic",
        "TRL: adam_epsilon=1e-5, weight_decay=0 (its default)",
    ),
    (
        "all",
        "sampling",
        "own KV-cache loop, ancestral sampling from the full softmax at T",
        "model.generate, top_k=0, top_p=1, T (+1e-7 in PPO)",
        "T=1 on both sides; TRL: top_k=0, top_p=1",
    ),
    (
        "ppo",
        "optimiser steps per rollout",
        "one per minibatch: 4 epochs x 4 = 16",
        "gradient_accumulation_steps (4, to make a 64-prompt rollout of 16 per device) also sets accelerate's counter: "
        "one step every 4 minibatches, 4 per rollout",
        "runner sets trainer.accelerator.gradient_accumulation_steps = 1 after construction (not a config field); "
        "16 steps counted by a hook; --ppo_steps as_released keeps 4",
    ),
    (
        "ppo",
        "KL coefficient",
        "adaptive (Ziegler et al.) by default",
        "fixed",
        "ours: --no_adaptive_kl; both 0.1, k1 per token in the reward",
    ),
    (
        "ppo",
        "score normalisation",
        "running mean and std of all scores by default",
        "none (whiten_rewards=False)",
        "ours: --no_normalize_reward",
    ),
    ("ppo", "missing-EOS penalty", "1.0", "none by default", "TRL: missing_eos_penalty=1.0, stop_token=eos"),
    ("ppo", "value loss", "vf_coef x max((V-R)^2, clipped)", "vf_coef x 0.5 x max(...)", "TRL: vf_coef=0.2 = ours 0.1"),
    (
        "ppo",
        "value-loss tokens",
        "the response up to its EOS",
        "one position more (padding_mask_p1)",
        "not aligned (no setting)",
    ),
    (
        "ppo",
        "gradient clipping",
        "clip_grad_norm_ 1.0 per model every step",
        "none (the PPO loop never clips; max_grad_norm unused)",
        "not aligned: ours cannot switch it off (--max_grad_norm must be positive)",
    ),
    (
        "ppo",
        "entropy",
        "computed in the log-prob kernel, with autograd (ent_coef 0)",
        "full softmax under no_grad, for the log",
        "not aligned",
    ),
    (
        "ppo",
        "logprobs_old",
        "recorded while sampling",
        "from generate's stacked scores (B x T x V kept)",
        "same values; TRL holds the scores",
    ),
    (
        "ppo",
        "per-iteration housekeeping",
        "none",
        "gc.collect() and empty_cache() every iteration",
        "counted in TRL's time, as it is part of its loop",
    ),
    (
        "grpo",
        "KL term",
        "k3 in the loss, beta 0.04",
        "beta 0 by default (no reference model)",
        "TRL: beta=0.04 (k3 in the loss)",
    ),
    (
        "grpo",
        "loss aggregation",
        "token mean over the minibatch's own tokens",
        "dapo: token sum / (the generation batch's tokens / steps_per_generation)",
        "TRL: loss_type=dapo; equal when minibatches have equal token counts",
    ),
    ("grpo", "missing-EOS penalty", "1.0", "none", "ours: --missing_eos_penalty 0"),
    ("grpo", "group std", "population std", "unbiased (Bessel) std", "not aligned (no setting)"),
    (
        "grpo, rloo",
        "logprobs_old",
        "recorded while sampling",
        "an extra policy forward over the whole rollout "
        "(GRPO: whenever steps_per_generation > gradient_accumulation_steps, here 4 > 1; RLOO: always)",
        "not aligned: TRL's cost",
    ),
    (
        "grpo, rloo",
        "log-probs in training",
        "full logits of the response positions, then rlhf_kernels' log-prob kernel",
        "a fused LM head: log-probs and entropy in tiles of the completion positions, no full logits",
        "not aligned",
    ),
    (
        "grpo, rloo",
        "position ids in training",
        "counted over real tokens (left padding)",
        "none passed: positions count the pad tokens",
        "not aligned",
    ),
    (
        "rloo",
        "loss",
        "REINFORCE -A log pi, summed over tokens / (sequences x response_length) (one update per rollout)",
        "sequence-level clipped ratio of summed log-probs x A, mean over sequences",
        "same gradient at ratio 1 up to the factor response_length, which Adam all but removes",
    ),
    (
        "rloo",
        "KL",
        "k1 summed over the response, in the reward, beta 0.2",
        "the same, beta 0.05 by default",
        "TRL: beta=0.2",
    ),
    (
        "rloo",
        "score normalisation, missing-EOS penalty",
        "running moments; 1.0",
        "none; none",
        "ours: --no_normalize_reward --missing_eos_penalty 0",
    ),
    (
        "rloo",
        "reward-model input",
        "the sampled token ids; the score read at the EOS",
        "completions decoded without special tokens, prompt + completion re-tokenised, right-padded; "
        "the score at the last non-pad token (not the EOS)",
        "not aligned (no setting): the reward model reads a different last token",
    ),
]
TASKS = {"reviews": "assets/reviews/train.jsonl", "arithmetic": "assets/arithmetic/train.jsonl"}
# iterations per run, for the embedded models and for the 23M one (the first of each is not timed)
ITERATIONS = {"embedded": {"ppo": 6, "grpo": 8, "rloo": 12}, "random": {"ppo": 3, "grpo": 3, "rloo": 5}}
REPEATS = {"embedded": 3, "random": 2}  # runs of each side per comparison (--repeats overrides)
SHAPE = dict(
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)


def build(folder):
    """The random-weight Llama policy and reward model (one label), saved with the embedded tokenizer. Run in a
    child process (`--build`), so that this process stays small: a child's peak counts pages it was forked with."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
    config = LlamaConfig(
        **SHAPE,
        vocab_size=len(tokenizer),
        num_labels=1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    for name, model_class in (("policy", LlamaForCausalLM), ("rm", LlamaForSequenceClassification)):
        torch.manual_seed(0)
        model = model_class(config)
        model.save_pretrained(os.path.join(folder, name))
        tokenizer.save_pretrained(os.path.join(folder, name))
        print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters")


def model_paths(name, runs):
    """Policy and reward model of a model set; the random one is built (in a child process) on first use."""
    if name == "embedded":
        return os.path.join(ROOT, "assets", "tiny-sft"), os.path.join(ROOT, "assets", "tiny-rm")
    folder = os.path.abspath(os.path.join(runs, "models"))
    if not os.path.isdir(os.path.join(folder, "rm")):
        subprocess.run([sys.executable, os.path.abspath(__file__), "--build", folder], check=True)
    return os.path.join(folder, "policy"), os.path.join(folder, "rm")


def shared_flags(algorithm, policy, rm, iterations, response_length):
    """The flags both sides get, with the same names and values: our scripts' own, which bench/trl_runner.py takes
    too."""
    c = ALGORITHMS[algorithm]
    responses = c["rollout_batch_size"] * c["num_generations"]
    flags = ["--model_name_or_path", policy, "--dataset", TASKS[c["task"]]]
    if c["task"] == "reviews":
        flags += ["--reward_model_path", rm]
    else:
        flags += ["--reward_model_path", "--reward_fn", "arithmetic"]
    flags += ["--total_episodes", str(iterations * responses), "--rollout_batch_size", str(c["rollout_batch_size"])]
    if algorithm != "ppo":
        flags += ["--num_generations", str(c["num_generations"])]
    for key in ("minibatch_size", "num_epochs", "learning_rate", "kl_coef", "missing_eos_penalty"):
        flags += [f"--{key}", str(c[key])]
    return flags + [
        "--micro_batch_size",
        str(c["minibatch_size"]),
        "--response_length",
        str(response_length),
        "--model_dtype=float32",
        "--seed=1",
    ]


def require_peer_pythons(algorithms, peer_venvs):
    """Stops in one sentence, before any run, when a TRL environment is not where --peer_venvs says (a user who made
    them elsewhere, or not yet)."""
    for algorithm in algorithms:
        python = peer_python(algorithm, peer_venvs)
        if not os.path.exists(python):
            raise SystemExit(
                f"{python} does not exist: make the TRL environments as bench/bench_trl.py's docstring says, or name "
                "the folder that holds them with --peer_venvs or RLHF_BENCH_VENVS."
            )


def commands(algorithm, policy, rm, iterations, response_length, out, peer_venvs=PEER_VENVS):
    """Our command and TRL's for one comparison: the shared flags, then each side's own."""
    c = ALGORITHMS[algorithm]
    flags = shared_flags(algorithm, policy, rm, iterations, response_length)
    ours = [
        sys.executable,
        os.path.join(ROOT, c["script"]),
        "--output_dir",
        os.path.join(out, "ours"),
        *flags,
        "--eval_every=0",
        "--save_every=0",
        *c["ours_only"],
    ]
    trl = [
        peer_python(algorithm, peer_venvs),
        os.path.join(ROOT, "bench", "trl_runner.py"),
        algorithm,
        "--output_dir",
        os.path.join(out, "trl"),
        *flags,
    ]
    return {"ours": ours, "trl": trl}


def iteration_times(side, metrics_path):
    """Wall seconds of every iteration after the first: ours from time/elapsed (end of one iteration to the end of
    the next, everything in the loop included), TRL's from the runner's time/iteration (the same span)."""
    rows = [json.loads(line) for line in open(metrics_path)]
    rows = [r for r in rows if r["iteration"] >= 1]
    if side == "ours":
        return [b["time/elapsed"] - a["time/elapsed"] for a, b in zip(rows, rows[1:])]
    return [r["time/iteration"] for r in rows[1:]]


def steps_per_iteration(side, algorithm, metrics_path):
    """Optimiser steps in one iteration: counted by TRL's runner, from the batch shape for ours (every step is taken
    unless its gradient is not finite, which health/skipped_steps would show)."""
    if side == "trl":
        return round(statistics.median(json.loads(line)["optimizer_steps"] for line in open(metrics_path)))
    c = ALGORITHMS[algorithm]
    return c["num_epochs"] * c["rollout_batch_size"] * c["num_generations"] // c["minibatch_size"]


def ratio_cell(ours, trl):
    return f"{ours / trl:.2f}x" if ours and trl else "n/a"


def number_cell(x, spec):
    return format(x, spec) if x is not None else "n/a"


# What --profile labels (record_function around each call), per side: the phases of a PPO iteration.
PROFILED = {
    "ours": (
        "ppo",
        "ppo.main(tyro.cli(ppo.Args, use_underscores=True))",
        [
            "ppo.generate",
            "rlhf_runtime.score_responses",
            "ppo.response_logprobs",
            "rlhf_runtime.head_outputs",
            "ppo.token_logprobs",
            "ppo.clip_loss",
            "ppo.value_loss",
            "ppo.gae_advantages",
            "torch.Tensor.backward",
            "torch.nn.utils.clip_grad_norm_",
        ],
    ),
    "trl": (
        "trl_runner",
        "trl_runner.main()",
        [
            "trl.experimental.ppo.ppo_trainer.batch_generation",
            "trl.experimental.ppo.ppo_trainer.get_reward",
            "trl.experimental.ppo.ppo_trainer.forward",
            "trl.experimental.ppo.ppo_trainer.selective_log_softmax",
            "trl.experimental.ppo.ppo_trainer.masked_whiten",
            "torch.Tensor.backward",
            "torch.nn.functional.softmax",
        ],
    ),
}
PRELUDE = """
import importlib
import json
import os
import sys

import torch
import tyro
from torch.profiler import ProfilerActivity, profile, record_function

name = sys.argv[1]
entry = sys.argv[2]
targets = json.loads(sys.argv[3])
sys.argv = sys.argv[4:]
sys.path[:0] = [os.path.dirname(sys.argv[0]), os.path.dirname(os.path.dirname(sys.argv[0]))]
globals()[name] = importlib.import_module(name)
def labelled(f, label):
    def call(*args, **kwargs):
        with record_function(label):
            return f(*args, **kwargs)
    return call
for target in targets:
    path, attr = target.rsplit('.', 1)
    parts = path.split('.')
    owner = importlib.import_module(parts[0])
    for part in parts[1:]:
        if hasattr(owner, part):
            owner = getattr(owner, part)
        else:
            owner = importlib.import_module(owner.__name__ + '.' + part)
    original = getattr(owner, attr)
    setattr(owner, attr, labelled(original, '## ' + target))
    # the runtime's modules import from one another (and from torch): the same function labelled where each holds it
    for module in [m for k, m in list(sys.modules.items()) if k.split('.')[0] == 'rlhf_runtime']:
        for key, value in list(vars(module).items()):
            if value is original:
                setattr(module, key, getattr(owner, attr))
with profile(activities=[ProfilerActivity.CPU]) as prof:
    exec(entry)
rows = prof.key_averages()
print('PROFILE')
print(rows.table(sort_by='self_cpu_time_total', row_limit=20, max_name_column_width=60))
print('LABELS')
for r in sorted((r for r in rows if r.key.startswith('## ')), key=lambda r: -r.cpu_time_total):
    print(f'| {r.key[3:]} | {r.count} | {r.cpu_time_total / 1e3:,.0f} |')
"""


def profile(algorithm, policy, rm, iterations, out, peer_venvs):
    """torch.profiler over one run of each side (loading included): the ops by self CPU time, and the labelled
    functions of PROFILED by total CPU time (a function called inside another counts in both)."""
    if algorithm != "ppo":
        raise SystemExit("--profile labels the phases of ppo.py and of TRL's PPO step only.")
    cmds = commands(algorithm, policy, rm, iterations, 24, out, peer_venvs)
    lines = []
    for side in ("ours", "trl"):
        name, entry, targets = PROFILED[side]
        cmd = [cmds[side][0], "-c", PRELUDE, name, entry, json.dumps(targets), *cmds[side][1:]]
        shutil.rmtree(cmds[side][cmds[side].index("--output_dir") + 1], ignore_errors=True)  # a new run each time
        os.makedirs(out, exist_ok=True)
        log = os.path.join(out, f"profile_{side}.log")
        measured(cmd, log)
        text = open(log).read()
        ops = text[text.index("PROFILE") + 8 : text.index("LABELS")]
        labels = text[text.index("LABELS") + 7 :]
        lines += [
            f"### {side}: {iterations} iterations, loading included",
            "",
            "| function | calls | total CPU ms |",
            "|---|---:|---:|",
            labels.rstrip(),
            "",
            "```",
            ops.rstrip(),
            "```",
            "",
        ]
    report(lines, os.path.join(out, "profile.md"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithms", default="ppo,grpo,rloo")
    p.add_argument(
        "--models",
        default="embedded,random",
        help="embedded: assets/tiny-sft and tiny-rm; random: the 23M Llama built here",
    )
    p.add_argument("--sides", default="ours,trl", help="ours,trl; 'ours' alone runs without TRL (a smoke test)")
    p.add_argument(
        "--repeats", type=int, help="runs of each side per comparison, alternating (default: 3 embedded, 2 random)"
    )
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS / MKL_NUM_THREADS of every run")
    p.add_argument(
        "--peer_venvs",
        default=PEER_VENVS,
        help="the folder that holds the TRL environments venv-trl116 and venv-trl112 (default: RLHF_BENCH_VENVS, else "
        "the folder that holds the repository)",
    )
    p.add_argument("--runs", default="runs/bench_trl", help="where the runs (and the random models) are written")
    p.add_argument("--quick", action="store_true", help="smoke test: embedded models, 8 tokens, 3 iterations, 1 repeat")
    p.add_argument("--profile", metavar="ALGORITHM", help="instead: profile one run of each side (ppo only)")
    p.add_argument("--profile_models", default="embedded", choices=["embedded", "random"])
    p.add_argument("--build", metavar="FOLDER", help=argparse.SUPPRESS)
    p.add_argument("--out", help="also write the tables (markdown) here")
    a = p.parse_args()
    if a.build:
        build(a.build)
        return
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    os.environ["MKL_NUM_THREADS"] = str(a.threads)
    names = ["embedded"] if a.quick else a.models.split(",")
    if a.profile:
        require_peer_pythons([a.profile], a.peer_venvs)
        policy, rm = model_paths(a.profile_models, a.runs)
        profile(
            a.profile,
            policy,
            rm,
            ITERATIONS[a.profile_models][a.profile],
            os.path.join(a.runs, "profile", a.profile_models),
            a.peer_venvs,
        )
        return
    sides = a.sides.split(",")
    if "trl" in sides:
        require_peer_pythons([*a.algorithms.split(","), "grpo"], a.peer_venvs)  # grpo's: the baseline below
    models = {m: model_paths(m, a.runs) for m in names}
    repeats = {m: 1 if a.quick else a.repeats or REPEATS[m] for m in models}
    response_length = 8 if a.quick else 24
    pairs = [(m, alg) for m in models for alg in a.algorithms.split(",")]
    times = {(m, alg, s): [] for m, alg in pairs for s in sides}  # per run: its iteration times
    peaks = {k: [] for k in times}
    steps = {}
    baseline = {}  # MB of a process that only imports what the side imports
    for side, python, code in (
        ("ours", sys.executable, "import torch, transformers, tyro; import ppo"),
        (
            "trl",
            peer_python("grpo", a.peer_venvs),
            "import torch, transformers, trl; from trl import GRPOTrainer",
        ),
    ):
        if side in sides:
            baseline[side] = measured([python, "-c", code], os.devnull)
    for r in range(max(repeats.values())):
        for m, alg in pairs:
            if r >= repeats[m]:
                continue
            iterations = 3 if a.quick else ITERATIONS[m][alg]
            cmds = commands(
                alg,
                *models[m],
                iterations,
                response_length,
                os.path.join(a.runs, m, alg),
                a.peer_venvs,
            )
            order = sides if r % 2 == 0 else sides[::-1]  # ABBA: each side goes first in every other repeat
            for side in order:
                out = cmds[side][cmds[side].index("--output_dir") + 1]
                shutil.rmtree(out, ignore_errors=True)  # a new run each time (a folder with checkpoints is refused)
                os.makedirs(out, exist_ok=True)
                peaks[m, alg, side].append(measured(cmds[side], os.path.join(out, "output.log")))
                metrics = os.path.join(out, "metrics.jsonl")
                times[m, alg, side].append(iteration_times(side, metrics))
                steps[m, alg, side] = steps_per_iteration(side, alg, metrics)
                print(
                    f"{m} {alg} {side} run {r + 1}: "
                    f"median {statistics.median(times[m, alg, side][-1]):.2f} s per iteration, "
                    f"{peaks[m, alg, side][-1]:,.0f} MB",
                    flush=True,
                )
    lines = [
        f"Time per iteration (median over runs x iterations, first iteration of each run left out) and peak "
        "resident memory (median over runs); "
        f"{', '.join(f'{n} runs of each side with the {m} models' for m, n in repeats.items())}, alternating; "
        f"{a.threads} thread(s); fp32; {response_length}-token responses.",
        "",
        "| models | algorithm | TRL trainer | ours s/iter | TRL s/iter | **time ours/TRL** | per-run ratios | "
        "ours MB | TRL MB | **memory ours/TRL** | optimiser steps per iteration (ours, TRL) |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for m, alg in pairs:
        t = {
            s: statistics.median([x for run in times[m, alg, s] for x in run]) if s in sides else None
            for s in ("ours", "trl")
        }
        mb = {s: statistics.median(peaks[m, alg, s]) if s in sides else None for s in ("ours", "trl")}
        if len(sides) == 2:
            pairs_of_runs = zip(times[m, alg, "ours"], times[m, alg, "trl"])
            per_run = ", ".join(ratio_cell(statistics.median(o), statistics.median(q)) for o, q in pairs_of_runs)
        else:
            per_run = "n/a"
        lines.append(
            f"| {m} | {alg} | {ALGORITHMS[alg]['trainer']} | {number_cell(t['ours'], '.2f')} | "
            f"{number_cell(t['trl'], '.2f')} | **{ratio_cell(t['ours'], t['trl'])}** | "
            f"{per_run} | {number_cell(mb['ours'], ',.0f')} | {number_cell(mb['trl'], ',.0f')} | "
            f"**{ratio_cell(mb['ours'], mb['trl'])}** | "
            f"{steps.get((m, alg, 'ours'), 'n/a')}, {steps.get((m, alg, 'trl'), 'n/a')} |"
        )
    lines += [
        "",
        "Per-run medians, s per iteration (spread): "
        + "; ".join(
            f"{m} {alg} {s} " + " / ".join(f"{statistics.median(run):.2f}" for run in times[m, alg, s])
            for m, alg in pairs
            for s in sides
        ),
        "",
        "A process that only imports: " + ", ".join(f"{s} {mb:,.0f} MB" for s, mb in baseline.items()) + ".",
        "",
        "Where TRL's semantics differ from ours, and what was done about it:",
        "",
        "| algorithm | what | ours | TRL | aligned how |",
        "|---|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in DIFFERENCES),
    ]
    report(lines, a.out)


if __name__ == "__main__":
    main()
