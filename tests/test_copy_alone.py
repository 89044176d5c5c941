"""A script is a file a reader copies into their own project. Copied alone into an empty folder it still runs: the
log-probs come from its plain torch path (no rlhf_kernels beside it), the embedded example is looked for beside the
script (and missing, one sentence names the options to pass), and a model that cannot be had fails at once."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import ENV, ROOT, tiny_run
from safetensors.torch import load_file

import dapo
import grpo
import ppo
import rloo

MODULES = {"ppo.py": ppo, "grpo.py": grpo, "rloo.py": rloo, "dapo.py": dapo}
ALONE = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}  # nothing of the repository on the path
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


@pytest.mark.parametrize("script", list(MODULES))
def test_a_script_copied_alone_trains_as_in_the_repository(script, tmp_path):
    alone = tmp_path / "project"
    alone.mkdir()
    shutil.copy(os.path.join(ROOT, script), alone)
    copied = run(alone / script, alone, *two_iterations(script), "--output_dir", str(tmp_path / "copied"))
    assert copied.returncode == 0, copied.stderr[-3000:]
    assert (copied.stdout + copied.stderr).count(KERNEL_LINE) == 1
    here = run(os.path.join(ROOT, script), ROOT, *two_iterations(script), "--output_dir", str(tmp_path / "here"))
    assert here.returncode == 0, here.stderr[-3000:]
    assert KERNEL_LINE not in here.stdout + here.stderr
    # The same samples and scores (the sampler does not use the kernel), and the same training to float rounding.
    rows = [[json.loads(line) for line in open(tmp_path / folder / "metrics.jsonl")] for folder in ("copied", "here")]
    assert [r["objective/score"] for r in rows[0]] == [r["objective/score"] for r in rows[1]]
    for a, b in zip(*rows):
        assert a["policy/approx_kl"] == pytest.approx(b["policy/approx_kl"], rel=1e-3, abs=1e-7)
    trained = [load_file(tmp_path / folder / "model.safetensors") for folder in ("copied", "here")]
    for name, weight in trained[1].items():
        torch.testing.assert_close(trained[0][name], weight, atol=1e-5, rtol=0)


def test_the_plain_torch_log_probs_agree_with_the_kernel(tmp_path):
    """ppo.py imported from a folder without rlhf_kernels: its response_logprobs (and entropy) on the embedded policy
    equal the repository's within 1e-5, and so do their gradients."""
    alone = tmp_path / "project"
    alone.mkdir()
    shutil.copy(os.path.join(ROOT, "ppo.py"), alone)
    code = f"""
import torch
from transformers import AutoModelForCausalLM

import ppo

assert ppo.token_logprobs.__module__ == "ppo", ppo.token_logprobs.__module__
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


@pytest.mark.parametrize("script", list(MODULES))
def test_a_copied_script_without_its_example_names_the_options_to_pass(script, tmp_path):
    shutil.copy(os.path.join(ROOT, script), tmp_path)
    done = run(tmp_path / script, tmp_path, "--output_dir", str(tmp_path / "run"))
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
