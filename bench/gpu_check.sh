#!/usr/bin/env bash
# The GPU check of issue 31, in one call (about 4 minutes on one H100): synchronizations per steady-state step
# (Fabric, Trainer, fsdp, model_parallel), GPT-2 small ms/step (raw, phalanx Fabric/Trainer/fsdp/ModelParallel,
# Lightning where importable), the snapshot's bytes, stall, GB/s and chosen cadence, and the CUDA tests. Prints
# one table (then one JSON line). Without a CUDA device it prints a skip line and exits 0.
# The fp8 rows of issue 42 (bench/gpu_fp8.py: a 0.9 B Llama, bf16 eager / bf16 + compile / fp8 + compile) add about
# 4 minutes; `--parts fp8` runs them alone, `--cpu-smoke --parts fp8` checks them on a CPU (needs torchao).
#
#   bash bench/gpu_check.sh [--reps 3] [--steps 20] [--no-tests]
#
# Uses the python on PATH (or $PYTHON) with torch installed, and phalanx from this checkout's src/; on a machine
# with only the package registries, `bash scripts/setup.sh test` first and run it with PYTHON=.venv/bin/python.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PHALANX_SHOW_TRACEBACKS="${PHALANX_SHOW_TRACEBACKS:-1}"
exec "$PYTHON" bench/gpu_check.py "$@"
