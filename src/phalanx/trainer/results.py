"""What ``self.log`` records, and how step and epoch values become identical on every rank.

Design choices, each fixing a known failure of managed loops:

* Accumulators are created on ``fabric.device`` (the device the backend reduces on) and restored
  there from checkpoints or snapshots: nothing here ever moves them elsewhere, so a later
  distributed reduction cannot meet a tensor on the wrong device.
* Epoch means are weighted by batch size, and the cross-rank reduction adds the per-rank weighted
  sums and weights: the result is the exact mean over every sample, however uneven the shards.
* All metrics of one step (or epoch) travel in ONE all_gather. Synced metrics are reduced over the
  ranks; unsynced ones take rank 0's value. Either way every rank ends with the same numbers, so
  callbacks that act on them (early stopping, checkpointing) make the same decision everywhere.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.errors import MisconfigurationError
from phalanx.trainer.module import check_reduce_fx

_DTYPE = torch.float64  # exact enough to add millions of batch-weighted values


@dataclass
class Entry:
    """One logged name: how it is reduced and its running epoch accumulators."""

    name: str
    on_step: bool
    on_epoch: bool
    prog_bar: bool
    logger: bool
    sync_dist: bool
    reduce_fx: str
    dataloader_idx: int
    total: torch.Tensor  # weighted sum (mean), sum, max or min of this epoch's values on this rank
    weight: torch.Tensor  # sum of batch sizes (mean) or number of values (others)
    step_value: torch.Tensor | None = None  # logged since the last step sync
    step_weight: float = 1.0


def infer_batch_size(batch: Any) -> int:
    """Size of the first dimension of the first tensor found in ``batch``."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, dict):
        items: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        items = ()
    for item in items:
        try:
            return infer_batch_size(item)
        except MisconfigurationError:
            continue
    raise MisconfigurationError(
        f"Cannot infer the batch size from a batch of type {type(batch).__name__} to weight the epoch mean: "
        "pass self.log(..., batch_size=N)."
    )


class Results:
    """The metrics of one stage ("train", "validate", "test"): step values and epoch accumulators."""

    def __init__(self, stage: str, device: torch.device) -> None:
        self.stage = stage
        self.device = device
        self.entries: dict[str, Entry] = {}
        self.batch: Any = None  # the current batch, for batch-size inference
        self.dataloader_idx = 0
        self.suffix = ""  # "/dataloader_idx_N" when an evaluation has several loaders
        self.in_epoch_end = False  # logging from an epoch-end hook: epoch-level by definition

    # ------------------------------------------------------------------ recording
    def log(
        self, name: str, value: Any, *, on_step: bool | None, on_epoch: bool | None, prog_bar: bool,
        logger: bool, sync_dist: bool, reduce_fx: Any, batch_size: int | None,
    ) -> None:
        fx = check_reduce_fx(reduce_fx)
        train = self.stage == "train"
        if self.in_epoch_end:
            on_step, on_epoch = False, True
        on_step = train if on_step is None else on_step
        on_epoch = (not train) if on_epoch is None else on_epoch
        if not on_step and not on_epoch:
            raise MisconfigurationError(f"self.log({name!r}): on_step and on_epoch are both False; nothing to record.")
        tensor = self._scalar(name, value)
        key = name + self.suffix
        entry = self.entries.get(key)
        if entry is None:
            zero = torch.zeros((), dtype=_DTYPE, device=self.device)
            start = {"mean": zero, "sum": zero, "max": zero - torch.inf, "min": zero + torch.inf}[fx]
            entry = Entry(key, on_step, on_epoch, prog_bar, logger, sync_dist, fx, self.dataloader_idx,
                          start.clone(), zero.clone())
            self.entries[key] = entry
        elif (entry.on_step, entry.on_epoch, entry.sync_dist, entry.reduce_fx) != (on_step, on_epoch, sync_dist, fx):
            raise MisconfigurationError(
                f"self.log({name!r}) was called with different on_step/on_epoch/sync_dist/reduce_fx within one "
                "epoch; log each name with the same options every time."
            )
        weight = 1.0
        if fx == "mean" and (on_epoch or sync_dist):
            weight = float(batch_size if batch_size is not None else infer_batch_size(self.batch))
        entry.step_value, entry.step_weight = tensor, weight
        if on_epoch:
            if fx == "mean":
                entry.total += tensor * weight
                entry.weight += weight
            elif fx == "sum":
                entry.total += tensor
                entry.weight += 1
            elif fx == "max":
                entry.total = torch.maximum(entry.total, tensor)
                entry.weight += 1
            else:
                entry.total = torch.minimum(entry.total, tensor)
                entry.weight += 1

    def _scalar(self, name: str, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise MisconfigurationError(
                    f"self.log({name!r}) got a tensor of shape {tuple(value.shape)}; log scalars (reduce it first)."
                )
            return value.detach().reshape(()).to(device=self.device, dtype=_DTYPE)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return torch.tensor(float(value), dtype=_DTYPE, device=self.device)
        raise MisconfigurationError(
            f"self.log({name!r}) got a {type(value).__name__}; log a number or a scalar tensor."
        )

    # ------------------------------------------------------------------ reducing across ranks
    def sync_step(self, fabric: Any) -> dict[str, float]:
        """Values logged since the last call, identical on every rank. Returns name -> float."""
        pending = sorted((e for e in self.entries.values() if e.step_value is not None and e.on_step),
                         key=lambda e: e.name)
        for e in self.entries.values():
            if not e.on_step:
                e.step_value = None
        if not pending:
            return {}
        rows = [torch.stack([_value(e) * e.step_weight, _f(e.step_weight, self.device)]) for e in pending]
        gathered = self._gather(fabric, torch.stack(rows), [e.name for e in pending], "step")
        out: dict[str, Any] = {}
        for i, e in enumerate(pending):
            col = gathered[:, i]
            if not e.sync_dist:
                value = col[0, 0] / col[0, 1]
            elif e.reduce_fx == "mean":
                value = col[:, 0].sum() / col[:, 1].sum()
            else:
                value = _reduce(col[:, 0] / col[:, 1], e.reduce_fx)
            out[e.name] = float(value)
            e.step_value = None
        return out

    def sync_epoch(self, fabric: Any) -> dict[str, float]:
        """This epoch's values of every on_epoch entry, identical on every rank."""
        entries = sorted((e for e in self.entries.values() if e.on_epoch), key=lambda e: e.name)
        if not entries:
            return {}
        rows = torch.stack([torch.stack([e.total, e.weight]) for e in entries])
        gathered = self._gather(fabric, rows, [e.name for e in entries], "epoch")
        out: dict[str, float] = {}
        for i, e in enumerate(entries):
            col = gathered[:, i]
            if not e.sync_dist:
                col = col[:1]
            if e.reduce_fx == "mean":
                value = col[:, 0].sum() / col[:, 1].sum()
            else:
                value = _reduce(col[:, 0], e.reduce_fx)
            out[e.name] = float(value)
        return out

    def _gather(self, fabric: Any, rows: torch.Tensor, names: list[str], what: str) -> torch.Tensor:
        # The last column carries a checksum of the names, so ranks that logged different metrics are
        # told so instead of silently mixing values of different names.
        tag = float(zlib.crc32("\0".join(names).encode()))
        # Ranks that read the same data (the tensor-parallel ranks of one model replica) log the same
        # values: each data shard is counted once, or a "sum" would count it once per such rank.
        split = fabric.strategy.distributed_sampler_kwargs()
        shard = float(split["rank"]) if split is not None else 0.0
        packed = torch.cat([rows.reshape(-1), _f(shard, rows.device).reshape(1), _f(tag, rows.device).reshape(1)])
        gathered: torch.Tensor = fabric.all_gather(packed)
        if gathered.dim() == 1:  # single process
            gathered = gathered.unsqueeze(0)
        tags = gathered[:, -1]
        if bool((tags != tags[0]).any()):
            raise MisconfigurationError(
                f"Ranks logged different {what} metrics in stage {self.stage!r} (this rank: {names}). Every rank "
                "must call self.log with the same names at the same points; log a placeholder where a rank has "
                "nothing to report."
            )
        shards = gathered[:, -2].tolist()
        first = [i for i, s in enumerate(shards) if s not in shards[:i]]
        return gathered[first, :-2].reshape(len(first), len(names), 2)

    # ------------------------------------------------------------------ bookkeeping
    def reset(self) -> None:
        self.entries = {}
        self.suffix = ""
        self.dataloader_idx = 0
        self.in_epoch_end = False

    def names(self, *, prog_bar: bool = False, logger: bool = False) -> set[str]:
        return {e.name for e in self.entries.values() if (not prog_bar or e.prog_bar) and (not logger or e.logger)}

    def state_dict(self) -> dict[str, Any]:
        """Accumulators (on the CPU, for checkpoints); ``load_state_dict`` puts them on ``self.device``."""
        return {
            name: {**{k: getattr(e, k) for k in ("on_step", "on_epoch", "prog_bar", "logger", "sync_dist",
                                                    "reduce_fx", "dataloader_idx")},
                   "total": e.total.detach().cpu().clone(), "weight": e.weight.detach().cpu().clone()}
            for name, e in self.entries.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.entries = {}
        for name, s in state.items():
            self.entries[name] = Entry(
                name, s["on_step"], s["on_epoch"], s["prog_bar"], s["logger"], s["sync_dist"], s["reduce_fx"],
                s["dataloader_idx"], s["total"].to(self.device, _DTYPE), s["weight"].to(self.device, _DTYPE),
            )

    def devices(self) -> set[torch.device]:
        """Where the accumulators live (a test hook: always ``{fabric.device}``)."""
        return {t.device for e in self.entries.values() for t in (e.total, e.weight)}


def _f(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=_DTYPE, device=device)


def _value(entry: Entry) -> torch.Tensor:
    assert entry.step_value is not None
    return entry.step_value


def _reduce(values: torch.Tensor, fx: str) -> torch.Tensor:
    if fx == "sum":
        return values.sum()
    if fx == "max":
        return values.max()
    return values.min()
