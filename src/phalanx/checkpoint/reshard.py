"""Loading one backend's shards into a strategy that lays its tensors out differently.

A sharded checkpoint is written in its backend's own layout (DCP's per-rank shards, DeepSpeed's ZeRO
partitions). A strategy that cannot re-cut that layout itself (DeepSpeed cannot read DCP; its ZeRO
partitions are flattened per parameter group) still resumes from it: every rank reads the full state
through the checkpoint layer's one reader (``sources.read_everything``: full CPU tensors, the optimizer
in torch's index-keyed layout) and hands it to the strategy's full-state load, the same path a
single-file checkpoint takes. That costs a full copy of the state per rank in CPU memory, which is
why a strategy's native reader is preferred whenever it has one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from phalanx.checkpoint.protocol import MODULE, OPTIMIZER, Entry, Shapes, ShardIO, StateOwner, of_kind
from phalanx.checkpoint.sources import read_everything
from phalanx.utils.errors import CheckpointError, CollectiveError


class FullStateReader:
    """Reads ``source``'s shards in full and loads them through ``owner``'s full-state path (a ``ShardIO``
    for reading only)."""

    def __init__(self, source: ShardIO, owner: StateOwner) -> None:
        self.source, self.owner = source, owner
        self.layout = source.layout

    def write(self, directory: Path, entries: list[Entry]) -> dict[str, Any]:
        raise CheckpointError(f"{self.layout} shards are only read here; {self.owner.name!r} saves its own layout.")

    def check(self, directory: Path, info: dict[str, Any], entries: list[Entry], weights_only: bool = True) -> None:
        self.source.check(directory, info, entries, weights_only)

    def saved_shapes(self, directory: Path, info: dict[str, Any], key: str) -> Shapes | None:
        return self.source.saved_shapes(directory, info, key)

    def read(self, directory: Path, info: dict[str, Any], entries: list[Entry], strict: bool) -> None:
        with converting(directory, info, self.layout, f"{self.owner.name!r} on {self.owner.world_size} ranks"):
            # Every rank reads everything for itself (no collective), so the strategy's load below sees the
            # same full state on every rank, as with a single file that every rank reads. Rank 0 verified the
            # checksums before any rank reads (the layer's load plan).
            full = read_everything(directory, verify=False)
            missing = [e.key for e in entries if e.key not in full]
            if missing:
                raise CheckpointError(f"the shards hold no entry {missing}, only {sorted(full)}")
            # Modules first, then optimizers: the order the checkpoint layer loads in on every strategy.
            for e in of_kind(entries, MODULE):
                self.owner.scatter_module_state(e.obj, full[e.key], strict, False)
            for e in of_kind(entries, OPTIMIZER):
                self.owner.scatter_optimizer_state(e.module, e.obj, full[e.key], False)


@contextlib.contextmanager
def converting(directory: Path, info: dict[str, Any], layout: str, loader: str) -> Iterator[None]:
    """A failure while converting names the pair (what wrote the checkpoint -> ``loader``, what loads it);
    the cause it carries says what to do."""
    try:
        yield
    except CollectiveError:
        raise  # the ranks are out of step: the guard has told every rank already
    except Exception as err:
        saved = f"{layout} shards" + (f" of ZeRO stage {info['stage']} on {info.get('world_size')} ranks"
                                      if "stage" in info else "")
        cause = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
        raise CheckpointError(f"Converting {directory} ({saved} -> {loader}) failed: {cause}") from err


__all__ = ["FullStateReader", "converting"]
