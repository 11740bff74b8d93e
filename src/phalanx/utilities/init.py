"""``lightning.fabric.utilities.init`` names (phalanx.utils.init): skipping default initialisation, and
materialising modules created on the meta device."""

from phalanx.utils.init import SkipInit as _EmptyInit
from phalanx.utils.init import materialize_meta_tensors as _materialize_meta_tensors

__all__ = ["_EmptyInit", "_materialize_meta_tensors"]
