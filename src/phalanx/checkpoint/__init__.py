"""Checkpoint I/O: atomic single-file writes, validated reads, state collection and restoration."""

from phalanx.checkpoint.io import META_KEY, atomic_save, read_checkpoint

__all__ = ["META_KEY", "atomic_save", "read_checkpoint"]
