"""Lightning's utilities under their names (``lightning.fabric.utilities`` / ``lightning.pytorch.utilities``):
``rank_zero_only`` and friends, ``AttributeDict``, ``ThroughputMonitor`` / ``measure_flops``, and the
submodules ``load`` (``_lazy_load``), ``throughput``, ``init`` (``_materialize_meta_tensors``) and ``testing``
(``_runif_reasons``). A facade for users: the code lives in phalanx's layers and no phalanx module imports this.

A ported ``@rank_zero_only`` helper runs on global rank 0 only, never once per rank. The rank is this
process's global rank from the launcher's environment (``RANK``; 0 in a single process), which every
phalanx launch path sets.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

from phalanx.core.hparams import AttributeDict
from phalanx.fabric.throughput import Throughput, ThroughputMonitor, measure_flops
from phalanx.utils import diagnostics

F = TypeVar("F", bound=Callable[..., Any])


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def rank_zero_only(fn: F) -> F:
    """Run ``fn`` on global rank 0 only (returns None elsewhere)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if _rank() == 0 else None

    return wrapped  # type: ignore[return-value]


def rank_zero_info(message: str, *args: Any, **kwargs: Any) -> None:
    diagnostics.info(str(message), rank=_rank())


def rank_zero_debug(message: str, *args: Any, **kwargs: Any) -> None:
    if _rank() == 0:
        diagnostics.logger.debug(str(message))


def rank_zero_warn(message: str, *args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    diagnostics.warn(str(message), rank=_rank(), stacklevel=2)


__all__ = [
    "AttributeDict",
    "Throughput",
    "ThroughputMonitor",
    "measure_flops",
    "rank_zero_debug",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
]
