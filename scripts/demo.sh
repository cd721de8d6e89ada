#!/usr/bin/env bash
# Installs what is missing, starts a cpu-tiny training run and the dashboard on 127.0.0.1.
#   bash scripts/demo.sh            (Ctrl-C stops both; PORT=8502 picks another port)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
. scripts/env.sh
PORT=${PORT:-8501}
mkdir -p runs
DB=${RAMPWATCH_DB:-runs/demo.duckdb}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# A small per-device batch makes the noise scale cross the batch within a few minutes, so the
# dashboard has a ramp to recommend; approve it and watch the trainer apply it.
rampwatch train --db "$DB" --preset cpu-tiny --name "demo-$(date +%H%M%S)" \
  --per-device-batch 4 --accum 2 --checkpoint-dir runs/checkpoints \
  > runs/demo-trainer.log 2>&1 &
TRAINER=$!
# Approve needs the operator token (rampwatch/dashboard/guard.py): one for this demo, shown below.
export RAMPWATCH_TOKEN=${RAMPWATCH_TOKEN:-$("$PY" -c "import secrets; print(secrets.token_urlsafe(18))")}
rampwatch dashboard --db "$DB" --port "$PORT" > runs/demo-dashboard.log 2>&1 &
DASH=$!
stop() {  # Ctrl-C: the trainer checkpoints at its next step boundary (SIGTERM), then both end
  trap - INT TERM
  echo; echo "stopping: the trainer saves a checkpoint at its next step, then exits"
  kill -TERM "$TRAINER" "$DASH" 2>/dev/null || true
  wait "$TRAINER" 2>/dev/null || true
  wait "$DASH" 2>/dev/null || true
  echo "stopped; the last lines of runs/demo-trainer.log say how to resume the run"
  exit 0
}
trap stop INT TERM
echo "Rampwatch demo: dashboard at http://127.0.0.1:$PORT  (trainer log: runs/demo-trainer.log)"
echo "To approve a ramp, type your name and this operator token beside Approve: $RAMPWATCH_TOKEN"
echo "Ctrl-C stops the run and the dashboard."
# A Ctrl-C in the terminal reaches every process: the trainer checkpoints and stops (its last
# log lines say how to resume), the dashboard stops, and so does this script.
if wait "$TRAINER"; then
  echo "training finished"
else
  echo "the trainer stopped (exit $?): the end of runs/demo-trainer.log says why"
fi
sleep 1
if kill -0 "$DASH" 2>/dev/null; then
  echo "the dashboard stays up until Ctrl-C"
  wait "$DASH" || true
fi
