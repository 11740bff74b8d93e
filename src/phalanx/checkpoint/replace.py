"""Replacing a checkpoint of the other layout: a run that changes strategy saves where its earlier
attempt did (``last.ckpt``), but one writes a single file and the other a directory. A phalanx
checkpoint of either layout is replaced atomically, once the new one is complete (``storage``'s
exchange or its two renames); anything at the path that is not a phalanx checkpoint is never replaced.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import phalanx.checkpoint.storage as storage
from phalanx.checkpoint.format import META_KEY


def is_checkpoint_file(path: Path) -> bool:
    """Whether the file at ``path`` is a phalanx single-file checkpoint. Reads only the pickle of torch's
    zip archive (no tensors), looking for phalanx's metadata key."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"]
            return bool(pickles) and META_KEY.encode() in archive.read(pickles[0])
    except (OSError, zipfile.BadZipFile):
        return False


def publish_directory(tmp: Path, path: Path) -> None:
    """Rank 0 moves the finished checkpoint directory ``tmp`` to ``path``. A phalanx single-file checkpoint
    there (the earlier attempt of a run that changed strategy) is replaced atomically, as a directory
    would be; a file that is not a checkpoint stops the publish."""
    storage.publish_dir(tmp, path, replace_file=path.is_file() and is_checkpoint_file(path))


__all__ = ["is_checkpoint_file", "publish_directory"]
