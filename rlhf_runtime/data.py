"""The data: rows read from a local file (.jsonl, .json, .csv, .tsv, .parquet, compressed or not) or a hub dataset,
prompts rendered and tokenised once, the tokens that end a response, the held-out set, and each iteration's prompts.
The guarantee: every row is checked before any model loads, and a bad one is named in one sentence with its fix;
every process draws the same shuffled order and takes its own slice.
"""

import json
import os
import pathlib
import re
import sys
import warnings

import torch
from transformers import AutoTokenizer, GenerationConfig

from rlhf_runtime.rewards import REWARD_FNS, answer_of, check_reward_columns


def load_task(args, device, reward_fns=(), tools=None):
    """The tokenizer, prompts and rows, held-out (prompts, rows) and the stop tokens (S,), before any model loads; the
    columns your reward functions read checked against each dataset's. It reads the task's options and the run's;
    tools: the schemas the chat template renders into every prompt (grpo_tools.py's)."""
    run = args.run
    tokenizer = AutoTokenizer.from_pretrained(run.model_name_or_path, padding_side="left")
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"the tokenizer of '{run.model_name_or_path}' has no EOS token; set and save one.")
    if tokenizer.pad_token_id is None:
        warnings.warn("the tokenizer has no pad token; using EOS as pad (the masks say what is padding).", stacklevel=2)
        tokenizer.pad_token = tokenizer.eos_token
    stop_ids = stop_token_ids(tokenizer, run.model_name_or_path).to(device)  # the chat template tried first
    prompts, rows = load_prompts(args.dataset, run.dataset_split, run, tokenizer, args.reward_fn, tools)
    check_reward_columns(reward_fns, rows, args.dataset, run.prompt_field, run.answer_field)
    eval_path = held_out_dataset(args.dataset, run.eval_dataset, run.eval_every)
    held_out = ([], [])
    if eval_path:
        held_out = load_prompts(eval_path, run.eval_split, run, tokenizer, args.reward_fn, tools)
        check_reward_columns(reward_fns, held_out[1], eval_path, run.prompt_field, run.answer_field)
    elif run.eval_every:
        message = f"--eval_every {run.eval_every}: no held-out set (pass --eval_dataset); nothing is evaluated."
        warnings.warn(message, stacklevel=2)
    return tokenizer, prompts, rows, held_out, stop_ids


def read_rows(path, split, prompt_field="prompt", dataset_config=None):
    """The rows (dicts) of a local .json/.jsonl, .csv/.tsv (every cell text) or .parquet file, or of a hub dataset."""
    local = re.search(r"\.(jsonl?|csv|tsv|parquet)(\.gz|\.bz2|\.xz|\.zst)?$", path, re.I)  # a file's kind, any case
    if local and not os.path.isfile(path):
        what = "does not exist"
        if os.path.isdir(path):
            what = "is a folder"
        elif os.path.exists(path):  # a FIFO, a device, a socket
            what = "is not a regular file"
        raise SystemExit(
            f"dataset file '{path}' {what}; pass a "
            f'file of {{"{prompt_field}": ...}} rows (.jsonl, .csv, .tsv, .parquet) or a hub dataset.'
        )
    if not local:  # a hub dataset's split
        from datasets import load_dataset

        try:
            return list(load_dataset(path, dataset_config, split=split))
        except Exception as e:  # datasets wraps a file's errors in its own
            raise SystemExit(
                f"hub dataset '{path}' could not be loaded ({type(e).__name__}: {e}); check its name, the split "
                f"'{split}', --dataset_config {dataset_config} and the network."
            ) from None
    import bz2  # the readers of compressed and tabular files, needed here alone
    import csv
    import gzip
    import io
    import lzma

    kind = local[1].lower()
    compression = (local[2] or "").lower()
    if compression == ".zst":
        raise SystemExit(
            f"dataset file '{path}' is compressed with zstd, which Python does not read without a package; "
            "decompress it (zstd -d), or compress it with gzip, bzip2 or xz."
        )
    raw = pathlib.Path(path).read_bytes()
    decompress = {".gz": gzip.decompress, ".bz2": bz2.decompress, ".xz": lzma.decompress}
    if compression:
        try:
            raw = decompress[compression](raw)
        except (OSError, EOFError, ValueError, lzma.LZMAError) as e:  # cut short (bz2: ValueError), of another kind
            raise SystemExit(f"dataset file '{path}' is not a whole {compression} file ({e}); check it.") from None
    if kind == "parquet":
        import pyarrow.parquet  # datasets' own reader of parquet

        try:
            return pyarrow.parquet.read_table(io.BytesIO(raw)).to_pylist()
        except Exception as e:  # pyarrow's errors are its own
            raise SystemExit(
                f"dataset file '{path}' could not be loaded ({type(e).__name__}: {e}); check its contents."
            ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise SystemExit(
            f"line {line} of '{path}' is not UTF-8 text (byte {raw[e.start]:#04x}); save it as UTF-8."
        ) from None
    if kind in ("csv", "tsv"):  # every cell as text, as a .jsonl's strings: "119" stays "119", "N/A" stays "N/A"
        csv.field_size_limit(sys.maxsize)  # a cell as long as memory holds (a grader's test cases), not 131,072
        stream = io.StringIO(text.removeprefix("\ufeff"), newline="")
        if kind == "csv":
            reader = csv.reader(stream)
            fix = "a cell holding ',' goes in double quotes"
        else:  # a .tsv: a row a line, every tab a separator, no quoting (a quote is text: a prompt's "...")
            reader = csv.reader(stream, delimiter="\t", quoting=csv.QUOTE_NONE)
            fix = "a .tsv cell holds no tab"
        rows = []
        try:
            header = next(reader, [])
            for cells in reader:
                if cells and len(cells) != len(header):
                    raise SystemExit(
                        f"line {reader.line_num} of '{path}' has {len(cells)} cells and its header "
                        f"{len(header)}; fix that line ({fix})."
                    )
                if cells:
                    rows.append(dict(zip(header, cells)))
        except csv.Error as e:
            raise SystemExit(f"line {reader.line_num} of '{path}' cannot be read ({e}); fix that line.") from None
        return rows
    whole = kind == "json" and text.lstrip().startswith("[")  # one JSON list, else an object a line
    lines = text.split("\n")  # never at U+2028, U+2029 or U+0085, which a JSON string may hold (splitlines splits)
    if whole:
        lines = [text]
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            parsed = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(
                f"line {number + e.lineno - 1} of '{path}' is not valid JSON ({e.msg}); fix that line."
            ) from None
        if whole:
            rows.extend(parsed)
        else:
            rows.append(parsed)
    return rows


def load_prompts(path, split, run, tokenizer, reward_fn=(), tools=None):
    """A dataset's prompts tokenised once and its rows (dicts, each with every column), every row checked before any
    model loads (the answers too where a built-in rule of reward_fn, the --reward_fn specs, compares with them). With
    tools (their schemas), every prompt is rendered by the chat template with them, a text as a user's turn."""
    rows = read_rows(path, split, run.prompt_field, run.dataset_config)
    if len(rows) == 0:
        raise SystemExit(f"dataset '{path}' is empty; pass a dataset with at least one prompt.")
    texts = []
    for n, row in enumerate(rows, 1):
        has = list(row) if isinstance(row, dict) else []
        if run.prompt_field not in has:
            raise SystemExit(
                f"dataset '{path}' has no '{run.prompt_field}' column in row {n} (it has "
                f"{has or type(row).__name__}); pass --prompt_field with the column of the prompts."
            )
        answer = answer_of(row, run.answer_field)
        if REWARD_FNS.keys() & set(reward_fn) and answer is None:  # yours may need none
            raise SystemExit(
                f"--reward_fn {' '.join(reward_fn)} needs an answer column, but row {n} of "
                f"'{path}' has no (or a null) '{run.answer_field}' (it has {has}); pass --answer_field."
            )
        if REWARD_FNS.keys() & set(reward_fn) and not isinstance(answer, (str, int, float)):  # not its repr
            raise SystemExit(
                f"row {n} of '{path}' has a {type(answer).__name__} as its '{run.answer_field}' ({answer!r:.80}); "
                "the built-in rules compare text or a number: store the answer as one."
            )
        prompt = row[run.prompt_field]
        chat = isinstance(prompt, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt)
        if not isinstance(prompt, str) and not chat:
            raise SystemExit(
                f"row {n} of '{path}' has a {type(prompt).__name__} as its prompt; a prompt is text or "
                'a list of {"role", "content"} messages.'
            )
        if isinstance(prompt, str):
            empty = not prompt.strip()
        else:
            empty = not any(str(m["content"]).strip() for m in prompt)
        if empty:
            raise SystemExit(f"row {n} of '{path}' has an empty prompt; remove that row.")
        if re.search("[\ud800-\udfff]", str(prompt)):  # half of a UTF-16 pair, which no tokenizer reads
            raise SystemExit(f"row {n} of '{path}' holds a lone surrogate (half of a UTF-16 pair); fix its text.")
        if (chat or run.chat_template or tools) and tokenizer.chat_template is None:
            fix = "drop --chat_template"
            if chat:  # the row holds messages, with --chat_template or without
                fix = "store the prompts as text"
            if tools:  # the template renders the tools and their calls
                fix = "give a model whose template renders tools (its docs name one)"
            raise SystemExit(
                f"row {n} of '{path}' needs a chat template, but the tokenizer of "
                f"'{run.model_name_or_path}' has none; save one with it (tokenizer_config.json's chat_template), "
                f"or {fix}."
            )
        if isinstance(prompt, str) and (run.chat_template or tools):  # --chat_template: the text as a user's turn
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, str):
            prompt = tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)
        texts.append(prompt)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    too_long = [i for i, p in enumerate(prompts) if len(p) > run.max_prompt_length]
    if too_long and not run.truncate_prompts:
        longest = max(too_long, key=lambda i: len(prompts[i]))
        raise SystemExit(
            f"{len(too_long)} prompts of '{path}' are longer than --max_prompt_length "
            f"{run.max_prompt_length} (the first is row {too_long[0] + 1}; the longest, row "
            f"{longest + 1}, has {len(prompts[longest])} tokens); raise it, or pass --truncate_prompts."
        )
    if too_long:
        warnings.warn(f"{len(too_long)} prompts were cut to their last {run.max_prompt_length} tokens.", stacklevel=2)
        prompts = [p[-run.max_prompt_length :] for p in prompts]
    if min(map(len, prompts)) == 0:  # text the tokenizer makes nothing of
        raise SystemExit(f"row {[len(p) for p in prompts].index(0) + 1} of '{path}' is a prompt of no tokens; drop it.")
    columns = dict.fromkeys(key for row in rows for key in row)  # the data's columns, in the order first seen
    rows = [{**dict.fromkeys(columns), **row} for row in rows]  # each in every row, None where absent, as datasets
    return prompts, rows


def stop_token_ids(tokenizer, path):
    """The tokens that end a response: the EOS, the generation_config's, and the chat template's end of turn."""
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # the model has no generation_config.json
        eos = None
    if not isinstance(eos, list):
        eos = [eos]
    ids = {tokenizer.eos_token_id} | set(eos) - {None}
    if tokenizer.chat_template is not None:
        turns = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
        try:  # a template that raises, or that leaves the answer out (no "2")
            text = tokenizer.apply_chat_template(turns, tokenize=False)
            after = tokenizer(text[text.rindex("2") + 1 :], add_special_tokens=False)["input_ids"]
        except Exception as e:
            raise SystemExit(
                f"the chat template of '{path}' fails on a user turn and its answer ({type(e).__name__}: "
                f"{e}); fix it (tokenizer_config.json), or pass a tokenizer without one."
            ) from None
        if after and after[0] in tokenizer.added_tokens_decoder and tokenizer.added_tokens_decoder[after[0]].special:
            ids.add(after[0])
    return torch.tensor(sorted(ids))


def held_out_dataset(dataset, eval_dataset, eval_every):
    """--eval_dataset, else the test.<ext> beside a local train.<ext> --dataset; None with --eval_every 0 or none."""
    if eval_every == 0:
        return None
    if eval_dataset:
        return eval_dataset
    name = os.path.basename(dataset)  # train.<ext>: a format read_rows reads, compressed or not
    beside = os.path.join(os.path.dirname(dataset), "test" + name[len("train") :])
    if re.fullmatch(r"train\.(jsonl?|csv|tsv|parquet)(\.gz|\.bz2|\.xz)?", name, re.I) and os.path.isfile(beside):
        return beside
    return None


def next_prompts(prompts, position, batch_size, seed, world_size, rank):
    """This process's prompts (dataset indices) from one shuffled order per epoch, the longest on any process, and
    the position (data epoch, cursor) after them: position is where the last draw left off."""
    epoch, cursor = position
    if cursor + batch_size > len(prompts):
        epoch += 1
        cursor = 0
    shuffle = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(len(prompts), generator=shuffle).tolist()
    batch = [order[(cursor + i) % len(prompts)] for i in range(batch_size)]  # for all
    local_batch = batch_size // world_size
    mine = batch[rank * local_batch : (rank + 1) * local_batch]
    return mine, max(len(prompts[i]) for i in batch), (epoch, cursor + batch_size)
