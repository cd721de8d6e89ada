#!/usr/bin/env bash
# Device check of the memory plan on one GPU: measured peak reserved memory, tokens/s and MFU vs
# the fake-tensor plan (bench/gpu_check.py, run from the checkout: python -m bench.gpu_check). Must finish in under 8 minutes on one H200.
#   bash scripts/gpu_check.sh                 # gpu-0.7b on the GPU
#   bash scripts/gpu_check.sh --cpu-smoke     # the same path, test-tiny on the CPU
#   bash scripts/gpu_check.sh --preset gpu-small --batches 16,32,64
set -euo pipefail
cd "$(dirname "$0")/.."
# The loop is one thread feeding the GPU; the planner child sets its own thread count.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
# 470 s hard stop: the script keeps to its own 420 s budget; this only catches a hang.
exec timeout --signal=TERM --kill-after=10 470 "${PYTHON:-python3}" -m bench.gpu_check "$@"
