"""``lightning.fabric.utilities.load`` names: lazy, memory-mapped checkpoint loading (phalanx.checkpoint.lazy)."""

from phalanx.checkpoint.lazy import NotYetLoadedTensor as _NotYetLoadedTensor
from phalanx.checkpoint.lazy import lazy_load as _lazy_load

__all__ = ["_NotYetLoadedTensor", "_lazy_load"]
