"""The plumbing of ppo.py, grpo.py, rloo.py, dapo.py and grpo_tools.py, written once: each script holds its algorithm
and its loop, and calls what is here as runtime.NAME. The modules, each importing only those listed before it:

    settings        the run's settings (RunSettings: --help's second group) and the checks every script shares
    processes       torchrun, FSDP2, gathers and means over every process, the command line and the exit code
    batches         padding, each process's draws, micro-batches cut to their columns, a classifier's head
    reward_process  your --reward_fn in a process of its own, in TRL's, verl's, OpenRLHF's or this project's form
    loading         the models: dtype, bf16, activation checkpointing, LoRA, FSDP2 shards
    rewards         scoring, failed rewards, the built-in rules, the checks of your functions, held-out evaluation
    data            rows from files or the hub, prompts, stop tokens, the held-out set, each iteration's prompts
    checkpoints     the run lock, --resume, whole-or-absent saves, stop signals, skipped non-finite steps
    log             the dashboard, the alarms, metrics.jsonl, the console, wandb, the final policy
    tools           grpo_tools.py's --tools, each in a process of its own, the calls read and the answers rendered

The names below are the seams a script calls: to port a loop into another project, replace them.
"""

from rlhf_runtime.batches import (
    by_length,
    cut_padding,
    head_outputs,
    in_chunks,
    join_rounds,
    left_pad,
    position_ids_from,
    row_uniforms,
)
from rlhf_runtime.checkpoints import (
    catch_stop_signals,
    find_checkpoint,
    load_checkpoint,
    lock_output_dir,
    new_state,
    optimizer_step,
    save_checkpoint,
    stop_if_asked,
)
from rlhf_runtime.data import load_task, next_prompts
from rlhf_runtime.loading import adapter_dropout, load_model, load_reference, load_reward_models
from rlhf_runtime.log import Log, Stopwatch, add_token_stats, dashboard, finish
from rlhf_runtime.processes import (
    gather_rows,
    global_mean,
    graphs_decode,
    hold_full_parameters,
    launch,
    megabytes_held,
    shard,
    start_processes,
)
from rlhf_runtime.rewards import Scorer, evaluate, keep_rows, load_reward_fns, score_responses
from rlhf_runtime.settings import ASSETS, RunSettings, check_common_args, check_model_path, require
from rlhf_runtime.tools import Tools, assistant_message, load_tools, parse_tool_calls, run_tool_calls, tool_message_ids
