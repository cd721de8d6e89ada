#!/usr/bin/env bash
# Device check, two parts, 15 minutes of device time in all:
# 1. one GPU: the memory plan vs measured peak reserved memory, tokens/s and MFU
#    (bench/gpu_check.py, python -m bench.gpu_check); under 8 minutes on one H200 (470 s stop).
# 2. the NCCL part, only where torch sees 2+ GPUs: DDP and FSDP2 on all of them, the same GPT,
#    seed and data, their per-step |G|², tr(Σ), B_simple and their relative difference, the
#    peak memory per device beside the plan's replica prediction for DDP
#    (bench/gpu_check_dist.py under torchrun); under 3 minutes (150 s budget, 180 s stop).
#    On one GPU it is skipped, and says so.
#   bash scripts/gpu_check.sh                 # gpu-0.7b on the GPU(s)
#   bash scripts/gpu_check.sh --cpu-smoke     # the same paths: test-tiny on the CPU, 2 gloo ranks
#   bash scripts/gpu_check.sh --preset gpu-small --batches 16,32,64   # options of part 1
#   GPU_CHECK_DIST_ARGS="--preset gpu-small --batch 4" bash scripts/gpu_check.sh   # of part 2
# Exit status: part 1's, else part 2's (1: DDP and FSDP2 disagree).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# The loop is one thread feeding the GPU; the planner child sets its own thread count.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
# 470 s hard stop: the script keeps to its own 420 s budget; this only catches a hang.
rc=0
timeout --signal=TERM --kill-after=10 470 "$PY" -m bench.gpu_check "$@" || rc=$?

smoke=0
for arg in "$@"; do [[ "$arg" == "--cpu-smoke" ]] && smoke=1; done
read -r -a dist_args <<<"${GPU_CHECK_DIST_ARGS:-}"
echo
if [[ $smoke == 1 ]]; then
  nproc=2
  dist_args+=(--cpu-smoke)
  export OMP_NUM_THREADS=1
else
  # what the ranks will see (CUDA_VISIBLE_DEVICES included), not nvidia-smi's whole machine
  nproc="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
  if [[ "$nproc" -lt 2 ]]; then
    echo "NCCL part skipped: torch sees $nproc GPU(s); DDP vs FSDP2 needs 2 or more."
    exit "$rc"
  fi
fi
drc=0
timeout --signal=TERM --kill-after=10 180 "$PY" -m torch.distributed.run --standalone \
  --nproc_per_node="$nproc" -m bench.gpu_check_dist ${dist_args[@]+"${dist_args[@]}"} || drc=$?
[[ $rc -ne 0 ]] && exit "$rc"
exit "$drc"
