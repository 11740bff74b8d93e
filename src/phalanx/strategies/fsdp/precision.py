"""Mixed precision on sharded (DTensor) parameters and gradients.

Apart from the strategy because two strategies use it: FSDP casts parameters itself
(:class:`FSDPMixedPrecision`, no autocast), while tensor parallelism with FSDP
(:mod:`phalanx.strategies.model_parallel`) cannot inject FSDP's policy and keeps autocast
(:class:`ShardedMixedPrecision`). Both need the loss scaler's found-inf reduction guarded as a collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from phalanx.precision import MixedPrecision
from phalanx.utils.compat import MixedPrecisionPolicy


class ShardedMixedPrecision(MixedPrecision):
    """:class:`~phalanx.precision.MixedPrecision` (autocast) on sharded (DTensor) gradients. Loss scaling
    is its ``torch.amp.GradScaler``: on DTensor gradients torch all-reduces the found-inf flag over the
    mesh, so an overflow in one rank's shard skips the step on every rank (shards would diverge
    otherwise). That all-reduce is a collective: the ranks meet first, so a rank that never steps
    makes the others raise (naming this op) instead of waiting for the process-group timeout."""

    def __init__(
        self, dtype: torch.dtype, device_type: str, guarded: Callable[[str], contextlib.AbstractContextManager[None]]
    ) -> None:
        super().__init__(dtype, device_type)
        self._guarded = guarded

    def _unscale(self, optimizer: Optimizer) -> None:
        with self._guarded("loss scaler (inf/nan in any gradient shard)"):
            super()._unscale(optimizer)


class FSDPMixedPrecision(ShardedMixedPrecision):
    """``bf16-mixed``/``16-mixed`` done by FSDP2 itself: parameters are all-gathered and used in
    ``dtype``, gradients are reduced and kept in float32, and the optimizer updates float32 shards.
    There is no autocast: FSDP casts parameters and floating-point inputs."""

    def policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


__all__ = ["FSDPMixedPrecision", "ShardedMixedPrecision"]
