#!/usr/bin/env bash
# Installs everything Rampwatch needs on a fresh machine; safe to re-run (installs only what is missing).
#   bash scripts/setup.sh          runtime + tests + chromium
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# A user's own torch (e.g. a CUDA build) is kept; with none, take the CPU wheel rather than
# letting pip resolve an unpinned torch to a multi-GB CUDA build.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -r requirements.txt -r requirements-dev.txt

# Debian's chromium for the end-to-end browser test (playwright's own download needs a network).
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: chromium not found and no apt-get; the browser test will be skipped" >&2
  fi
fi
