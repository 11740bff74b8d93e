"""``phalanx.Fabric`` and what it hands back: the facade over a strategy (``fabric``), the wrapped
module and optimizer (``wrappers``), distributed dataloaders (``data``), the meaning of its collectives
(``collectives``), non-finite checks (``anomaly``), ``torch.compile``d modules at setup (``compiled``), and
Lightning's ``throughput``, ``accelerators`` and ``plugins`` names (re-exported for users by the facades)."""

from phalanx.fabric.fabric import Fabric
from phalanx.fabric.wrappers import FabricModule, FabricOptimizer, is_wrapped

__all__ = ["Fabric", "FabricModule", "FabricOptimizer", "is_wrapped"]
