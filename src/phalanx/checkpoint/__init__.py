"""Checkpoints: one layer for every strategy (atomic publish, safe reads, one strict check and one
mismatch report). Strategies plug in through :mod:`phalanx.checkpoint.protocol`."""

from phalanx.checkpoint.format import MARKER, META_KEY, check_plain, find_unsafe, read_file
from phalanx.checkpoint.layer import (
    Found,
    consolidate,
    find,
    load,
    load_raw,
    read_everything,
    remove,
    save,
)
from phalanx.checkpoint.newest import complete, finished_at, latest, missing
from phalanx.checkpoint.state import load_into_module

__all__ = [
    "MARKER",
    "META_KEY",
    "Found",
    "check_plain",
    "complete",
    "consolidate",
    "find",
    "find_unsafe",
    "finished_at",
    "latest",
    "load",
    "load_into_module",
    "load_raw",
    "missing",
    "read_everything",
    "read_file",
    "remove",
    "save",
]
