"""``lightning.fabric.utilities.load`` names: lazy, memory-mapped checkpoint loading (phalanx.offline.lazy)."""

from phalanx.offline.lazy import NotYetLoadedTensor as _NotYetLoadedTensor
from phalanx.offline.lazy import lazy_load as _lazy_load

__all__ = ["_NotYetLoadedTensor", "_lazy_load"]
