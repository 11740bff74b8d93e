"""``"64-true"``: parameters, inputs and compute in float64."""

from __future__ import annotations

import torch

from phalanx.precision.base import Precision


class DoublePrecision(Precision):
    name = "64-true"
    param_dtype = torch.float64


__all__ = ["DoublePrecision"]
