"""Where to resume from: the newest complete checkpoint or snapshot in some folders."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import phalanx.checkpoint.snapshot as snapshot
from phalanx.checkpoint.format import MARKER

#: What :func:`latest` counts as a checkpoint file (a directory counts when it holds the marker).
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth")


def latest(directories: list[Path], pattern: str = "*", world_size: int | None = None) -> Path | None:
    """The newest complete checkpoint in ``directories`` (files named ``*.ckpt``/``*.pt``/``*.pth``, and
    sharded directories whose marker exists, snapshots every rank finished), by the time its save finished;
    None when there is none.
    Hidden entries (saves in progress, the previous copy kept while one is replaced) are not candidates:
    an interrupted save never wins over the checkpoint it was replacing. ``pattern`` (fnmatch) narrows the
    names. ``world_size``: only snapshots written by that many ranks (one resumes its own topology only).
    No process group needed."""
    best: tuple[float, Path] | None = None
    for directory in directories:
        if not directory.is_dir():
            continue
        for step, (world, when) in snapshot.complete_steps(directory).items():
            ref = snapshot.reference(directory, step)
            if world_size not in (None, world) or not fnmatch.fnmatch(ref.name, pattern):
                continue
            if best is None or when > best[0]:
                best = (when, ref)
        for entry in directory.iterdir():
            if entry.name.startswith(".") or not fnmatch.fnmatch(entry.name, pattern):
                continue
            if entry.is_dir():
                stamp = entry / MARKER  # written last: its time is when the save finished
                if not stamp.is_file():
                    continue
            elif entry.is_file() and entry.suffix in CHECKPOINT_SUFFIXES:
                stamp = entry
            else:
                continue
            when = stamp.stat().st_mtime
            if best is None or when > best[0]:
                best = (when, entry)
    return best[1] if best is not None else None


def finished_at(path: Path) -> float:
    """When the save of the checkpoint or snapshot at ``path`` finished (0.0 if it is not complete)."""
    if snapshot.is_reference(path):
        return snapshot.finished_at(path)
    stamp = path / MARKER if path.is_dir() else path
    try:
        return stamp.stat().st_mtime
    except FileNotFoundError:
        return 0.0
