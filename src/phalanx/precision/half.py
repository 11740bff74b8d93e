"""``"bf16-true"`` and ``"16-true"``: parameters, inputs and compute in a half type."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.precision.base import Precision, to_float32
from phalanx.utils.errors import MisconfigurationError

_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


class HalfPrecision(Precision):
    """Parameters, inputs and compute all in ``bfloat16`` or ``float16``; outputs come back as float32."""

    def __init__(self, precision: str = "16-true") -> None:
        if precision not in _DTYPES:
            raise MisconfigurationError(f"HalfPrecision(precision={precision!r}): choose 'bf16-true' or '16-true'.")
        self.name = precision
        self.param_dtype = _DTYPES[precision]

    def convert_output(self, data: Any) -> Any:
        return to_float32(data)


__all__ = ["HalfPrecision"]
