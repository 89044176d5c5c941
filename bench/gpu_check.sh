#!/bin/bash
# One command for everything GPU-specific (bench/gpu_check.py says what it runs and what it writes: by default the
# report goes to $OUT/gpu_check.md, else bench/gpu_check.md). Installs the wheels of bench/gpu_check_wheels.txt when
# .whl/ holds them. At most 9 minutes in all (the check's caps add up to 480 s of its 530; `timeout` sends SIGTERM at
# 540 s, and the check closes its report). The torchrun row is a call of its own (--rows=torchrun).
#   bash bench/gpu_check.sh --stamp                             # in the caller's tree, before it is copied: writes
#                                                               # bench/gpu_check.commit (carry it: .gitignore has it)
#   bash bench/gpu_check.sh [--out report.md]                   # on the GPU machine
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh --device cpu  # the dry run, tiny shapes
cd "$(dirname "$0")/.." || exit 1
if [ "$1" = "--stamp" ]; then
    git describe --always --dirty --abbrev=7 >bench/gpu_check.commit && cat bench/gpu_check.commit
    exit
fi
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
"$PY" -c "import torch, transformers, tyro; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    || exit 1
exec timeout -k 20 540 "$PY" bench/gpu_check.py "$@"
