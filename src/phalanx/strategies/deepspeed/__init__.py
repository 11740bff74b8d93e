"""ZeRO stages 1-3 through DeepSpeed: the strategy (``strategy``), its config (``config``) and its
checkpoints (``checkpoint``). Importing this package imports no DeepSpeed; setting a model up does."""

from phalanx.strategies.deepspeed.config import build_zero_config
from phalanx.strategies.deepspeed.strategy import DeepSpeedPrecision, DeepSpeedStrategy, import_deepspeed

__all__ = ["DeepSpeedPrecision", "DeepSpeedStrategy", "build_zero_config", "import_deepspeed"]
