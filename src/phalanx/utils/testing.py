"""Why a test cannot run here: the conditions Lightning's ``_runif_reasons`` knows, answered for this machine.

A test suite ported from Lightning builds its ``RunIf`` marker on ``_runif_reasons(**conditions)``: it
returns the unmet conditions (the test is skipped when there are any, and the skip reason names them)
and keyword arguments for the ``pytest.mark.skipif`` mark.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import torch

#: Set to 1 to run the tests marked ``standalone`` (each needs a process of its own).
STANDALONE_VARIABLES = ("PHALANX_RUN_STANDALONE_TESTS", "PL_RUN_STANDALONE_TESTS")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _version_tuple(version: str) -> tuple[int, ...]:
    """Version numbers as integers: 2.6.0+cu124 -> (2, 6, 0), 2.7.0a0 -> (2, 7, 0)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d*", piece)
        if digits is None or not digits.group():
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def runif_reasons(
    *,
    min_cuda_gpus: int = 0,
    min_torch: str | None = None,
    max_torch: str | None = None,
    min_python: str | None = None,
    bf16_cuda: bool = False,
    tpu: bool = False,
    mps: bool | None = None,
    skip_windows: bool = False,
    standalone: bool = False,
    deepspeed: bool = False,
    dynamo: bool = False,
) -> tuple[list[str], dict[str, bool]]:
    """The unmet conditions (empty: the test can run) and the extra keyword arguments for the skip mark."""
    reasons: list[str] = []
    kwargs: dict[str, bool] = {}
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if min_cuda_gpus and cuda_count < min_cuda_gpus:
        reasons.append(f"GPUs>={min_cuda_gpus}")
    torch_version = _version_tuple(torch.__version__)
    if min_torch is not None and torch_version < _version_tuple(min_torch):
        reasons.append(f"torch>={min_torch}")
    if max_torch is not None and torch_version >= _version_tuple(max_torch):
        reasons.append(f"torch<{max_torch}")
    if min_python is not None and sys.version_info[:3] < _version_tuple(min_python):
        reasons.append(f"python>={min_python}")
    if bf16_cuda and not (cuda_count and torch.cuda.is_bf16_supported()):
        reasons.append("bf16 on CUDA")
    if tpu:
        reasons.append("TPU (phalanx runs on CPU and CUDA)")
    if mps is not None:
        available = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
        if mps and not available:
            reasons.append("MPS")
        elif not mps and available:
            reasons.append("no MPS")
    if skip_windows and sys.platform == "win32":
        reasons.append("not Windows")
    if standalone:
        if not any(os.environ.get(var) == "1" for var in STANDALONE_VARIABLES):
            reasons.append(f"standalone execution ({STANDALONE_VARIABLES[0]}=1)")
        kwargs["standalone"] = True
    if deepspeed and not _importable("deepspeed"):
        reasons.append("deepspeed")
    if dynamo:
        supported = _importable("torch._dynamo") and sys.platform != "win32"
        if not supported:
            reasons.append("torch.dynamo")
    return reasons, kwargs
