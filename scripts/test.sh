#!/usr/bin/env bash
# Set up .venv with the test extras and run the whole suite: ruff, mypy --strict, import-linter, pytest.
# Tests marked `slow` run only with PHALANX_TEST_ALL=1; `gpu` tests skip where no CUDA device exists.
# --fast: the edit-test loop (under 2 minutes): ruff, then the tests that start no process (a test that would
# start one skips there); mypy, import-linter and the jobs are the full run's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "test"
.venv/bin/ruff check src tests examples bench
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest -m "not slow" --fast -q "$@"
fi
# One process over both trees: torch's stubs are analysed once. tests/support holds the job programs.
.venv/bin/mypy --strict src tests/support
# The layers of docs/architecture.md: import only downward, no import cycle (contracts in pyproject.toml).
.venv/bin/lint-imports --no-cache
MARK="not slow"
if [ "${PHALANX_TEST_ALL:-0}" = "1" ]; then
  MARK=""
  # The LitGPT port's own environments (tests/integration/test_litgpt_port.py skips, naming the script, without them).
  bash scripts/litgpt_env.sh || echo "[test] WARNING: scripts/litgpt_env.sh failed; the LitGPT port tests will skip." >&2
fi
exec .venv/bin/python -m pytest -m "$MARK" "$@"
