"""Shared test set-up: offline, repository root importable, Triton on its CPU interpreter."""

import os
import sys

# Nothing in the tests may reach a model hub: everything loads from assets/ or a temporary folder.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "disabled"
# Without a GPU, Triton kernels run on the CPU under the interpreter; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
