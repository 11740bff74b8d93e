"""The state one replica group hands another that (re)joins a fault-tolerant job (:mod:`phalanx.distributed.
replica_groups`): built from a live group's ``state`` dict, sent over the network by torchft's checkpoint transport,
checked and put in place on the receiving group. A tier of the checkpoint layer, like snapshots: the same
``state`` dict, the same sorting of its entries, the same per-rank parts (each rank of the receiving group gets the
part of the rank with its number in the sending group: a shard stays a shard, no collective), the same checksums.

What arrives is refused, with nothing applied, unless it is whole and of this version: the format version, the
strategy, the group's size and the rank must be the receiver's, every entry the receiver's ``state`` asks for must
be there, and every tensor must match the CRC-32 computed on the sender (:mod:`phalanx.checkpoint.checksums`).
Only tensors and plain values travel (a DTensor as its local shard), so the receiver opens the bytes with
``weights_only=True``: nothing a peer sends runs code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import phalanx.checkpoint.checksums as checksums
from phalanx.checkpoint.format import FORMAT_VERSION, check_plain
from phalanx.checkpoint.protocol import MODULE, OPTIMIZER, STATEFUL, StateOwner
from phalanx.checkpoint.snapshot import place
from phalanx.checkpoint.snapshot.format import LocalShard
from phalanx.checkpoint.state import sort_state
from phalanx.utils.errors import CheckpointError, CorruptCheckpointError

#: The layout recorded in a peer payload's checksums (it is never a file).
PEER_LAYOUT = "peer"
#: How a DTensor's local shard travels (a plain dict: the receiver's weights_only unpickler knows no classes).
_SHARD = "__phalanx_local_shard__"


def _plain(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local shard, marked."""
    if isinstance(value, torch.Tensor):
        to_local = None if type(value) in (torch.Tensor, torch.nn.Parameter) else getattr(value, "to_local", None)
        return {_SHARD: to_local().detach()} if to_local is not None else value.detach()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [_plain(v) for v in value]
        return out if isinstance(value, list) else tuple(out)
    return value


def _shards(value: Any) -> Any:
    """The inverse of :func:`_plain`: marked shards become :class:`LocalShard` (what ``load_local_state`` takes)."""
    if isinstance(value, dict):
        if len(value) == 1 and _SHARD in value:
            return LocalShard(value[_SHARD])
        return {k: _shards(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [_shards(v) for v in value]
        return out if isinstance(value, list) else tuple(out)
    return value


def build(owner: StateOwner, state: dict[str, Any], local_state: Any) -> dict[str, Any]:
    """This rank's part of ``state`` as a peer receives it: entries (modules and optimizers as ``local_state``
    gives them, no collective), the precision's state, who sent it, and the checksums of all of it. Tensors are
    the live ones, not copies: the transport serves them until this group's next optimizer step."""
    entries: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for e in sort_state(state):
        if e.kind in (MODULE, OPTIMIZER):
            value = local_state(e.kind, e.obj, e.module)
        elif e.kind == STATEFUL:
            value = e.obj.state_dict()
        else:
            value = e.obj
        entries[e.key] = _plain(value)
        kinds[e.key] = e.kind
    check_plain(entries, "state")
    return {
        "format_version": FORMAT_VERSION, "strategy": owner.name, "world_size": owner.world_size,
        "rank": owner.global_rank, "precision": owner.precision.state_dict(), "kinds": kinds, "entries": entries,
        "checksums": checksums.of_state(entries, PEER_LAYOUT),
    }


def nbytes(payload: dict[str, Any]) -> int:
    """The tensor bytes of a payload."""
    total = 0
    stack: list[Any] = [payload.get("entries")]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            stack += value.values()
        elif isinstance(value, (list, tuple)):
            stack += value
    return total


def check(owner: StateOwner, state: dict[str, Any], payload: Any, source: str) -> None:
    """Refuse a payload that is not whole, not of this format, or not for this rank (``source`` names the sender)."""
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        version = payload.get("format_version") if isinstance(payload, dict) else None
        raise CheckpointError(f"The state received from {source} is of format {version}; this phalanx reads format "
                              f"{FORMAT_VERSION}. Every replica group must run the same phalanx version.")
    expected = {"strategy": owner.name, "world_size": owner.world_size, "rank": owner.global_rank}
    differs = [f"{k} {payload.get(k)!r} (here {v!r})" for k, v in expected.items() if payload.get(k) != v]
    if differs:
        raise CheckpointError(f"The state received from {source} does not fit this group: {', '.join(differs)}. "
                              "Every replica group must run the same strategy on the same number of processes.")
    entries = payload.get("entries")
    record = payload.get("checksums")
    if not isinstance(entries, dict) or not isinstance(record, dict) or record.get("layout") != PEER_LAYOUT:
        raise CheckpointError(f"The state received from {source} has no entries or no checksums; it was refused.")
    missing = [e.key for e in sort_state(state) if e.key not in entries]
    if missing:
        raise CheckpointError(f"The state received from {source} has no {missing}; it holds {sorted(entries)}. "
                              "Every replica group must register the same state (fabric.join_replica_groups).")
    found = checksums.check_state(entries, record, Path(source))
    if found:
        m = found[0]
        what = f"tensor {m.key!r} of entry {m.entry!r}" if m.key else f"entry {m.entry!r} ({m.detail})"
        raise CorruptCheckpointError(f"The state received from {source} is corrupt: {what} does not match the "
                                     f"checksum computed by the sender ({len(found)} mismatch(es)). Nothing of it "
                                     "was applied.")


def apply(owner: StateOwner, state: dict[str, Any], payload: dict[str, Any], source: str) -> None:
    """Check ``payload`` (:func:`check`), then put it into ``state`` in place: modules and optimizers through the
    strategy's ``load_local_state`` (no collective), objects with ``load_state_dict``, plain values replaced."""
    check(owner, state, payload, source)
    entries = sort_state(state)
    place(owner, entries, state, {e.key: _shards(payload["entries"][e.key]) for e in entries}, True)
    if payload.get("precision"):
        owner.precision.load_state_dict(payload["precision"])


__all__ = ["PEER_LAYOUT", "apply", "build", "check", "nbytes"]
