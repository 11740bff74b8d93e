"""Where to resume from: the newest complete checkpoint or snapshot in some folders."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import phalanx.checkpoint.snapshot as snapshot
from phalanx.checkpoint.format import MARKER

#: What :func:`latest` counts as a checkpoint file (a directory counts when it holds the marker).
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth")


def latest(directories: list[Path], pattern: str = "*", world_size: int | None = None) -> Path | None:
    """The newest complete checkpoint in ``directories`` (see :func:`complete`); None when there is none.
    No process group needed."""
    found = complete(directories, pattern, world_size)
    return found[0][1] if found else None


def complete(directories: list[Path], pattern: str = "*", world_size: int | None = None) -> list[tuple[float, Path]]:
    """Every complete checkpoint in ``directories`` (files named ``*.ckpt``/``*.pt``/``*.pth``, and sharded
    directories whose marker exists, snapshots every rank finished) with the time its save finished, newest
    first. Hidden entries (saves in progress, the previous copy kept while one is replaced) are not
    candidates: an interrupted save never wins over the checkpoint it was replacing. ``pattern`` (fnmatch)
    narrows the names. ``world_size``: only snapshots written by that many ranks (one resumes its own topology
    only)."""
    found: list[tuple[float, Path]] = []
    for directory in _unique(directories):
        if not directory.is_dir():
            continue
        for step, (world, when) in snapshot.complete_steps(directory).items():
            ref = snapshot.reference(directory, step)
            if world_size in (None, world) and fnmatch.fnmatch(ref.name, pattern):
                found.append((when, ref))
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
            found.append((stamp.stat().st_mtime, entry))
    return sorted(found, key=lambda item: item[0], reverse=True)


def _unique(folders: list[Path]) -> list[Path]:
    """``folders`` without repeats, a folder named two ways (relative, absolute) counted once, in their order."""
    seen: set[Path] = set()
    out = []
    for folder in folders:
        if folder.absolute() not in seen:
            seen.add(folder.absolute())
            out.append(folder)
    return out


def missing(path: str | Path, directories: list[Path] | None = None, shown: int = 8) -> str:
    """The words for a checkpoint ``path`` at which nothing exists: that, and the checkpoints that do exist in
    its folder and in ``directories`` (newest first, at most ``shown`` of them), or that there are none."""
    folders = [Path(path).parent, *(directories or [])]
    found = [p for _, p in complete(folders)]
    if not found:
        where = ", ".join(str(f) for f in _unique(folders))
        return f"{path} does not exist, and there is no checkpoint in {where}."
    more = f" and {len(found) - shown} older" if len(found) > shown else ""
    return (f"{path} does not exist. The checkpoints that do, newest first: "
            f"{', '.join(str(p) for p in found[:shown])}{more}.")


def finished_at(path: Path) -> float:
    """When the save of the checkpoint or snapshot at ``path`` finished (0.0 if it is not complete)."""
    if snapshot.is_reference(path):
        return snapshot.finished_at(path)
    stamp = path / MARKER if path.is_dir() else path
    try:
        return stamp.stat().st_mtime
    except FileNotFoundError:
        return 0.0
