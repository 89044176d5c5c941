"""Checkpoints and stops: one run per folder (its lock), --resume checked before any model loads, saves that are
whole or absent (a .tmp folder renamed once every process wrote), SIGTERM and Ctrl-C turned into a save, and steps
with a non-finite gradient skipped. The guarantee: a run stopped anywhere goes on exactly as if it had not stopped,
on any number of processes, and nothing half-written is ever taken for a checkpoint.
"""

import functools
import inspect
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grad_norm_

from rlhf_runtime.processes import all_processes
from rlhf_runtime.settings import flat_options

# What may differ between a run and its resumption (the number of processes too); every other argument must match.
RESUMABLE = (
    "resume",
    "num_iterations",
    "world_size",
    "output_dir",
    "total_episodes",
    "save_every",
    "keep_checkpoints",
    "max_bad_steps",
    "on_reward_error",
    "reward_timeout",
    "micro_batch_size",
    "track",
    "wandb_project",
    "exp_name",
    "log_samples_every",
    "decode",
)


USUAL_CAUSES = (
    "the usual causes are a learning rate too high (lower it), rewards of a large scale (normalise them), "
    "bf16 or fp16 overflow (--model_dtype float32)"
)


def lock_output_dir(output_dir):
    """One run per folder: rank 0 locks an existing --output_dir before anything there is read, the others waiting."""
    if os.path.isdir(output_dir) and int(os.environ.get("RANK", 0)) == 0:
        take_lock(output_dir)
    all_processes(None)


@functools.cache  # held from the first call until the process ends
def take_lock(folder):
    """One run per folder: rank 0 locks run.lock, naming its process (the system unlocks it when the process ends);
    returns the file, and the line that says this run takes over the lock of a process that ended ("" if none)."""
    path = os.path.join(folder, "run.lock")
    me = f"process {os.getpid()} on {os.uname().nodename}"
    try:  # open's "a+", but a link is never followed: written through, the file it names would be emptied
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o666)
    except OSError as e:  # a link, a folder of that name, a file or folder without write permission
        why = e.strerror
        if os.path.islink(path):  # said so, not as O_NOFOLLOW's "Too many levels of symbolic links"
            why = "it is a symbolic link, which is never written through"
        raise SystemExit(
            f"--output_dir '{folder}' cannot be locked: its run.lock cannot be opened for writing ({why}); "
            "remove it or make it writable, or pass another --output_dir."
        ) from None
    f = os.fdopen(fd, "a+")
    before = os.pread(f.fileno(), 1000, 0).decode(errors="replace")  # the process holding it, or that held it last
    try:
        os.lockf(f.fileno(), os.F_TLOCK, 0)
    except (BlockingIOError, PermissionError):
        raise SystemExit(
            f"--output_dir '{folder}' is in use by another run ({before}, its {path}); wait for it to "
            "end, or pass another --output_dir."
        ) from None
    except OSError as e:  # ENOLCK: a file system without locks (NFS without its lock service)
        print(f"{path}: this file system cannot lock ({e.strerror}): a second run here would not be refused")
    taken_over = ""  # said by Log once the run writes here, past the checks that may refuse the folder
    if before not in ("", me):
        taken_over = f"{path}: {before} has ended; this run takes the folder over"
    f.truncate(0)
    print(me, file=f, end="", flush=True)
    return f, taken_over


def checkpoints_in(folder):
    """The finished checkpoints in folder, oldest first (a save cut short is left under a '.tmp' name)."""
    names = [n for n in os.listdir(folder) if re.fullmatch(r"checkpoint-\d+", n)] if os.path.isdir(folder) else []
    return [os.path.join(folder, n) for n in sorted(names, key=lambda n: int(n[11:]))]


def read_json(path):
    """The JSON in a file, or None where it is missing or not JSON."""
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return None


def checkpoint_problem(path):
    """What keeps a checkpoint from resuming, in words, or None: its files at the sizes saved (a stat: no shard is
    read), its JSON files readable, its state of the iteration in its name."""
    manifest = read_json(os.path.join(path, "manifest.json"))
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return "its manifest.json is missing or damaged"
    for name, entry in manifest["files"].items():
        if not isinstance(entry, dict) or "bytes" not in entry:  # a manifest edited by hand, or of another version
            return f"its manifest.json gives no size for {name}"
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name} is missing"
        if os.path.getsize(os.path.join(path, name)) != entry["bytes"]:
            return f"{name} is not of the size it was saved with"
    if read_json(os.path.join(path, "args.json")) is None:
        return "its args.json cannot be read"
    state = read_json(os.path.join(path, "state.json"))
    if not isinstance(state, dict):
        return "its state.json cannot be read"
    named = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(path))  # a folder renamed, or a state of another
    if named and state.get("iteration") != int(named[1]):
        return f"its name says iteration {named[1]}, its state.json {state.get('iteration')}"
    return None


def sound_checkpoints(folder):
    """The checkpoints in folder with no checkpoint_problem, newest first."""
    return [path for path in reversed(checkpoints_in(folder)) if checkpoint_problem(path) is None]


def resume_instead(path):
    """What to do in place of resuming path: the newest sound checkpoint beside it, or a start afresh."""
    for other in sound_checkpoints(os.path.dirname(path)):
        if other != path:
            return f"resume from {other}, the newest whole checkpoint beside it"
    return "no checkpoint beside it is whole, so start afresh in another --output_dir"


def check_resume_path(path):
    """--resume PATH: one sentence naming what to pass instead where path is not a whole checkpoint (a path that
    does not exist, TRL's True, a run's folder, a checkpoint with a problem)."""
    if not os.path.exists(path) and path.lower() == "true":  # TRL's resume_from_checkpoint=True: the newest one
        raise SystemExit(f"--resume {path} is TRL's way to go on from the newest checkpoint; here it is --resume auto.")
    if not os.path.exists(path):
        raise SystemExit(
            f"--resume '{path}' does not exist; pass a checkpoint's folder (checkpoint-N in a run's --output_dir), "
            "or --resume auto for the newest one in --output_dir."
        )
    if checkpoints_in(path):  # the run's folder, not one of its checkpoints
        newest = sound_checkpoints(path)
        if not newest:
            raise SystemExit(
                f"--resume '{path}' is a run's folder, not a checkpoint, and none of its checkpoints is whole; "
                "start afresh in another --output_dir."
            )
        raise SystemExit(
            f"--resume '{path}' is a run's folder, not a checkpoint; pass --resume {newest[0]}, its newest whole "
            f"checkpoint, or --resume auto with --output_dir {path}."
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise SystemExit(f"--resume '{path}' is not a whole checkpoint: {problem}; {resume_instead(path)}.")


def find_checkpoint(args):
    """--resume checked before any model loads: a sound checkpoint of this script and these arguments, in a folder
    of its own run ('auto' stays, load_checkpoint taking the newest sound one that loads, or None where none is)."""
    say = int(os.environ.get("RANK", 0)) == 0
    held = checkpoints_in(args.output_dir)
    path = args.run.resume
    if args.run.resume == "auto":
        path = None
        for other in reversed(held):
            problem = checkpoint_problem(other)
            if problem is None:
                path = other
                break
            if say:
                print(f"--resume auto: skipping {other}: {problem}")
        if held and not path:
            raise SystemExit(f"--resume auto: no checkpoint in {args.output_dir} is whole; pass another --output_dir.")
        if not path:
            args.run.resume = None
        if say and path:
            print(f"--resume auto: resuming from {path}")
        elif say:
            print(f"--resume auto: no checkpoint in {args.output_dir}, starting afresh")
    elif args.run.resume:  # a path: a whole checkpoint, or one sentence naming what to pass instead
        args.run.resume = os.path.normpath(args.run.resume)
        path = args.run.resume
        check_resume_path(path)
    if held and (not path or os.path.realpath(os.path.dirname(path)) != os.path.realpath(args.output_dir)):
        raise SystemExit(  # a new run, or a checkpoint from elsewhere, would mix with that run's
            f"--output_dir '{args.output_dir}' holds the checkpoints of a run (the newest: "
            f"{os.path.basename(held[-1])}); pass --resume auto to continue it, or another --output_dir."
        )
    if not path:
        return
    script = os.path.basename(inspect.getfile(type(args)))  # the file that defines Args: ppo.py, ...
    made_by = read_json(os.path.join(path, "manifest.json")).get("script")
    if made_by != script:
        raise SystemExit(
            f"'{path}' is a checkpoint of {made_by}, not of {script}; resume it with {made_by}, "
            f"or start {script} in another --output_dir."
        )
    saved = read_json(os.path.join(path, "args.json"))
    now = json.loads(json.dumps(flat_options(args)))  # tuples as lists, as in the saved file
    changed = [k for k in saved if k not in RESUMABLE and saved[k] != now.get(k)]
    if changed:
        raise SystemExit(
            f"'{path}' was made with other values of {', '.join('--' + k for k in changed)}; pass "
            f"those of its args.json (only {', '.join('--' + k for k in RESUMABLE[3:])} may change)."
        )


def trainer_state_dicts(models, optimizers):
    """Each trained model's and optimiser's state, keyed by parameter name (under FSDP2, this process's shards)."""
    return {k: dict(zip(("model", "optimizer"), get_state_dict(models[k], optimizers[k]))) for k in models}


def save_checkpoint(args, models, optimizers, state, rank):
    """What a resumed run needs, in a .tmp folder renamed once every process wrote; all but --keep_checkpoints go."""
    path = os.path.join(args.output_dir, f"checkpoint-{state['iteration']}")
    tmp = path + ".tmp"
    saved = rank == 0 and read_json(os.path.join(path, "state.json")) == json.loads(json.dumps(state))
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this iteration cut short, gone before the gather below
    if all_processes(saved and checkpoint_problem(path) is None)[0]:  # a stop just after a save
        return path
    error = first_error_anywhere(dcp.save, trainer_state_dicts(models, optimizers), checkpoint_id=tmp)
    if error is None:
        error = first_error_anywhere(complete_checkpoint, tmp, path, args, state, here=rank == 0)
    if error is None:
        return path
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(write_failure(f"writing {path}", error, args.output_dir))
    raise SystemExit(1)


def first_error_anywhere(step, *inputs, here=True, **options):
    """step(*inputs, **options) where here is true; on every process, the first process's error as text, or None."""
    error = None
    try:
        if here:
            step(*inputs, **options)
    except (OSError, RuntimeError, dcp.CheckpointException) as e:  # a full disk shows as any of these
        if isinstance(e, dcp.CheckpointException):
            e = next(iter(e.failures.values()))[0]  # each process's error, with its traceback
        error = f"{type(e).__name__}: {e}"[:300]
    errors = [e for e in all_processes(error) if e]
    if errors:
        return errors[0]
    return None


def load_shards(path, models, optimizers):
    """Every process: its shards of the models and optimisers, as saved (for any process count)."""
    saved = trainer_state_dicts(models, optimizers)
    dcp.load(saved, checkpoint_id=path)
    for k in models:
        set_state_dict(
            models[k], optimizers[k], model_state_dict=saved[k]["model"], optim_state_dict=saved[k]["optimizer"]
        )


def complete_checkpoint(tmp, path, args, state):
    """Rank 0: beside the shards, the log so far, the arguments, the state and a manifest (the script, each file's
    size), flushed to disk; the folder renamed over a stale checkpoint-N; then any save cut short goes, and every
    checkpoint older than the newest --keep_checkpoints whole ones (a damaged one is not counted among those)."""
    shutil.copy(os.path.join(args.output_dir, "metrics.jsonl"), tmp)
    pathlib.Path(tmp, "args.json").write_text(json.dumps(flat_options(args), indent=2))
    pathlib.Path(tmp, "state.json").write_text(json.dumps(state, indent=2))
    files = {name: {"bytes": os.path.getsize(os.path.join(tmp, name))} for name in sorted(os.listdir(tmp))}
    manifest = {"script": os.path.basename(inspect.getfile(type(args))), "files": files}
    pathlib.Path(tmp, "manifest.json").write_text(json.dumps(manifest, indent=2))
    for name in ("args.json", "state.json", "metrics.jsonl", "manifest.json", "."):  # dcp.save flushed its own
        flush_to_disk(os.path.join(tmp, name))
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)
    flush_to_disk(args.output_dir)  # the rename
    cut_short = list(pathlib.Path(args.output_dir).glob("checkpoint-*.tmp"))
    held = checkpoints_in(args.output_dir)  # oldest first, the one just saved (whole) among them
    oldest_kept = sound_checkpoints(args.output_dir)[: args.run.keep_checkpoints][-1]
    for old in held[: held.index(oldest_kept)] + cut_short:
        if os.path.islink(old):
            os.remove(old)  # a link goes, never what it points to
        else:
            shutil.rmtree(old)


def flush_to_disk(path):
    """A file's or a folder's entries written through to the disk (fsync), so that a crash cannot undo a save."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def write_failure(what, error, output_dir):
    """One sentence for a failed write, with the checkpoint to go on from."""
    newest = (checkpoints_in(output_dir) or [None])[-1]
    then = f"go on from {newest}, the last good checkpoint, with --resume auto" if newest else "start again"
    return f"{what} failed ({error}); free some space on '{output_dir}' (or make it writable again) and {then}."


def new_state(**algorithm_state):
    """A run's state at its start: the bookkeeping every script keeps, then the algorithm's own entries."""
    state = dict(iteration=0, episodes=0, data_position=(0, 0), alarms_on=[], bad_steps=0, skipped_steps=0, elapsed=0.0)
    state.update(algorithm_state)
    return state


def load_checkpoint(args, models, optimizers):
    """Models and optimisers as saved, and the state (every draw is seeded by the iteration); under --resume auto a
    checkpoint that fails to load gives way to the one before it, every process taking the same; --resume is set."""
    paths = [args.run.resume]
    if args.run.resume == "auto":
        paths = sound_checkpoints(args.output_dir)
    for path in paths:
        error = first_error_anywhere(load_shards, path, models, optimizers)
        if error is None:
            break
        if args.run.resume != "auto":
            raise SystemExit(
                f"checkpoint '{path}' could not be loaded ({error}); {resume_instead(path)}, or if the models "
                "changed size, resume with those it was trained from."
            )
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"--resume auto: {path} could not be loaded ({error}); trying the one before it")
    if error is not None:
        raise SystemExit(
            f"--resume auto: no checkpoint in '{args.output_dir}' could be loaded (the last: {error}); if the "
            "models changed size, resume with those it was trained from, or start afresh in another --output_dir."
        )
    if path != paths[0] and int(os.environ.get("RANK", 0)) == 0:
        print(f"--resume auto: resuming from {path}")
    args.run.resume = path
    state = read_json(os.path.join(path, "state.json"))
    if state["iteration"] == 0:  # saved before any step: its Adam state is get_state_dict's zero-gradient step
        for optimizer in optimizers.values():
            optimizer.state.clear()  # (step 1, no moments), not one the run took; so Adam starts as the run did
    return state


def catch_stop_signals():
    """SIGTERM or Ctrl-C stops the run where it can save, a second at once: the list of reasons to stop (signals)."""
    stops = []

    def on_signal(signum, frame):
        if any(isinstance(r, int) for r in stops):
            os._exit(128 + signum)
        stops.append(signum)
        print(f"\n{signal.Signals(signum).name}: stopping to save a checkpoint (again: quit at once)", flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stops


def stop_if_asked(stops, state, models, optimizers, args):
    """When a process has a reason to stop (a signal, a failed reward, --max_bad_steps), all save and exit."""
    signum = next((r for r in stops if isinstance(r, int)), 0)
    failure = next((r for r in stops if isinstance(r, str)), None)
    reasons = {
        "signal": signum,
        "failure": failure is not None,
        "bad_steps": state["bad_steps"] >= args.run.max_bad_steps,
    }
    found = torch.tensor(list(reasons.values()), device=next(models["policy"].parameters()).device)
    if dist.is_initialized():
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    reasons = dict(zip(reasons, found.tolist()))
    if not any(reasons.values()):
        return
    if reasons["failure"]:  # the message of the first process that failed
        failure = next(f for f in all_processes(failure) if f)
    elif reasons["bad_steps"]:
        failure = (
            f"{state['bad_steps']} optimiser steps in a row had a non-finite loss or gradient (iteration "
            f"{state['iteration']}); {USUAL_CAUSES}."
        )
        state = dict(state, bad_steps=0)
    rank = int(os.environ.get("RANK", 0))
    path = save_checkpoint(args, models, optimizers, state, rank)
    command = "python"
    if args.run.world_size > 1:
        command = f"torchrun --nproc_per_node={args.run.world_size}"
    argv = [arg for arg in sys.argv if not arg.startswith("--resume=")]  # this run's --resume, replaced by path
    while "--resume" in argv:
        del argv[argv.index("--resume") : argv.index("--resume") + 2]
    if rank == 0:
        print(
            f"stopped after iteration {state['iteration']}; to go on:\n  {command} {shlex.join(argv)} --resume {path}",
            flush=True,
        )
    if failure is None:  # a signal: the exit code of a process it ended
        raise SystemExit(128 + reasons["signal"])
    if rank == 0:  # said once, however main was called
        raise SystemExit(failure)
    raise SystemExit(1)


def optimizer_step(models, optimizers, stats, state, iteration, max_grad_norm, max_bad_steps):
    """One optimiser step: each model's gradient norm clipped to max_grad_norm, then every optimiser steps, unless a
    norm is not finite or too many were in a row (step_is_finite); the gradients cleared either way."""
    grad_norms = {}
    for name, model in models.items():
        grad_norms[name] = clip_grad_norm_(model.parameters(), max_grad_norm)
    if step_is_finite(grad_norms, stats, state, iteration, max_bad_steps):  # a nan or inf gradient: no step
        for optimizer in optimizers.values():
            optimizer.step()
    for optimizer in optimizers.values():
        optimizer.zero_grad(set_to_none=True)


def step_is_finite(grad_norms, stats, state, iteration, max_bad_steps):
    """Whether to step: not on a nan or inf gradient norm, nor after --max_bad_steps in a row (norms into stats)."""
    grad_norms = {k: n.full_tensor() if isinstance(n, DTensor) else n for k, n in grad_norms.items()}  # FSDP2: all
    for name, norm in grad_norms.items():
        stats[f"grad_norm/{name}"] += norm.item()
    stats["steps"] += 1
    if state["bad_steps"] >= max_bad_steps:
        state["skipped_steps"] += 1
        return False
    if all(torch.isfinite(n) for n in grad_norms.values()):
        state["bad_steps"] = 0
    else:
        state["bad_steps"] += 1
        state["skipped_steps"] += 1
    if state["bad_steps"] == 1:
        print(f"iteration {iteration}: a non-finite loss or gradient; steps are skipped until a finite one", flush=True)
    return state["bad_steps"] == 0
