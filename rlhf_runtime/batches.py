"""Batches: left-padded prompts, each process's share of draws made for all, micro-batches of similar lengths cut to
the columns they use, position ids, a classifier's head at every position, and rounds of rows joined into one batch.
The guarantee: padding never changes a real token's output, and no response depends on its batch or process count.
"""

import torch


def left_pad(sequences, pad_token_id, device, width=None):
    """Token lists to a left-padded (B, width) tensor (width: the longest by default) and its attention mask."""
    if width is None:
        width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def row_uniforms(rng, rows, response_length, world_size, rank):
    """This process's rows of uniforms drawn for all: a response never depends on the number of processes."""
    return torch.rand(rows * world_size, response_length, generator=rng)[rank * rows : (rank + 1) * rows]


def by_length(rows, attention_mask):
    """The rows (n,) shortest first, so that each micro-batch holds similar lengths and cut_padding cuts it more."""
    return rows[attention_mask[rows].sum(1).argsort(stable=True)]


def cut_padding(batch, P):
    """A micro-batch of (B, P + T), (B, T) and (B,) tensors without the columns none of its rows uses, and its new P:
    the real tokens keep their position ids, so every forward gives them the same outputs."""
    L = batch["attention_mask"].shape[1]
    start, last = batch["attention_mask"].any(0).nonzero()[[0, -1], 0].tolist()  # the first and last used columns
    cut = {}
    for key, x in batch.items():
        if x.dim() == 1:  # (B,): one value per row
            cut[key] = x
        elif x.shape[1] == L:  # (B, P + T): the prompt's columns and the response's
            cut[key] = x[:, start : last + 1]
        else:  # (B, T): the response's columns alone
            cut[key] = x[:, : last + 1 - P]
    return cut, P - start


def in_chunks(forward, size, input_ids, attention_mask, P):
    """A no-grad forward(ids, mask, P') -> (b, T') over the rollout in cut chunks of size rows, similar lengths
    together (B x L x V logits at once would dwarf training's): (B, T), 0 past each chunk's T'."""
    out = torch.zeros(input_ids.shape[0], input_ids.shape[1] - P, device=input_ids.device)  # (B, T)
    for rows in by_length(torch.arange(len(input_ids), device=input_ids.device), attention_mask).split(size):
        chunk, p = cut_padding(dict(input_ids=input_ids[rows], attention_mask=attention_mask[rows]), P)
        out[rows, : chunk["input_ids"].shape[1] - p] = forward(chunk["input_ids"], chunk["attention_mask"], p)
    return out


def position_ids_from(attention_mask):
    """Left padding shifts every prompt; positions (B, L) count real tokens only."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def head_outputs(model, input_ids, attention_mask):
    """A sequence classifier's scalar head at every position (B, L): the critic's values, or the reward model's score
    at the last token. A hook keeps every position's (the classifier returns one), the call going through FSDP."""
    kept = []

    def keep(module, inputs, output):
        kept.append(output)

    hook = model.score.register_forward_hook(keep)
    model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask))
    hook.remove()
    return kept[0].squeeze(-1).float()  # (B, L)


def join_rounds(rounds, pad_token_id):
    """Rounds of rows {key: (B_i, L_i) or (B_i,)} as one batch, each key padded to its longest: prompt_* keys on the
    left, the others on the right; token ids (*_ids) with pad_token_id, everything else with 0."""
    joined = {}
    for key in rounds[0]:
        width = max(rows[key].shape[-1] for rows in rounds)
        value = 0
        if key.endswith("_ids"):
            value = pad_token_id
        parts = []
        for rows in rounds:
            x = rows[key]
            gap = width - x.shape[-1]
            if x.dim() == 1:
                parts.append(x)
            elif key.startswith("prompt_"):
                parts.append(torch.nn.functional.pad(x, (gap, 0), value=value))
            else:
                parts.append(torch.nn.functional.pad(x, (0, gap), value=value))
        joined[key] = torch.cat(parts)
    return joined
