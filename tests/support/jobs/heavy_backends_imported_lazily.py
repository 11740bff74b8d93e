"""phalanx.strategies imports FSDP, model parallel and DeepSpeed only when one is asked for (run by
tests/strategies/test_registry.py)."""

import sys
from typing import Any

import phalanx  # noqa: F401
import phalanx.strategies as s

heavy = ("phalanx.strategies.fsdp", "phalanx.strategies.model_parallel", "phalanx.strategies.deepspeed",
         "torch.distributed.fsdp", "deepspeed")


def loaded() -> Any:
    return sorted(m for m in sys.modules if m.startswith(heavy))


assert not loaded(), loaded()
assert "fsdp" in s.available_strategies()
assert not loaded(), loaded()
assert s.FSDPStrategy.__name__ == "FSDPStrategy" and "phalanx.strategies.fsdp.strategy" in sys.modules
assert s.ModelParallelStrategy.__name__ == "ModelParallelStrategy"
assert s.DeepSpeedStrategy.__name__ == "DeepSpeedStrategy" and "deepspeed" not in sys.modules
