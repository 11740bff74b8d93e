"""``lightning.fabric.plugins`` names a ported program constructs, for users (a facade: the code is
phalanx.fabric.plugins). phalanx has no plugin objects; see docs/porting.md for each equivalent."""

from phalanx.fabric.plugins import BitsandbytesPrecision

__all__ = ["BitsandbytesPrecision"]
