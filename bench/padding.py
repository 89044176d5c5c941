"""Where the training and scoring forwards compute on nothing: for each forward of an iteration (the policy's
training passes, the reference, PPO's critic, the reward model, generation's prefill), the positions it computes
against the real tokens (prompt and response) it holds, and the positions whose logits no loss reads. The first step
of computing on real tokens only: it measured the waste before any code changed, and says what the scripts compute
now that each micro-batch is cut to the columns its rows use.

    python bench/padding.py --out bench/padding.md              # the three defaults and the long-tailed shape
    python bench/padding.py --policy runs/ppo --scripts ppo.py  # a trained policy (its responses are longer)

The defaults sample real rollouts with the functions each script calls (rlhf_runtime's data order, left padding and
per-row uniforms, the script's generate, the same seed), from the embedded SFT policy or --policy. The long-tailed
shape is GSM8K-like lengths drawn at random (prompts of 100 to 300 tokens, responses of 20 to 1,024, log-uniform; 64
prompts x 5, the GSM8K recipe of docs/recipes.md), so no model is needed. Three layouts are compared for the
training forwards:
- padded: every micro-batch padded to the rollout's widest prompt plus its longest response (the scripts before
  the forwards were cut);
- cut: each micro-batch (in the shuffled order of training) cut to its own widest prompt and longest response;
- sorted and cut: the same after sorting the rows by length, so that a micro-batch holds similar lengths: what the
  scripts now do for the rollout's no-grad forwards (the reference, the critic's values, the reward model);
- now, training: each shuffled minibatch sorted by length, its micro-batches cut: what the training passes now do
  (the minibatch is drawn at random, so only its own rows can be sorted);
packing (the real tokens of several rows in one row) computes exactly the real tokens: 1.00 by definition.
"""

import argparse
import importlib
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import rlhf_runtime as runtime  # noqa: E402
from rlhf_runtime.settings import RunSettings  # noqa: E402


def micro_batches(order, size):
    return [order[i : i + size] for i in range(0, len(order), size)]


def layouts(prompt_lens, response_lens, micro, minibatch=None, seed=0):
    """Positions computed by a forward over the whole rollout in micro-batches: today, cut per micro-batch (shuffled
    order), sorted by length then cut, and each shuffled minibatch sorted then cut per micro-batch."""
    B = len(prompt_lens)
    today = B * (max(prompt_lens) + max(response_lens))
    shuffled = torch.randperm(B, generator=torch.Generator().manual_seed(seed)).tolist()
    by_length = sorted(range(B), key=lambda i: prompt_lens[i] + response_lens[i])
    within = [
        i
        for mb in micro_batches(shuffled, minibatch or B)
        for i in sorted(mb, key=lambda i: prompt_lens[i] + response_lens[i])
    ]

    def cut(order):
        return sum(
            len(mb) * (max(prompt_lens[i] for i in mb) + max(response_lens[i] for i in mb))
            for mb in micro_batches(order, micro)
        )

    return today, cut(shuffled), cut(by_length), cut(within)


def measured(prompt_lens, response_lens, micro, group=1, minibatch=None):
    """What one rollout's forwards compute, per real token (prompt and response): today, cut per micro-batch, sorted
    then cut; the padding's share today; the share of the LM head's (and critic's) positions whose output no loss
    reads, and the reward model's (it reads one per row); the prefill's positions per distinct prompt token (its
    padding, and a group's prompt encoded once per response), before and now (each group's prompt once). Rows hold
    consecutive groups of `group` responses."""
    real = sum(prompt_lens) + sum(response_lens)
    today, cut, sorted_cut, training = layouts(prompt_lens, response_lens, micro, minibatch)
    prefill = len(prompt_lens) * max(prompt_lens)  # every row, left-padded to the widest prompt
    return dict(
        today=today / real,
        padding=1 - real / today,
        cut=cut / real,
        sorted_cut=sorted_cut / real,
        training=training / real,
        unread=1 - sum(response_lens) / today,
        unread_rm=1 - len(prompt_lens) / today,
        prefill=prefill / (sum(prompt_lens) / group),
        prefill_now=prefill / sum(prompt_lens),
    )


@torch.no_grad()
def rollout_lengths(script, policy_path, rollouts):
    """Prompt and response lengths of the first rollouts of a script's default run, sampled as the script samples."""
    module = importlib.import_module(script[:-3])
    args = module.Args(run=RunSettings(eval_every=0))  # nothing is written: the data and the policy are read
    run = args.run
    if policy_path:
        run.model_name_or_path = policy_path
    run.world_size = 1
    device = torch.device("cpu")
    tokenizer, prompts, _, _, stop_ids = runtime.load_task(args, device)
    # the plain loop, on any device
    sampling = module.Sampling(args.response_length, args.temperature, stop_ids, tokenizer.pad_token_id, False)
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(run.model_name_or_path).eval()
    G = getattr(args, "num_generations", 1)
    position = (0, 0)
    prompt_lens = []
    response_lens = []
    for iteration in range(1, rollouts + 1):
        idx, width, position = runtime.next_prompts(
            prompts, position, args.rollout_batch_size, run.seed, run.world_size, 0
        )
        idx = [i for i in idx for _ in range(G)]
        prompt_ids, prompt_mask = runtime.left_pad([prompts[i] for i in idx], tokenizer.pad_token_id, device, width)
        rng = torch.Generator().manual_seed(run.seed * 1_000_000 + iteration)
        uniforms = runtime.row_uniforms(rng, len(idx), args.response_length, run.world_size, 0)
        _, _, response_mask = module.generate(policy, prompt_ids, prompt_mask, sampling, uniforms)
        prompt_lens.append(prompt_mask.sum(1).tolist())
        response_lens.append(response_mask.sum(1).tolist())
    return args, G, prompt_lens, response_lens


def long_tailed(seed=0, prompts=64, group=5):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, 301, (prompts,), generator=g).repeat_interleave(group).tolist()
    response = torch.exp(
        torch.empty(prompts * group).uniform_(
            torch.log(torch.tensor(20.0)).item(), torch.log(torch.tensor(1024.0)).item(), generator=g
        )
    )
    return prompt, response.round().long().tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", nargs="+", default=["ppo.py", "grpo.py", "rloo.py"])
    parser.add_argument("--policy", default=None, help="a trained policy folder instead of the embedded SFT one")
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts sampled per script")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    a = parser.parse_args()
    rows = []
    for script in a.scripts:
        args, G, prompt_lens, response_lens = rollout_lengths(script, a.policy, a.rollouts)
        each = [
            measured(p, r, args.micro_batch_size, G, args.minibatch_size) for p, r in zip(prompt_lens, response_lens)
        ]
        lengths = [x for r in response_lens for x in r]
        rows.append(
            (
                f"`{script}` default{' (' + a.policy + ')' if a.policy else ''}, {a.rollouts} rollouts of "
                f"{len(response_lens[0])}",
                f"{sum(lengths) / len(lengths):.1f} ({max(lengths)})",
                {k: sum(m[k] for m in each) / len(each) for k in each[0]},
                bool(args.reward_model_path),
            )
        )
    p, r = long_tailed()
    rows.append(
        (
            "GSM8K-like: prompts of 100 to 300 tokens, 64 x 5",
            f"{sum(r) / len(r):.0f} ({max(r)})",
            measured(p, r, 8, 5, 320),
            False,
        )
    )
    lines = [
        "| setting | response length, mean (max) | training-shaped forwards: positions per real token, padded "
        "(before the cut) | padding share, padded | cut per micro-batch | sorted, then cut (now: the no-grad "
        "forwards) | now: training (each minibatch sorted, cut) | policy, reference, critic: outputs no loss "
        "reads | reward model: outputs no loss reads | prefill: positions per distinct prompt token, before | "
        "prefill, now (a group's prompt once) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, length, m, rm in rows:
        rm_cell = f"{m['unread_rm']:.0%}" if rm else "-"
        lines.append(
            f"| {name} | {length} | {m['today']:.2f} | {m['padding']:.0%} | {m['cut']:.2f} | "
            f"{m['sorted_cut']:.2f} | {m['training']:.2f} | {m['unread']:.0%} | {rm_cell} | "
            f"{m['prefill']:.2f} | {m['prefill_now']:.2f} |"
        )
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as f:
            f.write(__doc__.split("\n\n")[0] + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
