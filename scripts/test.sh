#!/usr/bin/env bash
# Installs what is missing (scripts/setup.sh), then runs the whole test suite (unit, processes,
# pages, browser, a wheel installed into fresh virtual environments).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/env.sh
export OMP_NUM_THREADS=1
# the linter and the formatter's check first (pyproject.toml [tool.ruff]): a second, then the
# suite. `ruff format` (same paths) fixes what the second one reports.
LINTED=(rampwatch tests bench examples app.py pages trainer)
"$PY" -m ruff check "${LINTED[@]}"
"$PY" -m ruff format --check "${LINTED[@]}"
# two workers, each file on one (its fixtures and children stay together): most tests wait on
# child processes, so two overlap well even on two cores (20:41 → 12:39 on this project's
# 2-core machine, 2026-12-01); RAMPWATCH_TEST_WORKERS=0 runs them in this process, in order
exec "$PY" -m pytest -q -n "${RAMPWATCH_TEST_WORKERS:-2}" --dist loadfile "$@"
