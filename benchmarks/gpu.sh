#!/usr/bin/env bash
# GPT-2 124M training throughput on a single CUDA GPU (written for an H200; works on A100/H100):
# tokens/s, MFU and peak memory for micro-batch 8, 16, 32 at T=1024 with bf16 autocast,
# torch.compile, flash attention and fused AdamW; then, at the best size, side by side: the engine,
# the engine under DDP with NCCL in one process, and the plain loop of benchmarks/reference_gpt.py,
# with MFU and the ratios (goals: MFU >= 50% on an H200, engine >= 1.02x the plain loop).
# A few minutes, mostly compilation. Never run yet on a GPU: expect to fix what breaks the first time.
#
#     bash benchmarks/gpu.sh
#
# Uses the project venv (.venv), creating it with `make venv` when it is missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ ! -x .venv/bin/python ]; then
    make venv
fi
PY=.venv/bin/python

# The benchmark itself skips quietly without CUDA (so `make bench` passes on CPU); here that is an error.
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    build=$("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')
    echo "gpu.sh: CUDA is not available to the torch in .venv ($build); run this on a CUDA machine" \
        "with a CUDA build of torch" >&2
    exit 1
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi

export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"  # one GPU
exec "$PY" benchmarks/gpu_throughput.py
