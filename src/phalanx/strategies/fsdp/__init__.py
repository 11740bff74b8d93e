"""Fully sharded data parallelism on torch's FSDP2 (``fully_shard``): the strategy (``strategy``) and its
parts: the sharding policy (``units``), the call-order guards (``guards``), gradients across shards
(``gradients``) and checkpoint I/O (``checkpoint``). Mixed precision is the precision's own
(:mod:`phalanx.precision`), placed by ``ShardedStrategy.precision_placement``."""

from phalanx.strategies.fsdp.strategy import FSDPStrategy

__all__ = ["FSDPStrategy"]
