"""Shared test set-up: offline, repository root importable, Triton on its CPU interpreter; the fixtures several test
files take (held-out sets, pytest's own signal handlers kept)."""

import os
import signal
import sys

import pytest

# Nothing in the tests may reach a model hub: everything loads from assets/ or a temporary folder.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "disabled"
# Without a GPU, Triton kernels run on the CPU under the interpreter; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session", autouse=True)
def small_held_out_set(tmp_path_factory):
    """The held-out set of ppo.py's tiny run (helpers.TINY): 16 review prompts instead of the 400 beside its data."""
    import helpers

    path = tmp_path_factory.mktemp("held_out") / "test.jsonl"
    path.write_text("".join(open(os.path.join(ROOT, "assets", "reviews", "test.jsonl")).readlines()[:16]))
    helpers.TINY["ppo.py"]["eval_dataset"] = str(path)


@pytest.fixture(scope="session")
def held_out(tmp_path_factory):
    """The held-out sets of the runs compared on two processes and one (helpers.common): 15 prompts of each task."""
    runs = {}
    for task in ("reviews", "arithmetic"):
        path = tmp_path_factory.mktemp("held_out") / "test.jsonl"
        path.write_text("".join(open(os.path.join(ROOT, "assets", task, "test.jsonl")).readlines()[:15]))
        runs[task] = str(path)
    return runs


@pytest.fixture
def keep_signal_handlers():
    """main() installs its own SIGTERM and Ctrl-C handlers; give pytest its own back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
