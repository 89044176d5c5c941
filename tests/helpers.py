"""What the test files share: running a script the way a user does (a subprocess, offline, with transformers' own
hub-kernel default) or in this process, stopping and resuming it, comparing runs; the tiny models of every family; and
the check that rlhf_kernels' static decode loop samples what generate's plain loop samples."""

import contextlib
import dataclasses
import importlib
import io
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import warnings

import torch
import tyro
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

import grpo
import ppo
import rlhf_runtime as runtime
import rloo
from rlhf_kernels import decode
from rlhf_runtime.settings import RunSettings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ENV = {k: v for k, v in os.environ.items() if k != "USE_HUB_KERNELS"}  # transformers' default must not matter
ENV.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
ALONE = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}  # nothing of the repository on the path
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]  # gloo on the CPU
MODULES = {"ppo.py": ppo, "grpo.py": grpo, "rloo.py": rloo}

# The sizes of a tiny run: 8 responses an iteration (ppo.py: 8 prompts; grpo.py and rloo.py: 2 prompts x 4 responses)
# in one minibatch and one micro-batch, so one optimiser step an iteration. --total_episodes is each test's own (16:
# two iterations).
GROUPS_OF_FOUR = dict(rollout_batch_size=2, num_generations=4, minibatch_size=8, micro_batch_size=8)
TINY_SIZES = {
    "ppo.py": dict(rollout_batch_size=8, minibatch_size=8, micro_batch_size=8, num_epochs=1),
    "grpo.py": GROUPS_OF_FOUR,
    "rloo.py": GROUPS_OF_FOUR,
    "dapo.py": GROUPS_OF_FOUR,
}
# grpo.py's and rloo.py's groups of 8: 4 prompts x 8 responses an iteration, in two minibatches of two micro-batches
GROUPS_OF_EIGHT = ["--rollout_batch_size=4", "--num_generations=8", "--minibatch_size=16", "--micro_batch_size=8"]


def set_up(module, args):
    """main's set-up steps before any model loads, in its order: the checks, the lock, the reward functions, the
    checkpoint to go on from."""
    module.validate(args)
    runtime.lock_output_dir(args.output_dir)
    runtime.load_reward_fns(args.reward_fn, args.run.reward_timeout)
    runtime.find_checkpoint(args)


def make_args(module, **values):
    """module.Args with these options, each where it lives: the script's own fields, or the run's settings (Args.run),
    as the command line sets them by the same names."""
    own = {f.name for f in dataclasses.fields(module.Args)} - {"run"}
    run = RunSettings(**{k: v for k, v in values.items() if k not in own})
    return module.Args(**{k: v for k, v in values.items() if k in own}, run=run)


def options(**values):
    """Command-line options of one value each, as `--name=value` strings."""
    return [f"--{name}={value}" for name, value in values.items()]


def tiny_run(script, **changes):
    """The options of a tiny run of the script (TINY_SIZES), with the test's own options and changes."""
    return options(**{**TINY_SIZES[script], **changes})


# ---------------------------------------------------------------- running a script


def read_rows(out):
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def without_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def run_script(script, out, *args):
    """Run `python script --output_dir out args...` from the repository root; return the rows of its
    metrics.jsonl and everything it printed. Fails the test, with the end of stderr, if the run fails."""
    cmd = [sys.executable, os.path.join(ROOT, script), "--output_dir", str(out), *args]
    result = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_rows(out), result.stdout + result.stderr


def in_process(script, argv):
    """The script's main on the command line argv, in this process, as `python script argv...` would run it from the
    repository root; returns what it printed (its warnings too), pytest's signal handlers given back. The same run,
    bitwise, without a fresh interpreter's seconds of imports: for tests of what a run computes, not of how a process
    starts or ends (a failure is the SystemExit main raises)."""
    module = MODULES.get(script) or importlib.import_module(script.removesuffix(".py"))
    args = tyro.cli(module.Args, args=argv, use_underscores=True)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    command_line = sys.argv
    sys.argv = [os.path.join(ROOT, script), *argv]  # what a stopped run prints to go on
    printed = io.StringIO()
    try:
        with contextlib.chdir(ROOT), warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                module.main(args)
    finally:
        sys.argv = command_line
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return printed.getvalue() + "".join(f"{w.category.__name__}: {w.message}\n" for w in warned)


def run_main(script, out, *args):
    """run_script's run in this process (in_process): the rows of its metrics.jsonl and what it printed."""
    printed = in_process(script, ["--output_dir", str(out), *args])
    return read_rows(out), printed


def torchrun(script, out, *args, processes=2):
    """`torchrun --nproc_per_node=processes script --output_dir out args...` from the repository root, offline (gloo
    on the CPU); returns the finished process."""
    cmd = [*TORCHRUN[:-1], f"--nproc_per_node={processes}", os.path.join(ROOT, script), "--output_dir", str(out), *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def script_command(script, out, args, head=(sys.executable,)):
    """head (python, or torchrun, then any prelude file), the script, --output_dir out and args."""
    return [*head, os.path.join(ROOT, script), "--output_dir", str(out), *args]


def launch(script, out, args, prelude=None, runner=(sys.executable,)):
    """The script in a subprocess under runner (python, or torchrun), optionally under a prelude file that patches
    something first."""
    head = [*runner, prelude] if prelude else runner
    cmd = script_command(script, out, args, head)
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(cmd, env=ENV, timeout=240, **kw):
    """cmd run to its end from the repository root, its output captured as text."""
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def wait_for(condition, proc, timeout=240):
    start = time.time()
    while not condition():
        assert proc.poll() is None, f"the run ended before it could be stopped:\n{proc.stdout.read()[-3000:]}"
        assert time.time() - start < timeout
        time.sleep(0.05)


# ---------------------------------------------------------------- tiny runs stopped, broken and resumed

# Six iterations each, in seconds on two cores: grpo.py and rloo.py at the tiny run's sizes (TINY_SIZES), ppo.py in two
# epochs of two minibatches, evaluating on a small held-out set (its own generator must not disturb the run's; its
# path is set by conftest.py's small_held_out_set).
TINY = {
    "ppo.py": dict(
        total_episodes=48,
        rollout_batch_size=8,
        minibatch_size=4,
        micro_batch_size=4,
        num_epochs=2,
        response_length=8,
        eval_every=3,
    ),
    "grpo.py": dict(TINY_SIZES["grpo.py"], total_episodes=48, response_length=8, eval_every=0),
    "rloo.py": dict(TINY_SIZES["rloo.py"], total_episodes=48, response_length=8, eval_every=0),
    "dapo.py": dict(TINY_SIZES["dapo.py"], total_episodes=48, response_length=8, eval_every=0),
}
# The arithmetic task scored by its rule alone, no held-out set, a checkpoint every three iterations.
ARITHMETIC_TRAIN = f"--dataset={os.path.join(ROOT, 'assets', 'arithmetic', 'train.jsonl')}"
ARITHMETIC = [ARITHMETIC_TRAIN, "--reward_fn", "arithmetic", "--reward_model_path", "--eval_every=0", "--save_every=3"]


def cli(script, **extra):
    return options(**{**TINY[script], **extra})


def args_for(script, out, **kw):
    """The script's Args of a tiny run in one optimiser step per iteration, on the embedded models, into out."""
    paths = dict(model_name_or_path=os.path.join(ROOT, "assets", "tiny-sft"))
    if script != "grpo.py":  # grpo's default is the arithmetic rule; the others use the reward model
        paths.update(
            reward_model_path=(os.path.join(ROOT, "assets", "tiny-rm"),),
            dataset=os.path.join(ROOT, "assets", "reviews", "train.jsonl"),
        )
    else:
        paths.update(dataset=os.path.join(ROOT, "assets", "arithmetic", "train.jsonl"))
    # one optimiser step per iteration: the whole rollout is one minibatch and one micro-batch
    one_step = dict(
        minibatch_size=8, micro_batch_size=8, num_epochs=1, rollout_batch_size=8 if script == "ppo.py" else 2
    )
    return make_args(
        MODULES[script], **{**TINY[script], **one_step, "eval_every": 0, **paths, "output_dir": str(out), **kw}
    )


def checkpointed(checkpoint):
    """A checkpoint's trained models and optimiser states, {name: {"model": ..., "optimizer": ...}}, read into one
    process."""
    flat = str(checkpoint) + ".pt"
    dcp_to_torch_save(checkpoint, flat)
    return torch.load(flat)


def final_state(out, iteration=6):
    """The saved policy and the last checkpoint's models and optimiser states."""
    return load_file(os.path.join(out, "model.safetensors")), checkpointed(os.path.join(out, f"checkpoint-{iteration}"))


def assert_bitwise_equal(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_bitwise_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_bitwise_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def constant_reward(folder):
    """--reward_fn for a reward that never varies (TRL's form, 0.1 for every response), written in folder."""
    path = os.path.join(folder, "constant.py")
    with open(path, "w") as f:
        f.write("def constant(completions, **kwargs):\n    return [0.1] * len(completions)\n")
    return f"{path}:constant"


def failing_reward(tmp_path, from_batch, rank):
    """A prelude that runs a script with the runtime's arithmetic rule behind a grading service that goes away at the
    given rollout (counting batches), on the given process; the script itself runs as python runs it."""
    prelude = tmp_path / "failing_reward.py"
    prelude.write_text(f"""import os
import runpy
import sys

sys.argv = sys.argv[1:]
sys.path.insert(0, {ROOT!r})
from rlhf_runtime.rewards import REWARD_FNS
arithmetic = REWARD_FNS["arithmetic"]
batches = []
def grading_service(texts, answers):
    batches.append(len(texts) > 1)
    if os.environ.get("RANK", "0") == {str(rank)!r} and sum(batches) >= {from_batch}:
        raise ConnectionError("the grading service went away")
    return arithmetic(texts, answers)
REWARD_FNS["arithmetic"] = grading_service
runpy.run_path(sys.argv[0], run_name="__main__")  # the script as python runs it, its built-in rule replaced
""")
    return str(prelude)


def resume_as_printed(printed, checkpoint):
    """The command a stopped run printed, which must resume the given checkpoint, run in this process (in_process);
    returns what the resumed run printed. The stop tests of test_checkpoints.py run such a command as a subprocess."""
    command = printed.split("to go on:\n")[1].splitlines()[0].strip()
    assert command.endswith(f"--resume {checkpoint}"), command
    python, script, *argv = shlex.split(command)
    assert python == "python"
    return in_process(os.path.relpath(script, ROOT), argv)


# ---------------------------------------------------------------- two processes against one

# Three iterations each; several minibatches and micro-batches per process, and a held-out set of 15 prompts in
# batches of 4 (the second process's share of 8 is topped up with an uncounted copy).
GROUPS = ["--rollout_batch_size=4", "--num_generations=8", "--minibatch_size=16", "--micro_batch_size=4"]
ARGS = {
    "ppo.py": ["--rollout_batch_size=16", "--minibatch_size=8", "--micro_batch_size=2", "--total_episodes=48"],
    "grpo.py": [*GROUPS, "--total_episodes=96"],
    "rloo.py": [*GROUPS, "--total_episodes=96"],
    "dapo.py": [*GROUPS, "--total_episodes=96"],  # tests/test_dapo.py runs it on two processes
}


def common(script, held_out):
    """The options of a run compared on two processes and one: ARGS, two epochs, a checkpoint and an evaluation of
    conftest.py's held_out prompts every iteration."""
    task = "arithmetic" if script in ("grpo.py", "dapo.py") else "reviews"
    evaluation = ["--eval_every=1", "--eval_batch_size=4", f"--eval_dataset={held_out[task]}"]
    return [*ARGS[script], "--num_epochs=2", "--response_length=8", "--save_every=1", *evaluation]


def run_torchrun(script, out, *args):
    """Like run_script, on two processes: returns the rows of the run's metrics.jsonl."""
    result = torchrun(script, out, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_rows(out)


def compared(rows):
    return [
        {k: v for k, v in r.items() if not k.startswith(("time/", "memory/")) and k != "policy/first_ratio_dev"}
        for r in rows
    ]


# How far a run on two processes may be from the same run on one. What differs is float32 rounding alone: the same
# terms are added in another order (each process's share, then the all-reduce; matrix products over 8 rows rather than
# 16), and each optimiser step carries that into the weights, where the next steps build on it. Float32 rounds each
# result to within EPS = 2^-23 = 1.19e-7 of its size, so a sum of n terms added in another order differs by up to
# about n x EPS of the terms' total size (each addition rounds by up to EPS of a partial sum). A statistic of an
# iteration is made of sums over its N response tokens (94 to 224 in the runs compared here). The rule:
# - a mean over the batch (a rate, a loss, a norm, an entropy) is held to 1e-5 of the size of its terms: 84 EPS, the
#   bound of a sum of 84 terms, no looser than that of one sum over the iteration's tokens. Where the terms share a
#   sign, their size is the mean's own: 1e-5 relative. Where they do not (SIGNED: the policy loss, the advantages, the
#   scores and the values, which the normalisations keep of size about one), the mean may nearly cancel while its
#   rounding stays that of its terms: 1e-5 absolute;
# - a statistic made of log-prob differences (LOGPROB_DIFFERENCES: the KL and its terms) is a mean of each response's
#   sum of log-probs, terms of about length x entropy nats: 1e-5 of that (or of one, the score's size, in the reward
#   less the KL penalty), not of its own size, which is rounding alone while the policy is still the reference;
# - a statistic of one token (EXTREMES: the largest ratio) is not averaged: where each token's rounding is its own, a
#   mean over N tokens has 1/sqrt(N) of one token's, so one token is held to sqrt(N) times a mean's, 1e-5 x sqrt(N)
#   relative (N: the responses trained on, the iteration's episodes over its sampling rounds, times their mean
#   length).
# The weights' differences, carried in from the steps before, are of the same rounding. Measured on the four scripts'
# two-process runs, with MKL's and ATen's AVX-512 kernels and with their AVX2 ones: the gradient norm at most 0.38 of
# its bound (the norm of a sum whose terms cancel, held to its own size since theirs is not logged), the rest under 0.2.
SIGNED = {
    "policy/loss",
    "adv/mean",
    "objective/score",
    "objective/score_normalized",
    "eval/score",
    "eval/score_greedy",
    "val/mean",
    "val/explained_variance",
}
LOGPROB_DIFFERENCES = {
    "objective/kl",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "policy/kl_term",
    "policy/approx_kl",
}
EXTREMES = {"policy/ratio_max"}


def assert_rows_agree(got, expected):
    """Two processes' rows against one's, to the float32 rule above."""
    assert len(got) == len(expected) == 4  # the held-out row 0 and three iterations
    episodes = 0
    for a, b in zip(compared(got), compared(expected)):
        assert a.keys() == b.keys()
        logprob_scale = b.get("response/length", 0) * b.get("policy/entropy", 0)  # nats of log-prob per response
        responses = (b["episodes"] - episodes) / b.get("rollout/sampling_rounds", 1)  # dapo.py counts every round drawn
        tokens = responses * b.get("response/length", 0)  # the response tokens trained on
        episodes = b["episodes"]
        for k in a:
            rel, floor = 1e-5, 0.0
            if k in SIGNED:
                floor = 1e-5
            if k in LOGPROB_DIFFERENCES:
                floor = max(1e-5, 1e-5 * logprob_scale)
            if k in EXTREMES:
                rel = 1e-5 * max(1.0, tokens) ** 0.5
            assert math.isclose(a[k], b[k], rel_tol=rel, abs_tol=floor), (
                f"iteration {a['iteration']} {k}: {a[k]} on two processes, {b[k]} on one"
            )


def assert_same_model(got, expected):
    """The saved weights to 1e-5 of a weight's size, about one at most (the rule above; measured: 0.13 of it)."""
    a = AutoModelForCausalLM.from_pretrained(str(got)).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(expected)).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=k)


# ---------------------------------------------------------------- the tiny models

# The sizes of every tiny random model of the tests: 2 layers of width 32, 4 heads over 2 key-value heads, 128
# positions.
TINY_DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_llama_config(**changes):
    """The tests' tiny random Llama: TINY_DECODER's sizes, 40 tokens, pad 0, EOS 1 and no BOS, with the test's own
    changes (a vocabulary, a label count, ...)."""
    tokens = dict(vocab_size=40, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return LlamaConfig(**{**TINY_DECODER, **tokens, **changes})


# The model-family matrix: a tiny random model of each architecture a user is likely to bring, with the embedded
# tokenizer's vocabulary and special tokens (it has no BOS; its EOS is 0). The embedded default is one Llama; every
# other family reaches the scripts only through transformers' Auto classes (tests/test_models.py says where they
# differ).
TOKENIZER = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
PAD = TOKENIZER.pad_token_id
EOS = TOKENIZER.eos_token_id
TOKENS = dict(vocab_size=len(TOKENIZER), bos_token_id=TOKENIZER.bos_token_id, eos_token_id=EOS, pad_token_id=PAD)
FAMILIES = {
    "llama": lambda **kw: tiny_llama_config(**TOKENS, **kw),
    "qwen2": lambda **kw: Qwen2Config(**TINY_DECODER, **TOKENS, **kw),
    "qwen3": lambda **kw: Qwen3Config(**TINY_DECODER, head_dim=8, **TOKENS, **kw),
    "gpt_neox": lambda **kw: GPTNeoXConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        **TOKENS,
        **kw,
    ),
    "gpt2": lambda **kw: GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **TOKENS, **kw),
    "gemma": lambda **kw: GemmaConfig(**TINY_DECODER, head_dim=8, **TOKENS, **kw),
    "qwen3_moe": lambda **kw: Qwen3MoeConfig(
        **TINY_DECODER, head_dim=8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **TOKENS, **kw
    ),
}


def left_padded_prompts(lengths, vocab, seed, pad=0):
    """Random prompts of the given lengths (ids from 2 up), left-padded: runtime.left_pad's (ids, mask)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]
    return runtime.left_pad(prompts, pad, "cpu")


# ---------------------------------------------------------------- the documents and the decode loops


def readme_files(folder, documents=None):
    """The files the documents show (their ```python blocks that open with `# name.py`), written into folder:
    {name: path}. documents: paths from the repository root; by default README.md, docs/*.md and bench/README.md,
    the documents tests/test_commands.py parses."""
    if documents is None:
        docs = sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
        documents = ["README.md", *docs, "bench/README.md"]
    written = {}
    for document in documents:
        text = open(os.path.join(ROOT, document)).read()
        for name, code in re.findall(r"```python\n# ([\w.]+\.py)\n(.*?)```", text, re.S):
            written[name] = os.path.join(folder, name)
            with open(written[name], "w") as f:
                f.write(code)
    return written


def assert_static_decode_matches_dynamic(policy, pad_token_id, stop_ids, vocab_size):
    """generate with its decode steps handed to rlhf_kernels' static_decode (buffers of fixed shape; no CUDA graph on
    the CPU) gives the plain loop's tokens and response masks, and its log-probs within 1e-6, on left-padded prompts
    of different lengths, sampled at T = 0.7 and 1 (uniforms of 0 draw token 0, the EOS, so that rows stop at
    different steps) and greedily; the second batch (another prompt width, the same cache width) reuses the first's
    buffers, the third (prompts of 60 tokens) needs a wider cache, which replaces the first (one decoder per batch
    size). Run the policy in float64: in float32 the static cache's attention, which also reads its unused columns
    (each with a weight of exactly 0), sums in another order, and the log-probs differ by rounding, about 1e-5 (as a
    teacher-forced pass differs from them)."""
    g = torch.Generator().manual_seed(1)
    for lengths in ([1, 5, 3, 8, 2, 6], [4, 2, 9, 1, 3, 7], [60, 3, 5, 1, 2, 7]):
        prompts = [torch.randint(2, vocab_size, (n,), generator=g).tolist() for n in lengths]
        prompt_ids, prompt_mask = runtime.left_pad(prompts, pad_token_id, "cpu")
        uniforms = torch.rand(6, 10, generator=g)
        uniforms[0, 3] = 0.0
        uniforms[2, 0] = 0.0
        uniforms[3, 6] = 0.0
        for temperature in (0.7, 1.0):
            dynamic = ppo.Sampling(10, temperature, stop_ids, pad_token_id)
            static = ppo.Sampling(10, temperature, stop_ids, pad_token_id, kernel_decode=True)
            for draws in (uniforms, None):
                expected = ppo.generate(policy, prompt_ids, prompt_mask, dynamic, draws)
                got = ppo.generate(policy, prompt_ids, prompt_mask, static, draws)
                assert torch.equal(got[0], expected[0])
                assert torch.equal(got[2], expected[2])
                torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=0)
                if draws is not None:  # rows stop at different steps
                    assert len(set(expected[2].sum(1).tolist())) > 2
        widths = [decoder.width for key, decoder in decode.DECODERS.items() if key[0] is policy]
        assert widths == [64 if max(lengths) < 54 else 128]


def assert_group_prompts_prefilled_once(policy, pad_token_id, stop_ids, vocab_size, atol, kernel_decode=False):
    """grpo.py's and rloo.py's rollouts repeat each prompt for its group; generate encodes each run of equal rows once
    and repeats its keys and values. Against each row sampled alone (prefilled by itself, no padding: what generate
    did before the sharing), every row samples the same tokens, and their log-probs agree within atol. Groups of 3,
    2, 1 and 2 rows; the last repeats the first group's prompt, but not next to it, so it is encoded again: the policy
    is called on 4 rows for the prefill. Uniforms of 0 make rows stop at different steps."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3)]
    prompt_ids, prompt_mask = runtime.left_pad([prompts[i] for i in (0, 0, 0, 1, 1, 2, 0, 0)], pad_token_id, "cpu")
    uniforms = torch.rand(8, 10, generator=g)
    uniforms[0, 2] = 0.0
    uniforms[4, 5] = 0.0
    uniforms[6, 0] = 0.0
    sampling = ppo.Sampling(10, 0.7, stop_ids, pad_token_id, kernel_decode)
    batches = []

    def record_batch(module, args, kwargs):
        batches.append(kwargs["input_ids"].shape)

    hook = policy.register_forward_pre_hook(record_batch, with_kwargs=True)
    together = ppo.generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
    hook.remove()
    assert batches[0] == (4, 9)  # the prefill: one row per run of equal prompts
    assert all(shape[0] == 8 for shape in batches[1:])  # each decode step: every row
    assert len(set(together[2].sum(1).tolist())) > 2  # rows stop at different steps
    assert_rows_sample_as_alone(policy, prompt_ids, prompt_mask, sampling, uniforms, together, atol, rtol=0)


def assert_rows_sample_as_alone(policy, prompt_ids, prompt_mask, sampling, uniforms, together, atol, rtol):
    """Each row of a batch generate sampled (together) is what generate samples for that prompt alone, unpadded: the
    same tokens, padding after them, and the same log-probs to atol and rtol."""
    for b in range(len(prompt_ids)):
        width = int(prompt_mask[b].sum())
        alone = ppo.generate(
            policy, prompt_ids[b : b + 1, -width:], prompt_mask[b : b + 1, -width:], sampling, uniforms[b : b + 1]
        )
        n = alone[0].shape[1]
        assert torch.equal(alone[0][0], together[0][b, :n])
        assert (together[2][b, n:] == 0).all()
        torch.testing.assert_close(alone[1][0], together[1][b, :n], atol=atol, rtol=rtol)
