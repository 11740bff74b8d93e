#!/usr/bin/env bash
# Create (or refresh) the two environments of the LitGPT port test (tests/integration/test_litgpt_port.py):
#
#   $ROOT/venv-port       torch + litgpt 0.5.13 (installed WITHOUT its dependencies, so no `lightning`)
#                         + the few packages litgpt imports, all pinned; phalanx from this checkout.
#   $ROOT/venv-lightning  the same plus lightning 2.6.6: the reference the port's losses are compared to.
#
# ROOT defaults to /tmp/phalanx-litgpt (override with PHALANX_LITGPT_ROOT). Idempotent: a second run only
# checks what is installed. Needs the package registry (PyPI), nothing else: the test builds its own tiny
# model config, text data and tokenizer, so no model or dataset is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
PYTHON="${PYTHON:-python3}"
ROOT="${PHALANX_LITGPT_ROOT:-/tmp/phalanx-litgpt}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

TORCH_VERSION="2.13.0"
LITGPT_VERSION="0.5.13"
LIGHTNING_VERSION="2.6.6"
# What litgpt 0.5.13's pretrain / finetune_full / finetune_lora modules import (found by importing them
# in a venv that holds only torch and litgpt), pinned inside litgpt's own requirement ranges.
LITGPT_IMPORTS=(
  "jsonargparse[signatures]==4.41.0"   # litgpt's CLI and its argument dataclasses (litgpt: <=4.41)
  "huggingface-hub==0.36.0"            # litgpt.tokenizer / litgpt.utils (litgpt: >=0.30,<1.4)
  "tokenizers==0.22.2"                 # litgpt.tokenizer reads tokenizer.json with it
  "safetensors==0.8.0"
  "psutil==7.2.2"                      # litgpt pins this exact version
  "tqdm==4.70.1"
  "pyyaml==6.0.4"
  "packaging==26.4"
  "torchmetrics==1.9.0"                # litgpt.pretrain / finetune: torchmetrics.aggregation.RunningMean
  "lightning-utilities==0.15.3"        # litgpt.constants (RequirementCache); torchmetrics needs it too
)

make_venv() {  # $1: venv path; the rest: extra requirements
  local venv="$1"; shift
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  # torch first and pinned, alone: on this project's machines the CPU build is on local disk, and a
  # looser requirement could pull a multi-GB CUDA build. Every later install pins it again.
  "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
    2>/dev/null || "$venv/bin/pip" install -q "torch==$TORCH_VERSION"
  "$venv/bin/pip" install -q "torch==$TORCH_VERSION" "${LITGPT_IMPORTS[@]}" "$@" 2>&1 \
    | grep -v "^WARNING: Location" || true
  # litgpt without dependency resolution: its metadata requires lightning, which the port must not see.
  "$venv/bin/pip" install -q --no-deps "litgpt==$LITGPT_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
}

mkdir -p "$ROOT"
make_venv "$ROOT/venv-port"
# phalanx from this checkout, without dependency resolution (torch, numpy, tqdm are already there).
"$ROOT/venv-port/bin/pip" install -q "numpy" 2>&1 | grep -v "^WARNING: Location" || true
"$ROOT/venv-port/bin/pip" install -q --no-deps -e "$REPO" 2>&1 | grep -v "^WARNING: Location" || true
make_venv "$ROOT/venv-lightning" "lightning==$LIGHTNING_VERSION"

"$ROOT/venv-port/bin/python" - <<PY
import importlib.util, sys
import torch, phalanx
if importlib.util.find_spec("lightning") is not None:
    sys.exit("litgpt_env.sh: 'lightning' is installed in venv-port; the port must run without it")
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
print(f"venv-port ready: torch {torch.__version__}, litgpt $LITGPT_VERSION, phalanx {phalanx.__version__}, no lightning")
PY
"$ROOT/venv-lightning/bin/python" - <<PY
import torch, lightning, litgpt.pretrain
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
assert lightning.__version__ == "$LIGHTNING_VERSION", lightning.__version__
print(f"venv-lightning ready: torch {torch.__version__}, litgpt $LITGPT_VERSION, lightning {lightning.__version__}")
PY
