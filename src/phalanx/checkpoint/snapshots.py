"""Where per-step snapshots live, and keeping only the newest: shared by ``callbacks.Snapshot`` (Trainer)
and ``fabric.save_snapshot`` (Fabric).

A snapshot is an ordinary phalanx checkpoint (atomic: complete or absent) written to node-local shared
memory, which outlives the processes but not the node. The folder is derived from something that stays the
same across attempts of one run (the Trainer's ``default_root_dir``; the Fabric script and working
directory), so a restarted or rerun attempt finds it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

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
