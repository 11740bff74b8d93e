"""Checkpoints: one layer for every strategy (atomic publish, safe reads, one strict check and one
mismatch report). Strategies plug in through :mod:`phalanx.checkpoint.protocol`."""

from phalanx.checkpoint.format import MARKER, META_KEY, check_plain, read_file
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
from phalanx.checkpoint.newest import finished_at, latest

__all__ = [
    "MARKER",
    "META_KEY",
    "Found",
    "check_plain",
    "consolidate",
    "find",
    "finished_at",
    "latest",
    "load",
    "load_raw",
    "read_everything",
    "read_file",
    "remove",
    "save",
]
