"""Fully sharded data parallelism on torch's FSDP2 (``fully_shard``): the strategy (``strategy``) and its
parts: the sharding policy (``units``), the call-order guards (``guards``), gradients across shards
(``gradients``), mixed precision on DTensors (``precision``) and checkpoint I/O (``checkpoint``)."""

from phalanx.strategies.fsdp.precision import FSDPMixedPrecision, ShardedMixedPrecision
from phalanx.strategies.fsdp.strategy import FSDPStrategy

__all__ = ["FSDPMixedPrecision", "FSDPStrategy", "ShardedMixedPrecision"]
