#!/usr/bin/env bash
# Create (or refresh) .venv at the repo root and install phalanx with the extras named in $1.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-examples}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: on this project's machines the CPU build of 2.13.0 is on local disk;
# letting a looser requirement resolve it could pull a multi-GB CUDA build instead.
.venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || .venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[${EXTRAS}]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import phalanx" 
