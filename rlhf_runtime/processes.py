"""Processes and collectives: one process per device under torchrun (none in a plain run), FSDP2, the gathers and
means over every process, and how a script's process ends. The guarantee: a run on N processes computes what one
process computes (the same draws, the whole batch's statistics), and every process ends with the exit code it had.
"""

import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist
import tyro
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers.utils import logging as hf_logging

try:  # the kernels beside the runtime (the scripts import them too): without them, the scripts' plain paths
    import rlhf_kernels
except ImportError:
    rlhf_kernels = None


def start_processes(run):
    """One process per device under torchrun, none in a plain run: sets run.world_size, returns rank and device."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    run.world_size = int(os.environ.get("WORLD_SIZE", 1))
    hf_logging.disable_progress_bar()  # transformers' loading and saving bars; the run's own bar stays
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo", timeout=collective_timeout(run.reward_timeout)
        )
    else:  # a plain run's checkpoints are one process's, as meant: torch need not warn at each save and load
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    if rank == 0 and rlhf_kernels is None:
        print("rlhf_kernels (the fused log-prob kernel) was not found: log-probs come from the plain torch path")
    if rank == 0 and rlhf_kernels is None and torch.cuda.is_available():
        print("rlhf_kernels (the CUDA-graph decode step) was not found: generate decodes with its plain loop")
    return rank, device


CHECKPOINT_S = 1200  # the longest a checkpoint may take: a 7B PPO run's policy and critic with Adam, 170 GB at 150 MB/s


def collective_timeout(reward_timeout):
    """How long a process waits for the others in a collective: twice --reward_timeout and a checkpoint (NCCL's own 10
    minutes, the default --reward_timeout, would end the processes waiting on a hung reward before its checkpoint)."""
    if reward_timeout <= 0:  # a reward may take any time
        return datetime.timedelta(days=7)
    return datetime.timedelta(seconds=2 * reward_timeout + CHECKPOINT_S)


def all_processes(value):
    """Every process's value (a small picklable object) in rank order, on every process; [value] in a plain run."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def gather_rows(tensors):
    """The whole rollout on every process: each tensor's rows of all processes, right-padded with zeros (masked)."""
    if not dist.is_initialized():
        return tensors
    widths = torch.tensor([x.shape[-1] for x in tensors.values()], device=next(iter(tensors.values())).device)
    dist.all_reduce(widths, op=dist.ReduceOp.MAX)
    gathered = {}
    for (key, x), width in zip(tensors.items(), widths.tolist()):
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]) if x.dim() > 1 else (0, 0)).contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        gathered[key] = torch.cat(parts)
    return gathered


def global_mean(x, mask=None):
    """Mean of a per-sequence statistic (B,) over every process's batch (where mask is 1), as a float: divided in
    float64, so that a share is exact (9 groups of 10 is 0.9, which an alarm at 0.9 sees)."""
    if mask is None:
        mask = torch.ones_like(x).float()
    total = torch.stack([(x.float() * mask).sum(), mask.sum()]).double()
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).item()


def shard(model, mixed_precision):
    """FSDP2 over all processes, a unit per transformer block; gradients summed, as each loss is a share of one.
    A plain run's model stays whole."""
    if not dist.is_initialized():
        return
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]  # as each model names them
    for module in blocks + [model]:
        fully_shard(module, mp_policy=bf16 if mixed_precision else MixedPrecisionPolicy())
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-scaled one)


def hold_full_parameters(model, *, hold):
    """While sampling, an FSDP2 policy holds its blocks gathered: one all-gather per rollout, not per token."""
    if isinstance(model, FSDPModule):
        model.set_reshard_after_forward(not hold)  # for every unit
        if not hold:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


def megabytes_held(models, optimizers):
    """What this process holds of the models' parameters and the optimisers' states, in MB (its FSDP2 shards)."""
    states = [x for o in optimizers for s in o.state.values() for x in s.values() if torch.is_tensor(x)]
    tensors = [p for m in models for p in m.parameters()] + states
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors) / 2**20


def graphs_decode(decode, device):
    """Whether generate decodes with rlhf_kernels' CUDA graphs: --decode auto, one GPU (FSDP2's hooks cannot be
    captured; a CPU's static cache gains little), and the kernels beside the runtime."""
    return decode == "auto" and device.type == "cuda" and not dist.is_initialized() and rlhf_kernels is not None


def launch(main, Args):
    """A script's command line: its Args parsed, main run, and the process's exit code set once (a sentence that
    stops the run said once, by rank 0); under torchrun each process leaves before the interpreter's teardown."""
    warnings.formatwarning = lambda message, category, *where: f"{category.__name__}: {message}\n"  # no source line
    if sys.stdout is None:  # started with stdout closed (`>&-`): prints, tyro's messages and the exit's flush go to
        sys.stdout = open(os.devnull, "w")  # /dev/null, which takes the free fd 1 (no file the run opens later does)
    if sys.stderr is None:  # the same for stderr
        sys.stderr = open(os.devnull, "w")
    code = 0  # the process's exit code
    try:
        if any(arg.split("=")[0] in ("--num_iterations", "--num-iterations") for arg in sys.argv[1:]):  # TRL's name
            raise SystemExit(
                "--num_iterations (TRL's passes over each rollout) is --num_epochs here; the number of iterations "
                "follows from --total_episodes."
            )
        main(tyro.cli(Args, use_underscores=True))
    except SystemExit as e:  # a sentence that stops the run: said once, by rank 0; every process exits with 1
        code = 1 if isinstance(e.code, str) else e.code
        if isinstance(e.code, str) and int(os.environ.get("RANK", 0)) == 0:
            print(e.code, file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # Ctrl-C before the run catches it (while the models load): one line, not a traceback
        code = 130
        if int(os.environ.get("RANK", 0)) == 0:
            print("stopped by Ctrl-C while starting: nothing was saved", file=sys.stderr, flush=True)
    if "WORLD_SIZE" in os.environ:  # under torchrun: leave before the interpreter's teardown, where gloo's threads,
        sys.stdout.flush()  # still freeing a collective's tensors, now and then abort a process that has ended
        os._exit(code or 0)
    raise SystemExit(code)
