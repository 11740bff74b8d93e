#!/usr/bin/env bash
# Run a subset of the suite against the oldest torch phalanx supports and the newest pip offers, so a
# feature phalanx detects (or a private torch API it touches) breaking on either end shows up here
# rather than in a user's job. Usage:
#
#   scripts/torch_matrix.sh                  # torch 2.5.1 (pyproject's floor) and 2.14.1
#   scripts/torch_matrix.sh 2.6.0 2.13.0     # any versions pip can install here
#   TORCH_MATRIX_TESTS="tests/strategies/test_fsdp.py" scripts/torch_matrix.sh 2.5.1
#
# Each version gets its own throwaway venv under $TORCH_MATRIX_DIR (default /tmp/phalanx-torch-matrix),
# reused by the next run while it still holds that torch. phalanx itself is not installed there: the
# tests run the repository's src/ through PYTHONPATH (the 2-rank jobs inherit it). pip installs torch
# with its own dependencies: PyPI's Linux wheels are CUDA builds and do not import without the
# nvidia-* libraries, even on a CPU-only machine (torch 2.5.1: ~0.9 GB wheel + ~2.7 GB of CUDA libs).
# Exit status: 0 when every version that could be installed passed; the summary names the others.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PYTHON="${PYTHON:-python3}"
DIR="${TORCH_MATRIX_DIR:-/tmp/phalanx-torch-matrix}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ "$#" -gt 0 ]; then VERSIONS=("$@"); else VERSIONS=(2.5.1 2.14.1); fi
# Unit tests, then 2-rank DDP and FSDP jobs that go through every numerics path phalanx owns:
# equivalence with one process, clipping, 16-mixed loss scaling, a DCP checkpoint, bf16-mixed, the
# Trainer's accumulation on both strategies and its sampler seed. Where torch cannot run FSDP on CPU
# (2.5, 2.6) those tests skip, naming the reason, and test_bad_input checks phalanx refuses it.
DEFAULT_TESTS="tests/fabric/test_fabric.py tests/fabric/test_bad_input.py tests/trainer/test_trainer.py tests/callbacks/test_callbacks.py \
tests/strategies/test_fsdp.py tests/strategies/test_fsdp_checkpoint.py::test_sixteen_mixed_scaler_state_round_trips \
tests/strategies/test_ddp.py::test_clip_gradients_and_init_module tests/strategies/test_ddp.py::test_ddp_training_equals_single_process \
tests/trainer/test_trainer_dist.py::test_accumulation_counts_and_parameters \
tests/trainer/test_trainer_dist.py::test_ranks_seeded_differently_still_shard_one_permutation"
read -r -a TESTS <<< "${TORCH_MATRIX_TESTS:-$DEFAULT_TESTS}"

mkdir -p "$DIR"
declare -A RESULT
for version in "${VERSIONS[@]}"; do
  venv="$DIR/torch-$version"
  echo "=== torch $version ($venv)"
  have() { "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; }
  if ! have; then
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv" && { "$venv/bin/pip" install -q "torch==$version" numpy tqdm pytest pytest-timeout \
      2>&1 | grep -v "^WARNING: Location"; }
    if ! have; then
      echo "[torch_matrix] torch $version could not be installed or imported here; skipped." >&2
      RESULT[$version]="not installable"
      continue
    fi
  fi
  "$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
  if PYTHONPATH="$ROOT/src" "$venv/bin/python" -m pytest -p no:cacheprovider -q -m "not slow" "${TESTS[@]}"; then
    RESULT[$version]="passed"
  else
    RESULT[$version]="FAILED"
  fi
done

echo "=== summary"
status=0
for version in "${VERSIONS[@]}"; do
  echo "torch $version: ${RESULT[$version]}"
  [ "${RESULT[$version]}" = "FAILED" ] && status=1
done
exit "$status"
