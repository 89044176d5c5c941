"""The scripts as a user first runs them. The documents' commands must work as written: every `python X.py ...` or
`torchrun ... X.py ...` line of the bash blocks of README.md, docs/*.md and bench/README.md is parsed by that script's
own Args (tyro, as the script does), so a renamed or removed flag fails here, and a complete command then passes the
script's own argument checks (batch sizes that divide, over torchrun's number of processes). Lines with placeholders
(<...>, ...) are parsed up to the placeholder only. The hub models they name are not loaded (no hub here): the
model-path check is the one check left out.

A script is a file a reader copies into their own project, with the folder rlhf_runtime/ beside it (rlhf_kernels/
too, optionally). Copied so into an empty folder it still runs, from any working folder: the log-probs come from its
plain torch path (no rlhf_kernels beside it), the embedded example is looked for beside rlhf_runtime/ (and missing, one
sentence names the options to pass), and a model that cannot be had fails at once. Copied without rlhf_runtime/, it
stops in one sentence naming the folder to copy.

Bad options stop with one sentence before any model loads: the checks every script shares (rlhf_runtime) are tested
once, on one script, and each script's own checks in each; a terminal gets a live progress bar and a log file lines;
nothing opens a socket when every path is local, and --track without a reachable wandb logs offline (without a wandb
login, one sentence says so); a process under torchrun with stdout closed ends with its own exit code; the fresh
install imports (no local package shadows an installed one)."""

import importlib
import importlib.metadata
import io
import json
import os
import re
import runpy
import shlex
import shutil
import socket
import subprocess
import sys
import warnings

import pytest
import torch
import tyro
from helpers import (
    ALONE,
    ENV,
    MODULES,
    ROOT,
    args_for,
    cli,
    finished,
    make_args,
    read_rows,
    readme_files,
    run_main,
    script_command,
    set_up,
    tiny_run,
)
from safetensors.torch import load_file

import dapo
import grpo
import ppo
import rlhf_runtime
import rlhf_runtime.settings
from rlhf_runtime import rewards

# ---------------------------------------------------------------- the documents' commands


SCRIPTS = ("ppo.py", "grpo.py", "rloo.py", "dapo.py", "grpo_tools.py")


# The documents whose commands are checked, from the repository root (helpers.readme_files reads the same ones).
DOCUMENTS = [
    "README.md",
    *sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")),
    "bench/README.md",
]


def readme_commands():
    """(document, script, argv, processes, partial) for each script command in the documents' bash blocks,
    continuation lines joined."""
    commands = []
    for document in DOCUMENTS:
        commands += document_commands(document)
    return commands


def document_commands(document):
    """The script commands of one document's bash blocks."""
    text = open(os.path.join(ROOT, document)).read()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;", line):
                words = shlex.split(part, comments=True)
                scripts = [i for i, w in enumerate(words) if w in SCRIPTS]
                if scripts:
                    argv = words[scripts[0] + 1 :]
                    cut = [i for i, w in enumerate(argv) if w.startswith("<") or w in ("...", "--args")]
                    if cut:
                        argv = argv[: cut[0]]
                        if argv and argv[-1].startswith("--"):  # the placeholder was that flag's value
                            argv = argv[:-1]
                    nproc = [int(w.split("=")[1]) for w in words[: scripts[0]] if w.startswith("--nproc_per_node=")]
                    commands.append((document, words[scripts[0]], argv, nproc[0] if nproc else 1, bool(cut)))
    return commands


COMMANDS = readme_commands()


def test_the_documents_have_commands_for_each_script():
    assert {c[1] for c in COMMANDS} == set(SCRIPTS)
    assert len(COMMANDS) >= 24  # the README's count before its text moved into docs/ and bench/README.md
    assert {c[0] for c in COMMANDS} >= {"README.md", "docs/results.md", "docs/recipes.md", "docs/long-runs.md"}


@pytest.mark.parametrize(
    "document,script,argv,nproc,partial", COMMANDS, ids=[f"{c[0]}: {c[1]} {' '.join(c[2])[:60]}" for c in COMMANDS]
)
def test_readme_command_parses_and_passes_the_checks(document, script, argv, nproc, partial, tmp_path, monkeypatch):
    module = importlib.import_module(script[:-3])
    try:
        args = tyro.cli(module.Args, args=argv, use_underscores=True)
    except SystemExit as e:
        pytest.fail(f"`{script} {' '.join(argv)}` from {document} does not parse (exit {e.code})")
    if partial:
        return
    # the scripts call it as runtime.check_model_path, check_common_args as rlhf_runtime.settings'
    monkeypatch.setattr(rlhf_runtime, "check_model_path", lambda *a: None)
    monkeypatch.setattr(rlhf_runtime.settings, "check_model_path", lambda *a: None)
    args.output_dir, args.run.world_size = str(tmp_path / "out"), nproc
    shown = readme_files(tmp_path, DOCUMENTS)  # a reward function's file a document shows, as the user would write it
    for i, spec in enumerate(args.reward_fn):
        where, _, name = spec.rpartition(":")
        if where in shown:
            args.reward_fn = args.reward_fn[:i] + (f"{shown[where]}:{name}",) + args.reward_fn[i + 1 :]
    module.validate(args)  # raises SystemExit with its sentence when a check fails


def test_the_readme_reward_example_runs_and_scores_by_hand(tmp_path):
    path = readme_files(tmp_path)["my_reward.py"]
    readme = open(os.path.join(ROOT, "README.md")).read()
    command = re.search(
        r"^python grpo\.py --reward_fn my_reward\.py:correct my_reward\.py:bare_number .*$", readme, re.M
    ).group(0)
    correct = rewards.load_reward_fn(f"{path}:correct", 10)
    bare_number = rewards.load_reward_fn(f"{path}:bare_number", 10)
    # by hand: correct and well formed, well formed but wrong, neither
    assert rewards.call_reward_fn(correct, dict(responses=["12", "13", "twelve"], answers=["12", "12", "12"]), 10) == (
        [1.0, 0.0, 0.0],
        None,
    )
    assert rewards.call_reward_fn(bare_number, dict(responses=["12", "13", "twelve"], answers=["12"] * 3), 10) == (
        [1.0, 1.0, 0.0],
        None,
    )
    argv = [a.replace("my_reward.py:", f"{path}:") for a in command.split()[2:]]
    rows, _ = run_main(
        "grpo.py",
        tmp_path / "run",
        *argv[: argv.index("--output_dir")],
        *tiny_run("grpo.py", total_episodes=16, eval_every=0),
    )
    for r in rows:  # the score is the right answers' rate plus 0.1 times the well-formed rate
        assert r["objective/score"] == pytest.approx(r["reward/correct"] + 0.1 * r["reward/bare_number"], abs=1e-6)
    assert any(r["reward/bare_number"] > 0 for r in rows)


def main_block(script, *argv):
    """The script's `if __name__ == "__main__":` block (rlhf_runtime.launch(main, Args)) on the command line argv, in
    this process (the file executed afresh, as `python script argv...` would); returns its exit status. What it prints
    is the test's capsys's."""
    command_line = sys.argv
    formatwarning = warnings.formatwarning  # launch sets the scripts' own
    sys.argv = [os.path.join(ROOT, script), *argv]
    try:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    except SystemExit as e:
        return e.code
    finally:
        sys.argv = command_line
        warnings.formatwarning = formatwarning
    return 0


@pytest.mark.parametrize("script", ["ppo.py"])
def test_the_seed_help_says_what_the_code_does(script, capsys):
    """Every process seeds its generators with --seed itself (torch.manual_seed(run.seed) in main, the sampling
    generators from seed and iteration alone): the help must not say a rank is added. --seed's field and its help are
    written once, in rlhf_runtime/settings.py's RunSettings: one script's help says it for all; each script's own main
    seeds with it."""
    assert main_block(script, "--help") == 0
    text = " ".join(capsys.readouterr().out.split())
    seed_help = text[text.index("--seed") :][:200]
    assert "the same on every process" in seed_help
    assert "rank" not in seed_help
    for each in SCRIPTS:  # main is each script's own (run: args.run)
        assert "torch.manual_seed(run.seed)" in open(os.path.join(ROOT, each)).read(), each


def test_computed_fields_are_not_options_and_trls_num_iterations_is_named(tmp_path, capsys):
    """--num_iterations is computed from --total_episodes (and --world_size from torchrun); a TRL user's
    --num_iterations, TRL's passes over each rollout, is refused naming --num_epochs instead of being ignored."""
    for given in (["--num_iterations", "4"], ["--num_iterations=4"]):
        assert main_block("grpo.py", "--output_dir", str(tmp_path / "run"), *given) == 1
        assert "--num_iterations (TRL's passes over each rollout) is --num_epochs here" in capsys.readouterr().err
        assert not (tmp_path / "run").exists()
    assert main_block("grpo.py", "--help") == 0
    shown = capsys.readouterr().out
    assert "--total_episodes" in shown
    assert "--num_iterations" not in shown and "--world_size" not in shown


def closed(*streams):
    """A command prefix that runs a command with the given file descriptors closed, as `command >&- 2>&-` does."""
    return ["sh", "-c", f'exec "$@" {" ".join(f"{fd}>&-" for fd in streams)}', "sh"]


def torchrun_env():
    """The environment torchrun gives its one process: what launch and start_processes read."""
    with socket.socket() as s:  # a free port for the process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {
        **ENV,
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": f"{port}",
    }


@pytest.mark.parametrize(
    "argv,code,said",
    [
        (["--num_iterations=2"], 1, "--num_iterations (TRL's passes over each rollout) is --num_epochs here"),
        (["--no_such_option=2"], 2, "Unrecognized options: --no_such_option=2"),  # tyro's own refusal
    ],
    ids=["refused", "refused by tyro"],
)
def test_a_refusal_under_torchrun_with_stdout_closed_exits_with_its_code(argv, code, said):
    """Under torchrun (WORLD_SIZE set) with stdout closed (sys.stdout is None): the sentence on stderr and the
    refusal's exit code, not an AttributeError's traceback and 1."""
    result = finished([*closed(1), sys.executable, "grpo.py", *argv], env=torchrun_env())
    assert result.returncode == code, result.stderr[-3000:]
    assert said in result.stderr
    assert "Traceback" not in result.stderr


def test_a_run_under_torchrun_with_stdout_and_stderr_closed_ends_with_0(tmp_path):
    """A run that finished and saved its policy exits with 0 under torchrun with stdout and stderr closed; torchrun
    once reported it failed (exit 1)."""
    args = tiny_run("grpo.py", total_episodes=8, response_length=6, eval_every=0)
    result = finished([*closed(1, 2), *script_command("grpo.py", tmp_path, args)], env=torchrun_env())
    assert result.returncode == 0
    assert os.path.isfile(tmp_path / "model.safetensors")
    assert [row["iteration"] for row in read_rows(tmp_path)] == [1]


# ---------------------------------------------------------------- a script copied with rlhf_runtime/, or without


# every script, dapo.py too
EVERY_SCRIPT = {**MODULES, "dapo.py": dapo}


KERNEL_LINE = "rlhf_kernels (the fused log-prob kernel) was not found: log-probs come from the plain torch path"


def two_iterations(script):
    """Two iterations of the script on the embedded models, every path given (as a copier of the file passes them)."""
    data = "arithmetic" if script in ("grpo.py", "dapo.py") else "reviews"
    args = [
        f"--model_name_or_path={ROOT}/assets/tiny-sft",
        f"--dataset={ROOT}/assets/{data}/train.jsonl",
        *tiny_run(script, total_episodes=16, response_length=8, eval_every=0),
    ]
    if script in ("ppo.py", "rloo.py"):
        args += ["--reward_model_path", f"{ROOT}/assets/tiny-rm"]
    return args


def run(script_path, cwd, *args):
    return subprocess.run(
        [sys.executable, str(script_path), *args], cwd=cwd, env=ALONE, capture_output=True, text=True, timeout=300
    )


def copied_project(folder, *scripts, runtime=True):
    """folder, made, with the scripts copied into it as a reader copies them into their own project: the folder
    rlhf_runtime/ beside them (unless runtime is False), rlhf_kernels/ and the embedded example (assets/) left out."""
    folder.mkdir()
    for script in scripts:
        shutil.copy(os.path.join(ROOT, script), folder)
    if runtime:
        shutil.copytree(
            os.path.join(ROOT, "rlhf_runtime"), folder / "rlhf_runtime", ignore=shutil.ignore_patterns("__pycache__")
        )
    return folder


# One script suffices: a copied run differs from the repository's only in what every script shares, rlhf_runtime/
# found beside the file (the same package for all) and the plain torch log-probs in place of rlhf_kernels' (a copy
# that is the same in every script; test_the_plain_torch_log_probs_agree_with_the_kernel imports each of the four
# copied so and checks that it takes that path).
@pytest.mark.parametrize("script", ["grpo.py"])
def test_a_script_copied_with_rlhf_runtime_trains_as_in_the_repository(script, tmp_path):
    alone = copied_project(tmp_path / "project", script)
    copied = run(alone / script, alone, *two_iterations(script), "--output_dir", str(tmp_path / "copied"))
    assert copied.returncode == 0, copied.stderr[-3000:]
    assert (copied.stdout + copied.stderr).count(KERNEL_LINE) == 1
    _, here = run_main(script, tmp_path / "here", *two_iterations(script))  # in this process, beside rlhf_kernels
    assert KERNEL_LINE not in here
    # The same samples and scores (the sampler does not use the kernel), and the same training to float rounding.
    rows = [[json.loads(line) for line in open(tmp_path / folder / "metrics.jsonl")] for folder in ("copied", "here")]
    assert [r["objective/score"] for r in rows[0]] == [r["objective/score"] for r in rows[1]]
    for a, b in zip(*rows):
        assert a["policy/approx_kl"] == pytest.approx(b["policy/approx_kl"], rel=1e-3, abs=1e-7)
    trained = [load_file(tmp_path / folder / "model.safetensors") for folder in ("copied", "here")]
    for name, weight in trained[1].items():
        torch.testing.assert_close(trained[0][name], weight, atol=1e-5, rtol=0)


def test_the_plain_torch_log_probs_agree_with_the_kernel(tmp_path):
    """The four scripts imported from a folder with rlhf_runtime/ and without rlhf_kernels: each takes its own plain
    torch log-probs (the same in each), and the rlhf_runtime/ beside it; ppo.py's response_logprobs (and entropy) on
    the embedded policy equal the repository's within 1e-5, and so do their gradients."""
    alone = copied_project(tmp_path / "project", *EVERY_SCRIPT)
    code = f"""
import torch
from transformers import AutoModelForCausalLM

import dapo
import grpo
import ppo
import rloo

logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(1))
tokens = torch.randint(50, (3, 7), generator=torch.Generator().manual_seed(2))
for module in (ppo, grpo, rloo, dapo):
    assert module.token_logprobs.__module__ == module.__name__, (module.__name__, module.token_logprobs.__module__)
    assert module.runtime.__file__ == {str(alone / "rlhf_runtime" / "__init__.py")!r}, module.runtime.__file__
    plain = module.token_logprobs(logits, tokens, 0.7, return_entropy=True)
    for got, want in zip(plain, ppo.token_logprobs(logits, tokens, 0.7, return_entropy=True)):
        assert torch.equal(got, want), module.__name__  # the same plain path in each script
policy = AutoModelForCausalLM.from_pretrained({os.path.join(ROOT, "assets", "tiny-sft")!r}).eval()
g = torch.Generator().manual_seed(0)
ids = torch.randint(3, policy.config.vocab_size, (4, 12), generator=g)
mask = torch.ones_like(ids)
mask[0, :3] = 0
mask[1, -2:] = 0
out = {{}}
for T in (1.0, 0.7):
    logprobs, entropy = ppo.response_logprobs(policy, ids, mask, 5, T, return_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()
    out[T] = (logprobs, entropy, policy.lm_head.weight.grad.clone())
    policy.zero_grad()
torch.save((ids, mask, out), "out.pt")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=alone, env=ALONE, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ids, mask, out = torch.load(alone / "out.pt")
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft")).eval()
    assert ppo.token_logprobs.__module__.startswith("rlhf_kernels")
    for T, (logprobs, entropy, grad) in out.items():
        expected = ppo.response_logprobs(policy, ids, mask, 5, T, return_entropy=True)
        (expected[0].sum() + expected[1].sum()).backward()
        torch.testing.assert_close(logprobs, expected[0].detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, expected[1].detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(grad, policy.lm_head.weight.grad, atol=1e-4, rtol=1e-3)  # summed over tokens
        policy.zero_grad()


def test_a_script_copied_without_rlhf_runtime_stops_naming_the_folder_to_copy(tmp_path, monkeypatch):
    """Copied alone, without rlhf_runtime/ beside it, a script stops at once in one sentence that names the folder to
    copy: exit code 1, no traceback, nothing created. ppo.py is run so, as a user runs it; every script (each holds its
    own copy of that import) is executed here with rlhf_runtime not to be found, and stops with that sentence."""
    alone = copied_project(tmp_path / "project", "ppo.py", runtime=False)
    done = run(alone / "ppo.py", alone, "--output_dir", str(tmp_path / "run"))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    (sentence,) = done.stderr.strip().splitlines()
    assert "needs the folder rlhf_runtime/ beside it" in sentence
    assert str(alone / "ppo.py") in sentence
    assert not (tmp_path / "run").exists()
    monkeypatch.setitem(sys.modules, "rlhf_runtime", None)  # `import rlhf_runtime` fails: ModuleNotFoundError
    for script in SCRIPTS:
        with pytest.raises(SystemExit) as stopped:
            runpy.run_path(os.path.join(ROOT, script), run_name="copied")
        assert stopped.value.code == sentence.replace(str(alone / "ppo.py"), os.path.join(ROOT, script))


# the defaults are looked for by check_common_args, in rlhf_runtime/settings.py: the same code for every script
@pytest.mark.parametrize("script", ["ppo.py"])
def test_a_copied_script_without_its_example_names_the_options_to_pass(script, tmp_path):
    copied_project(tmp_path / "project", script)
    done = run(tmp_path / "project" / script, tmp_path / "project", "--output_dir", str(tmp_path / "run"))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "huggingface.co" not in done.stdout + done.stderr
    (sentence,) = done.stderr.strip().splitlines()
    assert "--model_name_or_path" in sentence
    assert "--dataset" in sentence
    assert "not beside this file" in sentence
    assert not (tmp_path / "run").exists()


def test_the_repository_script_run_from_another_folder_finds_its_example(tmp_path):
    """`python /abs/path/ppo.py` from elsewhere reads the embedded example beside the script, not the working folder."""
    tiny = tiny_run("ppo.py", total_episodes=16, response_length=8, eval_every=0)  # two iterations
    done = run(os.path.join(ROOT, "ppo.py"), tmp_path, *tiny, "--output_dir=run")
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.load(open(tmp_path / "run" / "args.json"))
    assert saved["model_name_or_path"] == os.path.join(ROOT, "assets", "tiny-sft")
    assert saved["dataset"] == os.path.join(ROOT, "assets", "reviews", "train.jsonl")
    assert len(open(tmp_path / "run" / "metrics.jsonl").readlines()) == 2


@pytest.mark.parametrize("offline", [True, False])
def test_a_model_that_cannot_be_had_fails_at_once(offline, tmp_path):
    """Neither a folder nor reachable: with HF_HUB_OFFLINE set at once, or with no hub answering (an endpoint whose
    port is closed) after huggingface_hub's own retries, one sentence."""
    env = {k: v for k, v in ALONE.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")}
    if offline:
        env.update(HF_HUB_OFFLINE="1")
    else:
        env.update(HF_ENDPOINT="http://127.0.0.1:9")
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "ppo.py"),
            "--model_name_or_path=nobody/no-model",
            "--output_dir",
            str(tmp_path / "run"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    if offline:
        assert "Retrying" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("--model_name_or_path 'nobody/no-model' could not be found")


# ---------------------------------------------------------------- bad options, in one sentence


# The checks every script shares: rlhf_runtime's (settings.check_common_args, the output folder's lock, the reward
# functions' loading, find_checkpoint), the same code whichever script calls it.
SHARED_BAD = [
    (dict(model_name_or_path="/nonexistent/model"), "could not be found"),
    (dict(temperature=0.0), "--temperature must be positive"),
    (dict(reward_model_path=(), reward_fn=()), "no reward"),
    (dict(reward_fn=("nope",)), "unknown --reward_fn"),
    (dict(micro_batch_size=0), "--micro_batch_size must be at least 1"),
    (dict(num_epochs=0), "--num_epochs must be at least 1"),
    (dict(response_length=0), "--response_length must be at least 1"),
    (dict(max_grad_norm=-1.0), "--max_grad_norm must be positive"),
    (dict(save_every=-1), "--save_every must be 0 \\(never\\) or more"),
    (dict(keep_checkpoints=0), "--keep_checkpoints must be at least 1"),
    (dict(max_bad_steps=0), "--max_bad_steps must be at least 1"),
    (
        dict(resume="/nonexistent/checkpoint-3"),
        "--resume '/nonexistent/checkpoint-3' does not exist; pass a checkpoint",
    ),
    (dict(resume=f"{ROOT}/assets"), f"--resume '{re.escape(ROOT)}/assets' is not a whole checkpoint: its manifest"),
    (dict(minibatch_size=8, micro_batch_size=3), "must divide the per-process minibatch"),
    (dict(output_dir="/proc/no/such/run"), "--output_dir '/proc/no/such/run' cannot be created or written to"),
    # non-finite floats pass every comparison but "finite"; a seed past 9e12 overflows the generator's 64 bits
    (dict(kl_coef=float("inf")), "--kl_coef must be finite and within \\+-3.4e\\+38 \\(got inf\\)"),
    (dict(temperature=float("inf")), "--temperature must be finite"),
    (dict(ent_coef=float("nan")), "--ent_coef must be finite and within \\+-3.4e\\+38 \\(got nan\\)"),
    (dict(kl_coef=1e39), "--kl_coef must be finite and within \\+-3.4e\\+38 \\(got 1e\\+39\\)"),  # inf in float32
    (dict(lora_alpha=float("inf")), "--lora_alpha must be finite"),
    (dict(seed=2 * 10**13), "--seed must lie in \\[0, 9e12\\]"),
    (dict(seed=2**63 - 1), "--seed must lie in"),
    (
        dict(model_name_or_path=os.path.join(ROOT, "assets", "tiny-sft", "config.json")),
        "--model_name_or_path '.*config.json' is a file; pass the folder that holds the model",
    ),
    (
        dict(rollout_batch_size=3, world_size=2, minibatch_size=4, micro_batch_size=2),
        "--rollout_batch_size must be a multiple of the 2 processes \\(each samples whole groups of prompts\\) "
        "\\(got 3\\)",
    ),
]


# Each script's own: its validate's rules, and the responses per iteration it hands the shared checks.
OWN_BAD = [
    (dict(total_episodes=4), "must be at least one rollout"),
    (dict(learning_rate=0.0), "--learning_rate must be positive"),
    (dict(kl_coef=-0.1), "--kl_coef must be zero or more"),
    (dict(num_generations=1), "--num_generations must be at least 2"),
]


# One script suffices for the shared checks (the same code for all); grpo.py's groups make the world-size rule's
# sentence the one a reader of it expects.
@pytest.mark.parametrize("kw,message", SHARED_BAD, ids=lambda x: str(x)[:40] if isinstance(x, dict) else None)
def test_bad_arguments_fail_with_one_sentence_in_the_shared_checks(kw, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        set_up(grpo, args_for("grpo.py", tmp_path / "run", **kw))


@pytest.mark.parametrize("script", list(MODULES))
@pytest.mark.parametrize("kw,message", OWN_BAD, ids=lambda x: str(x)[:40] if isinstance(x, dict) else None)
def test_bad_arguments_fail_with_one_sentence_in_every_script(script, kw, message, tmp_path):
    if "num_generations" in kw and script == "ppo.py":
        pytest.skip("ppo.py has no groups")
    with pytest.raises(SystemExit, match=message):
        set_up(MODULES[script], args_for(script, tmp_path / "run", **kw))


def test_a_float_option_must_fit_in_float32():
    """1e308 is finite in Python and inf in a float32 tensor: --clip_range_high 1e308 is refused in one sentence
    (before, the first step's torch.clamp overflowed: a traceback); float32's largest passes that check."""
    most = torch.finfo(torch.float32).max
    for value in (1e308, 3.5e38, float("inf")):
        with pytest.raises(SystemExit, match=r"^--clip_range_high must be finite and within \+-3.4e\+38 \(got "):
            grpo.validate(make_args(grpo, clip_range_high=value, eval_every=0))
    try:
        grpo.validate(make_args(grpo, clip_range_high=most, ent_coef=most, eval_every=0))
    except SystemExit as e:  # another rule of the option may refuse it, never its range
        assert "within +-" not in str(e.code)


# One script suffices: the three are fields of the run's settings (rlhf_runtime.settings.RunSettings), the same
# dataclass in every script's Args.
@pytest.mark.parametrize("script", ["ppo.py"])
def test_the_command_line_refuses_a_choice_it_does_not_offer(script, capsys):
    """--model_dtype, --decode and --on_reward_error are Literal fields: tyro refuses another value and names the
    choices, before anything runs."""
    for option, value in (("--model_dtype", "float64"), ("--decode", "fast"), ("--on_reward_error", "ignore")):
        with pytest.raises(SystemExit) as stopped:
            tyro.cli(MODULES[script].Args, args=[option, value], use_underscores=True)
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert value in err
        assert option in err


# ---------------------------------------------------------------- what a run shows, and the outside world


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("script", list(MODULES))
def test_a_terminal_gets_a_live_progress_bar_and_a_log_file_only_lines(script, tmp_path, monkeypatch, capsys):
    """In a terminal, a tqdm bar counts the iterations with the time left and the live objective; redirected to a
    file, stderr gets no bar; either way stdout has one line per iteration (8 responses each: 3 iterations)."""
    cases = [("terminal", Terminal()), ("file", io.StringIO())]
    if script != "ppo.py":  # each script's bar shows its own objective; what a file gets is the plumbing's, shown once
        cases = cases[:1]
    for where, stderr in cases:
        monkeypatch.setattr(sys, "stderr", stderr)
        MODULES[script].main(args_for(script, tmp_path / where, total_episodes=24))
        assert [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("iter ")] == [
            "1/3",
            "2/3",
            "3/3",
        ]
        bar = stderr.getvalue()
        if where == "terminal":
            # done, with the objective and the time left
            assert "3/3" in bar
            assert "score=" in bar
            assert "kl=" in bar
            assert "<00:00" in bar
        else:
            assert "3/3" not in bar


def test_a_warning_is_one_line_with_its_category_and_no_source_line(tmp_path):
    """Python's default shows the warning's file and line, then that line of the script's source; a user reads the
    category and the message alone, on one line (here --eval_every with no held-out set beside the data)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(open(os.path.join(ROOT, "assets", "arithmetic", "train.jsonl")).readlines()[:4]))
    run = [*tiny_run("grpo.py", total_episodes=8, response_length=4), f"--dataset={data}", "--eval_every=5"]
    result = finished(script_command("grpo.py", tmp_path / "run", run))
    assert result.returncode == 0, result.stderr[-3000:]
    said = "UserWarning: --eval_every 5: no held-out set (pass --eval_dataset); nothing is evaluated."
    assert said in result.stderr.splitlines(), result.stderr[-3000:]
    assert "load_task(" not in result.stderr  # the line of main that called it


def test_no_socket_is_opened_when_every_path_is_local(tmp_path):
    log = tmp_path / "sockets.log"
    prelude = tmp_path / "watch_sockets.py"
    prelude.write_text(f"""import runpy
import sys

log = open({str(log)!r}, "w")
def hook(event, args):  # every socket operation passes through the audit hook, whichever library does it
    if event.startswith("socket."):
        log.write(f"{{event}} {{args!r}}\\n")
        log.flush()
sys.addaudithook(hook)
sys.argv = sys.argv[1:]
sys.path.insert(0, {ROOT!r})
runpy.run_path(sys.argv[0], run_name="__main__")
""")
    opens = tmp_path / "opens.py"
    opens.write_text("import socket\nsocket.socket().close()\n")
    subprocess.run([sys.executable, str(prelude), str(opens)], check=True)
    assert "socket.__new__" in log.read_text()  # the watch sees a socket when there is one
    # not even told to stay offline
    env = {k: v for k, v in ENV.items() if not k.startswith(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))}
    args = cli("ppo.py", total_episodes=16, eval_every=1)
    result = finished(script_command("ppo.py", tmp_path / "run", args, (sys.executable, str(prelude))), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert log.read_text() == ""


def test_track_on_a_node_without_network_logs_offline_for_a_later_sync(tmp_path):
    """--track with WANDB_MODE=offline, as docs/long-runs.md says to set on a node without network."""
    env = {**ENV, "WANDB_MODE": "offline", "WANDB_BASE_URL": "http://127.0.0.1:9"}  # nothing listens on port 9
    args = ["--track", *cli("rloo.py", total_episodes=8), "--log_samples_every=1"]
    result = finished(script_command("rloo.py", tmp_path, args), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = [tmp_path / "wandb" / n for n in os.listdir(tmp_path / "wandb") if n.startswith("offline-run-")]
    # what a later `wandb sync` uploads: the code, the sample tables, and (in the run's record) the config and the
    # metrics
    assert (run / "files" / "code" / "rloo.py").read_text() == open(os.path.join(ROOT, "rloo.py")).read()
    tables = os.listdir(run / "files" / "media" / "table")
    assert any(t.startswith("samples_") for t in tables)
    assert json.load(open(run / "files" / "media" / "table" / tables[0]))["columns"] == ["prompt", "response", "score"]
    record = next(run.glob("run-*.wandb")).read_bytes()
    assert b"num_generations" in record
    assert b"objective/kl" in record


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    """A new user's machine: a home with no netrc file and no wandb settings, no WANDB_ variable; wandb's settings
    read afresh (wandb.teardown) before and after. Yields the environment of a script's run there (as helpers.ENV)."""
    import wandb

    for name in list(os.environ):
        if name.startswith("WANDB_") or name in ("NETRC", "XDG_CONFIG_HOME"):
            monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)  # no wandb/settings of a working folder
    wandb.teardown()
    yield {k: v for k, v in os.environ.items() if k != "USE_HUB_KERNELS"}
    wandb.teardown()


def test_track_without_a_wandb_login_is_one_sentence_before_any_model_loads(tmp_path, no_wandb_login):
    """wandb's own ending was a UsageError's traceback, after the models loaded."""
    args = ["--track", *tiny_run("grpo.py", total_episodes=8)]
    result = finished(script_command("grpo.py", tmp_path / "run", args), env=no_wandb_login)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        "--track: wandb finds no API key here (`wandb login` was never run on this machine); run `wandb login`, set "
        "WANDB_API_KEY, or set WANDB_MODE=offline to log locally (`wandb sync` uploads the run later)."
    ]
    assert not (tmp_path / "run").exists()  # nothing made, no model loaded


KEY = "0123456789" * 4  # of the form of an API key (40 characters); never sent anywhere


@pytest.mark.parametrize(
    "variables,said",
    [
        (dict(WANDB_MODE="offline"), None),
        (dict(WANDB_MODE="disabled"), None),
        (dict(WANDB_API_KEY=KEY), None),
        (dict(NETRC="{netrc}"), None),  # `wandb login`'s file
        (dict(WANDB_MODE="online"), "--track: wandb finds no API key here"),
        (dict(WANDB_MODE=""), "--track: WANDB_MODE is '', not a mode of wandb; set it to online, offline"),
        (dict(WANDB_MODE="ofline"), "--track: WANDB_MODE is 'ofline', not a mode of wandb"),
        (dict(WANDB_API_KEY="abc"), "--track: wandb cannot use its credentials (WANDB_API_KEY invalid: API key"),
    ],
    ids=["offline", "disabled", "key", "netrc", "online", "mode empty", "mode misspelt", "key too short"],
)
def test_the_wandb_check_passes_offline_or_with_a_key_and_names_a_bad_mode(
    variables, said, tmp_path, no_wandb_login, monkeypatch
):
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {KEY}\n")
    for name, value in variables.items():
        monkeypatch.setenv(name, value.format(netrc=netrc))
    if said is None:
        rlhf_runtime.settings.check_wandb_login()
    else:
        with pytest.raises(SystemExit, match=re.escape(said)):
            rlhf_runtime.settings.check_wandb_login()


# ---------------------------------------------------------------- the fresh install


def test_no_local_package_shadows_an_installed_one():
    installed = importlib.metadata.packages_distributions()  # top-level import name -> distributions providing it
    local = [d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))]
    assert "rlhf_kernels" in local
    clashes = {name: installed[name] for name in local if name in installed}
    assert not clashes, f"these folders have the import name of installed distributions: {clashes}"


def test_transformers_hub_kernels_and_ppo_import_together():
    try:
        hub_kernels = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed (transformers before 5.25 does not require it)")
    # From the project root, where a local kernels/ would come first on sys.path.
    code = "\n".join(
        [
            "import os",
            "import transformers.integrations.hub_kernels",
            "import ppo",
            "import kernels",
            "from kernels import Mode",
            "print(os.path.dirname(os.path.abspath(kernels.__file__)))",
        ]
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == str(hub_kernels.locate_file("kernels")), (
        f"'kernels' was not the installed distribution: {result.stdout}"
    )
