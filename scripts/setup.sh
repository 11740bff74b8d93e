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
# The deepspeed extra is installed by install_deepspeed below, never through pip's extras resolution.
PIP_EXTRAS="$(echo ",${EXTRAS}," | sed 's/,deepspeed,/,/g; s/^,//; s/,$//')"
.venv/bin/pip install -q -e ".[${PIP_EXTRAS}]" 2>&1 | grep -v "^WARNING: Location" || true

# DeepSpeed ships as an sdist whose build imports torch: with build isolation pip would fetch another
# torch into the build environment, so build against the venv's torch (pinned by a constraint).
# DS_BUILD_OPS=0: phalanx needs none of its compiled ops (torch optimizers, gloo/nccl). Fast no-op
# when the pinned version is already there. Without network the DeepSpeed tests skip, visibly.
install_deepspeed() {
  .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('deepspeed') != '0.19.8')" \
    2>/dev/null && return 0
  echo "torch==2.13.0" > .venv/phalanx-torch-pin.txt
  DS_BUILD_OPS=0 .venv/bin/pip install -q --no-build-isolation -c .venv/phalanx-torch-pin.txt "deepspeed==0.19.8" \
    || echo "[setup] WARNING: could not install deepspeed==0.19.8; tests/strategies/test_deepspeed.py will be skipped." >&2
}
case ",${EXTRAS}," in
  *,test,*|*,deepspeed,*) install_deepspeed ;;
esac
.venv/bin/python -c "import phalanx" 
