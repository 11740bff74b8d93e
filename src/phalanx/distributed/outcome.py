"""One outcome on every rank: a step that fails on one rank raises on all of them.

A rank that fails alone while its peers go on to the next collective leaves them waiting for it, and
the user sees a hang (or a timeout) far from the cause. ``run_together`` runs a step on every rank and
``run_on_rank0`` on rank 0 alone; either way every rank then learns, through one small all-gather,
whether the step failed anywhere, and raises the same error: the failing rank its own, the others one
that names the failing rank and its message.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from phalanx.utils.errors import CollectiveError, PhalanxError

T = TypeVar("T")


class Ranks(Protocol):
    """What the two functions use of a strategy."""

    @property
    def global_rank(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...
    def all_gather_object(self, obj: Any, name: str = "all_gather_object") -> list[Any]: ...


def _describe(err: BaseException, error: type[PhalanxError]) -> tuple[type[PhalanxError], str]:
    """What the other ranks learn of a failure: the class to raise (the error's own where it is an
    ``error``, whose advice then holds for every rank, e.g. a corrupt checkpoint's) and the error in words."""
    if isinstance(err, error):
        return type(err), str(err)
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return error, f"{type(err).__name__}: {err}{where}"


def _raise_failure(ranks: Ranks, own: BaseException | None, statuses: list[Any], what: str,
                   error: type[PhalanxError]) -> None:
    failed = [(rank, status) for rank, status in enumerate(statuses) if status is not None]
    if not failed:
        return
    if own is not None:
        if isinstance(own, error):
            raise own
        raise error(f"{what} failed on rank {ranks.global_rank}: {_describe(own, error)[1]}") from own
    rank, (kind, text) = failed[0]
    raise kind(f"{what} failed on rank {rank}: {text}")


def run_together(ranks: Ranks, name: str, what: str, fn: Callable[[], T], error: type[PhalanxError]) -> T:
    """Run ``fn`` on every rank; if it failed anywhere, every rank raises ``error`` (the failing rank its
    own error). ``name`` names the all-gather for the lockstep guard; ``what`` starts the message."""
    result: Any = None
    own: BaseException | None = None
    try:
        result = fn()
    except CollectiveError:
        raise  # the ranks are out of step already: the guard has said so to everyone
    except Exception as err:
        own = err
    statuses = ranks.all_gather_object(None if own is None else _describe(own, error), name=name)
    _raise_failure(ranks, own, statuses, what, error)
    return result  # type: ignore[no-any-return]


def run_on_rank0(ranks: Ranks, name: str, what: str, fn: Callable[[], T], error: type[PhalanxError]) -> T:
    """Run ``fn`` on rank 0 and hand its result (or its failure, as ``error``) to every rank."""
    result: Any = None
    own: BaseException | None = None
    if ranks.is_global_zero:
        try:
            result = fn()
        except CollectiveError:
            raise
        except Exception as err:
            own = err
    shared = ranks.all_gather_object((result, None if own is None else _describe(own, error))
                                     if ranks.is_global_zero else None, name=name)[0]
    _raise_failure(ranks, own, [shared[1]], what, error)
    return shared[0]  # type: ignore[no-any-return]
