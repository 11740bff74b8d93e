"""How phalanx speaks to its user outside of exceptions: one place, so users can filter it.

* Something the user should change -> :func:`warn`: a :class:`~phalanx.utils.errors.PhalanxWarning` (a
  ``UserWarning``). ``warnings.filterwarnings("ignore", category=phalanx.errors.PhalanxWarning)`` silences
  all of them, ``-W error::phalanx.errors.PhalanxWarning`` makes a test suite fail on them, and Python shows
  each once per call site.
* Progress and notices (waiting for a slow rank, resuming from a checkpoint) -> :func:`info` and
  :func:`notice`, on the ``"phalanx"`` logger. It prints to stderr as ``[phalanx] ...`` unless the
  application configured logging before importing phalanx (then records go to its handlers).

Every function takes ``rank``: pass the caller's global rank to speak on rank 0 only, so N ranks do
not print the same line N times; leave it None for what only this rank knows. What a run says once
(the seed, the model summary) goes through :func:`once_per_run`, which a restarted attempt, or a rank
re-running the script its launcher already ran, does not repeat.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import TextIO

import torch.distributed as dist

from phalanx.utils.errors import PhalanxWarning

logger = logging.getLogger("phalanx")

#: Set by ``fabric.launch()`` under ``python train.py`` for the ranks it starts by re-running the script: the
#: launching process ran the script up to that call and said what it said on the way (the seed), so a rank
#: does not say that again before it joins the job.
RELAUNCHED_VARIABLE = "PHALANX_RELAUNCHED"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is when a record comes: a progress bar may have put its own there (rich's
    live display does, so that a line goes above the bar instead of through it)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always the current sys.stderr


def _configure_default_handler() -> None:
    # A library normally leaves handlers to the application; but progress notices nobody sees are
    # useless, so when nothing is configured yet phalanx prints its own records (as Lightning does).
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("[phalanx] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


_configure_default_handler()


def warn(message: str, *, rank: int | None = None, stacklevel: int = 2) -> None:
    """An actionable warning (shown once per call site); with ``rank``, only rank 0 warns."""
    if rank is not None and rank != 0:
        return
    warnings.warn(message, PhalanxWarning, stacklevel=stacklevel + 1)


def info(message: str, *, rank: int | None = None) -> None:
    """Progress a user may want to see (INFO on the ``phalanx`` logger)."""
    if rank is None or rank == 0:
        logger.info(message)


def notice(message: str, *, rank: int | None = None) -> None:
    """Something unusual that is not an error (WARNING on the ``phalanx`` logger), e.g. a slow rank."""
    if rank is None or rank == 0:
        logger.warning(message)


def restarted() -> bool:
    """Whether this process belongs to an attempt torch's elastic agent restarted (``max_restarts``): what a run
    says once, its first attempt said."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")


def once_per_run(message: str, *, rank: int | None = None) -> None:
    """:func:`info` that a run says once: not on a restarted attempt, and not by a rank that re-runs the script
    its launcher ran (:data:`RELAUNCHED_VARIABLE`) before that rank joined the job, where the launching process
    already said it."""
    if restarted():
        return
    if os.environ.get(RELAUNCHED_VARIABLE) == "1" and not (dist.is_available() and dist.is_initialized()):
        return
    info(message, rank=rank)
