"""``lightning.fabric.utilities.testing`` names (phalanx.utils.testing)."""

from phalanx.utils.testing import runif_reasons as _runif_reasons

__all__ = ["_runif_reasons"]
