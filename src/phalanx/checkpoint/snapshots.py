"""Where to resume from: the newest complete checkpoint in some folders (:func:`latest`), and where per-step
snapshots live (shared by ``callbacks.Snapshot`` for the Trainer and ``fabric.save_snapshot`` for Fabric).

A snapshot is an ordinary phalanx checkpoint (atomic: complete or absent) written to node-local shared
memory, which outlives the processes but not the node. The folder is derived from something that stays the
same across attempts of one run (the Trainer's ``default_root_dir``; the Fabric script and working
directory), so a restarted or rerun attempt finds it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
from pathlib import Path

from phalanx.checkpoint.format import MARKER

SHARED_MEMORY = Path("/dev/shm")
PATTERN = "snapshot-step=*.ckpt"


def default_dir(*key: str | Path) -> Path:
    """``/dev/shm/phalanx-snapshots/<hash of key>``: one folder per run, the same for each of its attempts."""
    digest = hashlib.sha1("\0".join(str(Path(k).absolute()) for k in key).encode()).hexdigest()[:12]
    return SHARED_MEMORY / "phalanx-snapshots" / digest


def usable(folder: Path) -> bool:
    """Whether snapshots can be written under ``folder`` (its nearest existing parent is writable)."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return os.access(probe, os.W_OK)


def path_for(folder: Path, step: int) -> Path:
    return folder / f"snapshot-step={step:09d}.ckpt"


def existing(folder: Path) -> list[Path]:
    """The snapshots in ``folder``, oldest first (the step is in the name, zero-padded)."""
    return sorted(folder.glob(PATTERN)) if folder.is_dir() else []


#: What :func:`latest` counts as a checkpoint file (a directory counts when it holds the marker).
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth")


def latest(directories: list[Path], pattern: str = "*") -> Path | None:
    """The newest complete checkpoint in ``directories`` (files named ``*.ckpt``/``*.pt``/``*.pth``, and
    sharded directories whose marker exists), by the time its save finished; None when there is none.
    Hidden entries (saves in progress, the previous copy kept while one is replaced) are not candidates:
    an interrupted save never wins over the checkpoint it was replacing. ``pattern`` (fnmatch) narrows the
    names. No process group needed."""
    best: tuple[float, Path] | None = None
    for directory in directories:
        if not directory.is_dir():
            continue
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
