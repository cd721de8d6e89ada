#!/usr/bin/env bash
# Installs what is missing, then runs the whole test suite (unit, processes, pages, browser).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
exec "${PYTHON:-python3}" -m pytest -q "$@"
