"""Checkpoints: one layer for every strategy (atomic publish, safe reads, one strict check and one
mismatch report), and its snapshot tier (:mod:`phalanx.checkpoint.snapshot`).

What this package exports is the layer's public surface: the only names code above the strategies
uses (the ``checkpoint-facade`` contract in ``pyproject.toml``). What a strategy implements and hands
over (``protocol``), the format and how files are published (``format``, ``checksums``, ``storage``),
the one reader (``sources``) and the backends (``dcp``, ``deepspeed_shards``, ``reshard``,
``async_sharded``) are for ``phalanx.strategies`` and ``phalanx.offline`` only (``checkpoint-backends``).
"""

from typing import TYPE_CHECKING, Any

from phalanx.checkpoint.format import MARKER, META_KEY, check_plain, find_unsafe, read_file
from phalanx.checkpoint.layer import load, load_raw, remove, save
from phalanx.checkpoint.newest import finished_at, latest
from phalanx.checkpoint.protocol import Wrapper
from phalanx.checkpoint.sources import Found, find, read_everything
from phalanx.checkpoint.state import load_into_module

if TYPE_CHECKING:
    from phalanx.checkpoint.async_sharded import AsyncCheckpoint


def __getattr__(name: str) -> Any:
    # The handle of an asynchronous save: its module imports DCP's saver, which a plain `import phalanx`
    # need not pay for.
    if name == "AsyncCheckpoint":
        from phalanx.checkpoint.async_sharded import AsyncCheckpoint

        return AsyncCheckpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MARKER",
    "META_KEY",
    "AsyncCheckpoint",
    "Found",
    "Wrapper",
    "check_plain",
    "find",
    "find_unsafe",
    "finished_at",
    "latest",
    "load",
    "load_into_module",
    "load_raw",
    "read_everything",
    "read_file",
    "remove",
    "save",
]
