"""grpo_tools.py: conversations with tools on the embedded default (assets/tiny-tools calls its multiply tool on some
of the products it is asked). The log-probs recorded while sampling are the teacher-forced ones over the whole
conversation, the tools' tokens train nothing (their gradient is exactly 0), a row converses as it would alone, a run
logs what its tools did and hands the reward the whole conversation, a stop in the middle of a tool's call resumes as
the run never stopped, two processes compute what one computes, and bad arguments are refused before a model loads."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from helpers import (
    ALONE,
    ROOT,
    assert_bitwise_equal,
    assert_rows_agree,
    assert_same_model,
    final_state,
    launch,
    make_args,
    read_rows,
    resume_as_printed,
    run_main,
    run_torchrun,
    wait_for,
    without_timing,
)

import grpo_tools
import rlhf_runtime as runtime

MODEL = os.path.join(ROOT, "assets", "tiny-tools")
TRAIN = os.path.join(ROOT, "assets", "multiply", "train.jsonl")
TEST = os.path.join(ROOT, "assets", "multiply", "test.jsonl")
# 4 prompts x 4 responses an iteration, one minibatch of two micro-batches; the held-out set left out
SMALL = ["--rollout_batch_size=4", "--num_generations=4", "--minibatch_size=16", "--micro_batch_size=8"]


@pytest.fixture(scope="module")
def sampled():
    """32 conversations of the shipped policy with the shipped multiply tool: 8 prompts x 4, at T = 1."""
    args = make_args(grpo_tools, model_name_or_path=MODEL, dataset=TRAIN, eval_every=0, output_dir="unused")
    tools = runtime.load_tools(args.tools, args.tool_timeout)
    tokenizer, prompts, _, _, stop_ids = runtime.load_task(args, torch.device("cpu"), (), tools.schemas)
    policy, _, _ = grpo_tools.build_models(args, tokenizer, torch.device("cpu"))
    sampling = grpo_tools.Conversing(args.response_length, 1.0, stop_ids, tokenizer.pad_token_id)
    sampling.tools, sampling.tokenizer, sampling.max_turns = tools, tokenizer, args.max_turns
    idx = [i for i in range(8) for _ in range(4)]
    prompt_ids, prompt_mask = runtime.left_pad([prompts[i] for i in idx], tokenizer.pad_token_id, torch.device("cpu"))
    uniforms = torch.rand(len(idx), args.response_length, generator=torch.Generator().manual_seed(0))
    out = grpo_tools.converse(policy, prompt_ids, prompt_mask, sampling, uniforms)
    yield policy, tokenizer, sampling, prompt_ids, prompt_mask, uniforms, out
    for process in tools.processes.values():
        if process.process is not None:
            process.kill()


def test_the_conversations_hold_tool_turns_masked_out_of_the_policys_tokens(sampled):
    """Not vacuous: several conversations called the tool, and each tool message is where the template puts it, the
    tokens from <tool_response> to </tool_response>, with policy mask 0 and logprobs_old 0; every other real token is
    the policy's."""
    _, tokenizer, _, _, _, _, (responses, logprobs, response_mask, messages, turns) = sampled
    opening, closing = tokenizer.convert_tokens_to_ids(["<tool_response>", "</tool_response>"])
    called = 0
    for row in range(len(responses)):
        tokens = responses[row][response_mask[row].bool()].tolist()
        inside = torch.zeros(len(tokens), dtype=torch.long)  # 1 from each opening tag to its closing tag
        depth = 0
        for i, token in enumerate(tokens):
            depth += token == opening
            inside[i] = depth
            depth -= token == closing
        own = turns.policy_mask[row][: len(tokens)]
        assert torch.equal(own, 1 - inside), tokenizer.decode(tokens)
        assert (logprobs[row][: len(tokens)][inside.bool()] == 0).all()
        called += bool(inside.any())
        roles = [m["role"] for m in messages[row]]
        assert roles[0] == "assistant" and roles[-1] == "assistant"  # a tool message always has a turn after it
        assert roles.count("tool") == int(turns.counts["calls"][row])
    assert called >= 4, f"only {called} of 32 conversations called the tool"


def test_log_probs_at_sampling_are_the_teacher_forced_ones_over_the_whole_conversation(sampled):
    """The log-prob recorded for each of the policy's tokens, from the logits it was drawn from (a KV cache rebuilt
    each turn), against one forward over the prompt and the whole conversation: float32 logits of size ~10 computed in
    another order differ by ~1e-6, so 1e-5."""
    policy, _, _, prompt_ids, prompt_mask, _, (responses, logprobs, response_mask, _, turns) = sampled
    input_ids = torch.cat([prompt_ids, responses], 1)
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    with torch.no_grad():
        forced = grpo_tools.response_logprobs(policy, input_ids, attention_mask, prompt_ids.shape[1], 1.0)
    own = turns.policy_mask.bool()
    assert (forced[own] - logprobs[own]).abs().max().item() <= 1e-5
    assert (turns.policy_mask < response_mask).any()  # tool tokens were in the sequences compared


def test_each_row_converses_as_it_would_alone(sampled):
    """A row's draws are its own and its tools' answers depend on it alone, so it says the same alone as in a batch
    (what makes two processes sample what one does, and a resumed turn repeat)."""
    policy, _, sampling, prompt_ids, prompt_mask, uniforms, (responses, logprobs, _, messages, turns) = sampled
    for row in (0, 5, 13):  # rows of different prompts
        width = int(prompt_mask[row].sum())
        alone = grpo_tools.converse(
            policy,
            prompt_ids[row : row + 1, -width:],
            prompt_mask[row : row + 1, -width:],
            sampling,
            uniforms[row : row + 1],
        )
        assert torch.equal(alone[0][0], responses[row])
        assert torch.equal(alone[4].policy_mask[0], turns.policy_mask[row])
        assert alone[3][0] == messages[row]
        torch.testing.assert_close(alone[1][0], logprobs[row], atol=1e-5, rtol=0)


def test_a_tool_tokens_gradient_is_exactly_zero(tmp_path, monkeypatch):
    """One iteration of main with an entropy bonus and the KL term: the gradient reaching the logits at every position
    that predicts a tool's token (from <tool_response> to </tool_response>) is exactly 0, and not at the policy's."""
    captured = []  # (input_ids, gradient of the logits kept) of each training forward
    build = grpo_tools.build_models

    def hooked(args, tokenizer, device):
        policy, ref_policy, reward_models = build(args, tokenizer, device)

        def keep(module, inputs, kwargs, output):
            if torch.is_grad_enabled():
                ids = kwargs["input_ids"]
                output.logits.register_hook(lambda grad: captured.append((ids, grad)))

        policy.register_forward_hook(keep, with_kwargs=True)
        return policy, ref_policy, reward_models

    monkeypatch.setattr(grpo_tools, "build_models", hooked)
    run_main("grpo_tools.py", tmp_path / "run", *SMALL, "--total_episodes=16", "--ent_coef=0.01", "--eval_every=0")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    opening, closing = tokenizer.convert_tokens_to_ids(["<tool_response>", "</tool_response>"])
    tool_positions, policy_positions = 0, 0
    for ids, grad in captured:
        kept = grad.shape[1]  # the logits of the last `kept` positions: position i predicts token i + 1
        for row in range(len(ids)):
            tokens = ids[row].tolist()
            for j in range(kept - 1):
                predicted = len(tokens) - kept + 1 + j
                before = tokens[: predicted + 1]
                in_tool = before.count(opening) > before[:-1].count(closing)  # inside a tool message, its tags too
                if in_tool:
                    assert (grad[row, j] == 0).all(), tokenizer.decode(tokens[: predicted + 1])
                    tool_positions += 1
                elif grad[row, j].abs().sum() > 0:
                    policy_positions += 1
    assert tool_positions > 0 and policy_positions > 0


def test_a_run_logs_its_tools_and_hands_the_reward_the_whole_conversation(tmp_path):
    """The metrics of the tools, and the reward given each whole conversation: TRL's form as messages (assistant turns
    with their calls, the tools' answers), as TRL's trainer passes them; this project's as the text of every turn, the
    text the printed samples show."""
    seen = tmp_path / "seen.jsonl"
    reward = tmp_path / "rewards.py"
    reward.write_text(
        "import json\n"
        "def as_trl(prompts, completions, answer, **kwargs):\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(json.dumps(completions) + '\\n')\n"
        "    return [float(c[-1]['content'].strip() == a) for c, a in zip(completions, answer)]\n"
        "def as_text(responses, answers):\n"
        f"    with open({str(seen)!r} + '.text', 'a') as f:\n"
        "        f.write(json.dumps(responses) + '\\n')\n"
        "    return [0.0] * len(responses)\n"
    )
    rules = ["--reward_fn", f"{reward}:as_trl", f"{reward}:as_text"]
    rows, _ = run_main("grpo_tools.py", tmp_path / "run", *SMALL, "--total_episodes=32", "--eval_every=0", *rules)
    for key in ("tools/calls_per_response", "tools/parsed", "tools/failed", "tools/timed_out", "tools/used"):
        assert 0 <= rows[-1][key] <= (3 if key == "tools/calls_per_response" else 1), key
    assert sum(r["tools/calls_per_response"] for r in rows[1:]) > 0
    assert "tools/turns_per_response" in rows[-1] and "response/cut_by_length" in rows[-1]
    conversations = [c for line in seen.read_text().splitlines() for c in json.loads(line)]
    texts = [t for line in open(f"{seen}.text").read().splitlines() for t in json.loads(line)]
    assert len(conversations) == len(texts) == 32
    with_tools = [(c, t) for c, t in zip(conversations, texts) if any(m["role"] == "tool" for m in c)]
    assert with_tools, "no conversation with a tool turn reached the reward"
    for conversation, text in with_tools:
        call = conversation[0]["tool_calls"][0]["function"]
        assert conversation[1] == {"role": "tool", "name": "multiply", "content": conversation[1]["content"]}
        if call["name"] == "multiply" and set(call["arguments"]) == {"a", "b"}:
            assert conversation[1]["content"] == str(call["arguments"]["a"] * call["arguments"]["b"])
        # the text: each message's text in order, the template's tags around the tool's answer
        answers = "".join(f"<tool_response>{m['content']}</tool_response>" for m in conversation if m["role"] == "tool")
        assert answers in text and text.startswith(conversation[0]["content"])
        assert text.endswith(conversation[-1]["content"])


def slow_tools(folder, marker):
    """A --tools file whose multiply answers as the shipped one, slowly (0.5 s), saying each call in marker."""
    path = os.path.join(folder, "slow_tools.py")
    with open(path, "w") as f:
        f.write(
            "import time\n"
            "def multiply(a: int, b: int) -> int:\n"
            '    """Multiply two whole numbers.\n\n    Args:\n'
            '        a: the first factor\n        b: the second factor\n    """\n'
            f"    open({marker!r}, 'a').write('called\\n')\n"
            "    time.sleep(0.5)\n"
            "    return a * b\n"
        )
    return f"{path}:multiply"


def test_a_stop_in_the_middle_of_a_tools_call_resumes_as_the_run_never_stopped(tmp_path):
    """SIGTERM while a tool runs, in the second iteration: the call ends at once, the iteration is abandoned and a
    checkpoint of the first saved; the command printed goes on from it, and the run ends bitwise as one never stopped
    (the same conversations, the same weights and Adam states)."""
    args = [*SMALL, "--total_episodes=48", "--eval_every=0", "--save_every=1"]
    full = tmp_path / "full"
    full_rows, _ = run_main("grpo_tools.py", full, *args)
    marker = str(tmp_path / "calls")
    out = tmp_path / "stopped"
    proc = launch("grpo_tools.py", out, [*args, "--tools", slow_tools(tmp_path, marker)])
    wait_for(lambda: os.path.isdir(out / "checkpoint-1") and os.path.exists(marker), proc, timeout=300)
    before = open(marker).read().count("called")
    wait_for(lambda: open(marker).read().count("called") > before, proc, timeout=300)  # a call of iteration 2
    proc.send_signal(signal.SIGTERM)
    printed = proc.communicate(timeout=120)[0]
    assert "stopped after iteration 1; to go on:" in printed, printed[-3000:]
    assert not os.path.isdir(out / "checkpoint-2")
    resume_as_printed(printed, out / "checkpoint-1")  # the slow tool still: its answers are the shipped one's
    assert without_timing(read_rows(out)) == without_timing(full_rows)
    assert_bitwise_equal(final_state(out, 3), final_state(full, 3))


def test_two_processes_compute_what_one_computes(tmp_path):
    """As the other scripts (tests/test_distributed.py): each process converses on its rows with its own tool
    processes; the logged values and the weights agree to float32's rule (helpers.assert_rows_agree)."""
    held_out = tmp_path / "test.jsonl"
    held_out.write_text("".join(open(TEST).readlines()[:15]))
    args = [
        "--rollout_batch_size=4",
        "--num_generations=8",
        "--minibatch_size=16",
        "--micro_batch_size=4",
        "--total_episodes=96",
        "--num_epochs=2",
        "--save_every=1",
        "--eval_every=1",
        "--eval_batch_size=4",
        f"--eval_dataset={held_out}",
    ]
    rows_one, _ = run_main("grpo_tools.py", tmp_path / "one", *args)
    rows_two = run_torchrun("grpo_tools.py", tmp_path / "two", *args)
    assert_rows_agree(rows_two, rows_one)
    assert sum(r.get("tools/calls_per_response", 0) for r in rows_one) > 0  # tool turns were among what was compared
    assert_same_model(tmp_path / "two", tmp_path / "one")


@pytest.mark.parametrize(
    "option,message",
    [
        (["--max_turns=0"], "--max_turns must be at least 1"),
        (["--tool_timeout=-1"], "--tool_timeout must be zero or more"),
        (["--max_total_length=64"], "--max_total_length 64 leaves no room for a response"),
        (["--tools", "nowhere.py:multiply"], "--tools nowhere.py:multiply: 'nowhere.py' could not be loaded"),
        (["--tools", "assets/tools.py:divide"], "has no function 'divide'"),
    ],
)
def test_bad_arguments_are_refused_in_one_sentence_before_a_model_loads(option, message, tmp_path, monkeypatch):
    monkeypatch.setattr(grpo_tools, "build_models", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit, match=message):
        run_main("grpo_tools.py", tmp_path / "run", *option)


def test_copied_with_rlhf_runtime_it_runs_with_every_path_given(tmp_path):
    """As the README's Copying says: grpo_tools.py and rlhf_runtime/ copied into another project (without assets/ and
    rlhf_kernels/), run with the model, data, tools and reward given as paths."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(os.path.join(ROOT, "grpo_tools.py"), project)
    shutil.copytree(
        os.path.join(ROOT, "rlhf_runtime"), project / "rlhf_runtime", ignore=shutil.ignore_patterns("__pycache__")
    )
    tools = os.path.join(ROOT, "assets", "tools.py")
    given = [f"--model_name_or_path={MODEL}", f"--dataset={TRAIN}", "--tools", f"{tools}:multiply"]
    given += ["--reward_fn", f"{tools}:final_answer", *SMALL, "--total_episodes=16", "--eval_every=0"]
    done = subprocess.run(
        [sys.executable, "grpo_tools.py", "--output_dir", str(tmp_path / "run"), *given],
        cwd=project,
        env=ALONE,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tools/calls_per_response" in read_rows(tmp_path / "run")[-1]
    assert os.path.isfile(tmp_path / "run" / "model.safetensors")
