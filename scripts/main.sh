#!/usr/bin/env bash
# Set up .venv and run the main job: phalanx.Trainer on 2 processes (DDP, CPU) on scikit-learn's digits
# (LR finder, best checkpoint, CSV + TensorBoard logs under runs/train_digits).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "examples,tensorboard,plot"
exec .venv/bin/python examples/train_digits.py "$@"
