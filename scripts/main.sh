#!/usr/bin/env bash
# Set up .venv and run the main job: 2-process DDP training on scikit-learn's handwritten digits.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "examples,tensorboard,plot"
exec .venv/bin/python examples/fabric_digits.py "$@"
