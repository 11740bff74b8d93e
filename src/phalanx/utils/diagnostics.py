"""How phalanx speaks to its user outside of exceptions: one place, so users can filter it.

* Something the user should change -> :func:`warn`: a :class:`~phalanx.utils.errors.PhalanxWarning` (a
  ``UserWarning``). ``warnings.filterwarnings("ignore", category=phalanx.errors.PhalanxWarning)`` silences
  all of them, ``-W error::phalanx.errors.PhalanxWarning`` makes a test suite fail on them, and Python shows
  each once per call site.
* Progress and notices (waiting for a slow rank, resuming from a checkpoint) -> :func:`info` and
  :func:`notice`, on the ``"phalanx"`` logger. It prints to stderr as ``[phalanx] ...`` unless the
  application configured logging before importing phalanx (then records go to its handlers).

Every function takes ``rank``: pass the caller's global rank to speak on rank 0 only, so N ranks do
not print the same line N times; leave it None for what only this rank knows.
"""

from __future__ import annotations

import logging
import sys
import warnings

from phalanx.utils.errors import PhalanxWarning

logger = logging.getLogger("phalanx")


def _configure_default_handler() -> None:
    # A library normally leaves handlers to the application; but progress notices nobody sees are
    # useless, so when nothing is configured yet phalanx prints its own records (as Lightning does).
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
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
