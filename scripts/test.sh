#!/usr/bin/env bash
# Installs what is missing (scripts/setup.sh), then runs the whole test suite (unit, processes,
# pages, browser, a wheel installed into fresh virtual environments).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/env.sh
export OMP_NUM_THREADS=1
# the linter first (pyproject.toml [tool.ruff.lint]): a second, then the suite
"$PY" -m ruff check rampwatch tests bench examples app.py pages trainer
exec "$PY" -m pytest -q "$@"
