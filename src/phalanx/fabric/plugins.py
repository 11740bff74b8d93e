"""Lightning plugin classes that a ported program constructs, kept importable so the program starts.

phalanx has no plugin objects (``Fabric(plugins=...)`` is refused with each equivalent). Quantized
precision through bitsandbytes is the one a LitGPT-style program builds (only when the user asks to
quantize); phalanx does not quantize, so constructing it is refused at once with what to use instead.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.utils.errors import MisconfigurationError


class BitsandbytesPrecision:
    """Lightning's bitsandbytes quantization plugin (``mode`` like ``"nf4"``, ``"int8"``): refused."""

    def __init__(self, mode: str, dtype: torch.dtype | None = None, ignore_modules: Any = None) -> None:
        where = (
            "it needs a CUDA GPU and this machine has none, and phalanx does not quantize on any device"
            if not torch.cuda.is_available() else "phalanx does not quantize"
        )
        raise MisconfigurationError(
            f"BitsandbytesPrecision(mode={mode!r}) is not supported: {where}. Run without quantization "
            "(e.g. drop --quantize) and choose a lower precision instead: Fabric(precision='bf16-true') halves the "
            "memory of the weights (on CPU too), precision='bf16-mixed' keeps float32 weights; to fit a larger "
            "model, shard it with strategy='fsdp'."
        )
