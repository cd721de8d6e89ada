#!/usr/bin/env bash
# Installs Rampwatch (editable, with the dashboard, trainer and test extras at the versions in
# requirements*.txt) into the Python of scripts/env.sh, and chromium for the browser tests.
# Safe to re-run: installs only what is missing.
#   bash scripts/setup.sh            everything the tests need
#   bash scripts/setup.sh demo       only what the demo runs (no test tools, no chromium)
#   TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup.sh   # CPU torch from PyTorch's index
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh

# Any torch already in that environment (e.g. your CUDA build) is kept. With none, torch==2.13.0
# comes from pip's index: the default build for the platform (on Linux from PyPI, the CUDA one),
# or from TORCH_INDEX when given.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0 ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
fi
if [ "${1:-}" = demo ]; then
  "$PY" -m pip install -q -r requirements.txt -e '.[dashboard,trainer]'
  exit 0
fi
"$PY" -m pip install -q -r requirements.txt -r requirements-dev.txt -e '.[dashboard,trainer,test]'

# Debian's chromium for the end-to-end browser test (playwright's own download needs a network).
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
  else
    echo "setup: chromium not found and no apt-get; the browser test will be skipped" >&2
  fi
fi
