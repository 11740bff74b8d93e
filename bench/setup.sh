#!/usr/bin/env bash
# Create (or refresh) bench/.venv: the same torch as phalanx's own venv, plus the frameworks the
# benchmarks compare against. Kept apart from .venv so phalanx's tests never see Lightning or
# Accelerate (phalanx must not depend on them, even by accident).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
LIGHTNING_VERSION="2.6.6"
ACCELERATE_VERSION="1.15.0"
VENV=bench/.venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
# torch first and pinned: on this project's machines the CPU build is on local disk, and a looser
# requirement could pull a multi-GB CUDA build instead. Every later install pins it again so no
# resolver step can swap it out.
"$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null \
  || "$PIP" install -q "torch==$TORCH_VERSION"
"$PIP" install -q "torch==$TORCH_VERSION" numpy tqdm
# phalanx itself without dependency resolution: its requirements are already satisfied above.
"$PIP" install -q --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
"$PIP" install -q "torch==$TORCH_VERSION" "lightning==$LIGHTNING_VERSION" "accelerate==$ACCELERATE_VERSION" \
  2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" - <<PY
import sys

import accelerate
import lightning
import torch

import phalanx

if torch.__version__.split("+")[0] != "$TORCH_VERSION":
    sys.exit(f"bench/setup.sh: torch {torch.__version__} was installed, expected $TORCH_VERSION; "
             "delete bench/.venv and pin the framework versions so they accept torch $TORCH_VERSION.")
print(f"bench venv ready: torch {torch.__version__}, lightning {lightning.__version__}, "
      f"accelerate {accelerate.__version__}, phalanx {phalanx.__version__}")
PY
