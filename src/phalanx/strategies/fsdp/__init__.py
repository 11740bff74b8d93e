"""Fully sharded data parallelism on torch's FSDP2 (``fully_shard``): the strategy and its parts."""

from phalanx.strategies.fsdp.strategy import FSDPMixedPrecision, FSDPStrategy, ShardedMixedPrecision

__all__ = ["FSDPMixedPrecision", "FSDPStrategy", "ShardedMixedPrecision"]
