"""What ``self.log`` records, and how step and epoch values become identical on every rank.

Design choices, each fixing a known failure of managed loops:

* Accumulators live on ``fabric.device`` (the device the backend reduces on) and are restored there
  from checkpoints or snapshots: nothing here ever moves them elsewhere, so a later distributed
  reduction cannot meet a tensor on the wrong device. A logged torchmetrics ``Metric`` must be a
  submodule of the Module (as in Lightning), so ``setup`` moved it to that device too; one that is
  not is refused by name.
* Epoch means are weighted by batch size, and the cross-rank reduction adds the per-rank weighted
  sums and weights: the result is the exact mean over every sample, however uneven the shards.
  Evaluation scores each sample once (phalanx's evaluation sampler never pads). Training under
  several ranks pads the epoch to a multiple of the world size by repeating its first samples (so
  every rank steps together); training epoch values count those repeats, as the gradients do.
* All metrics of one sync travel in ONE all_gather. Synced metrics are reduced over the ranks;
  unsynced ones take rank 0's value. Either way every rank ends with the same numbers, so callbacks
  that act on them (early stopping, checkpointing) make the same decision everywhere.
* ``self.log`` itself never communicates and costs a few microseconds: a step value is kept until
  something consumes it (logger flush, progress bar refresh, a callback or hook that may read
  ``trainer.callback_metrics``, epoch end), and epoch values are kept as a list folded into the
  float64 accumulator every ``_FOLD`` values (a fixed grouping, so a resumed run adds in the same
  order as an uninterrupted one and ends bit-identical).
* A logged ``Metric`` follows Lightning: the step value is the metric's last forward value (this
  rank's batch, or the global one with ``dist_sync_on_step``), the epoch value is ``compute()`` at
  epoch end (torchmetrics reduces across ranks inside it: every rank calls it at the same point),
  then ``reset()``. ``sync_dist`` and ``reduce_fx`` do not apply (no second reduction); rank 0's
  value is published so every rank holds the same number.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.core.module import check_reduce_fx
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.late_reads import on_device
from phalanx.utils.tensors import is_metric

_DTYPE = torch.float64  # exact enough to add millions of batch-weighted values
_FOLD = 64  # epoch values kept as a list before being added to the float64 accumulator
_START = {"mean": 0.0, "sum": 0.0, "max": -float("inf"), "min": float("inf")}


@dataclass(eq=False)
class LoggedEntry:
    """One logged name: how it is reduced and its running epoch accumulators."""

    name: str
    on_step: bool
    on_epoch: bool
    prog_bar: bool
    logger: bool
    sync_dist: bool
    reduce_fx: str
    dataloader_idx: int
    total: torch.Tensor  # weighted sum (mean), sum, max or min of the folded values on this rank
    weight: float = 0.0  # sum of batch sizes (mean) or number of values (others), folded
    values: list[Any] = field(default_factory=list)  # epoch values not folded yet (tensors or floats)
    weights: list[float] = field(default_factory=list)
    step_value: Any = None  # logged since the last step sync (a tensor or a float)
    step_weight: float = 1.0
    metric: Any = None  # a torchmetrics Metric: epoch value = metric.compute()
    metric_path: str = ""  # where the metric lives in the Module (for checkpoints)
    given: tuple[Any, ...] = ()  # the options as passed, to recognise a repeated call cheaply


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


def _stack(values: list[Any], device: torch.device) -> torch.Tensor:
    """Step values (0-d tensors or floats) as one float64 vector on ``device``."""
    if all(isinstance(v, torch.Tensor) and v.device == device for v in values):
        return torch.stack(values).to(_DTYPE)
    return torch.stack([_f(v, device) for v in values])


class Results:
    """The metrics of one stage ("train", "validate", "test"): step values and epoch accumulators."""

    def __init__(self, stage: str, device: torch.device) -> None:
        self.stage = stage
        self.device = device
        self.entries: dict[str, LoggedEntry] = {}
        self.batch: Any = None  # the current batch, for batch-size inference
        self._sized: Any = None  # the batch whose size _batch_size is
        self._batch_size = 0
        self.dataloader_idx = 0
        self.suffix = ""  # "/dataloader_idx_N" when an evaluation has several loaders
        self.in_epoch_end = False  # logging from an epoch-end hook: epoch-level by definition
        self.pending = False  # some step value was logged since the last sync
        self.pending_prog_bar = False  # ... and one of them goes to the progress bar
        self._metric_paths: dict[int, str] = {}
        self._shard_rows: list[int] | None = None  # which gathered rows are distinct data shards
        #: Whether ranks logged different names at a step sync since the last check: a device flag, read with
        #: the values at the next logger flush or epoch end (:meth:`check_names`).
        self.names_differ: torch.Tensor | None = None
        self._last_names: tuple[list[str], str] = ([], "step")

    # ------------------------------------------------------------------ recording
    def log(
        self, name: str, value: Any, on_step: bool | None, on_epoch: bool | None, prog_bar: bool,
        logger: bool, sync_dist: bool, reduce_fx: Any, batch_size: int | None, module: Any = None,
    ) -> None:
        """``Module.log``'s recording (positional: it runs for every logged value of every step)."""
        given = (on_step, on_epoch, prog_bar, logger, sync_dist, reduce_fx, self.in_epoch_end)
        key = name + self.suffix if self.suffix else name
        entry = self.entries.get(key)
        if entry is None or entry.given != given:
            entry = self._entry(key, name, given, value, module)
        if isinstance(value, torch.Tensor) and entry.metric is None:
            # A step-only value is detached when it is synced (holding it until the next step keeps no
            # activations: backward has freed them); epoch values are kept in lists, so detach now.
            v: Any = value.detach() if value.requires_grad and entry.on_epoch else value
            if v.dim():  # (a 0-d tensor, the usual loss, is one value: no more checks)
                if v.numel() != 1:
                    raise MisconfigurationError(
                        f"self.log({name!r}) got a tensor of shape {tuple(value.shape)}; log scalars (reduce it "
                        "first)."
                    )
                v = v.reshape(())
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and entry.metric is None:
            v = float(value)
        elif entry.metric is not None or is_metric(value):
            self._log_metric(entry, value)
            return
        else:
            raise MisconfigurationError(
                f"self.log({name!r}) got a {type(value).__name__}; log a number, a scalar tensor or a torchmetrics "
                "Metric."
            )
        weight = 1.0
        if entry.reduce_fx == "mean" and (entry.on_epoch or entry.sync_dist):
            weight = float(batch_size) if batch_size is not None else float(self._inferred_batch_size())
        if entry.on_step:
            entry.step_value, entry.step_weight = v, weight
            self.pending = True
            if entry.prog_bar:
                self.pending_prog_bar = True
        if entry.on_epoch:
            entry.values.append(v)
            entry.weights.append(weight)
            if len(entry.values) >= _FOLD:
                self._fold(entry)

    def _inferred_batch_size(self) -> int:
        if self._sized is not self.batch:  # once per batch, however many values are logged
            self._batch_size = infer_batch_size(self.batch)
            self._sized = self.batch
        return self._batch_size

    def _entry(self, key: str, name: str, given: tuple[Any, ...], value: Any, module: Any) -> LoggedEntry:
        """Create the entry for ``key``, or check that a call with other options means the same."""
        on_step, on_epoch, prog_bar, logger, sync_dist, reduce_fx, in_epoch_end = given
        fx = check_reduce_fx(reduce_fx)
        train = self.stage == "train"
        if in_epoch_end:
            on_step, on_epoch = False, True
        on_step = train if on_step is None else on_step
        on_epoch = (not train) if on_epoch is None else on_epoch
        if not on_step and not on_epoch:
            raise MisconfigurationError(f"self.log({name!r}): on_step and on_epoch are both False; nothing to record.")
        metric = value if is_metric(value) else None
        entry = self.entries.get(key)
        if entry is not None:
            if (entry.on_step, entry.on_epoch, entry.sync_dist, entry.reduce_fx) != (on_step, on_epoch, sync_dist, fx):
                raise MisconfigurationError(
                    f"self.log({name!r}) was called with different on_step/on_epoch/sync_dist/reduce_fx within one "
                    "epoch; log each name with the same options every time."
                )
            entry.given = given
            return entry
        entry = LoggedEntry(key, on_step, on_epoch, prog_bar, logger, sync_dist, fx, self.dataloader_idx,
                      torch.full((), _START[fx], dtype=_DTYPE, device=self.device), given=given)
        if metric is not None:
            entry.metric, entry.metric_path = metric, self._metric_path(name, metric, module)
        self.entries[key] = entry
        return entry

    def _metric_path(self, name: str, metric: Any, module: Any) -> str:
        path = self._metric_paths.get(id(metric))
        if path is None and module is not None:
            self._metric_paths = {id(m): p for p, m in module.named_modules() if is_metric(m)}
            path = self._metric_paths.get(id(metric))
        if path is None:
            raise MisconfigurationError(
                f"self.log({name!r}) got a {type(metric).__name__} that is not a submodule of the Module. Make it an "
                f"attribute (self.{name.split('/')[-1].replace('-', '_')} = {type(metric).__name__}(...)) or put it in "
                "an nn.ModuleDict / MetricCollection attribute: then setup moves it to the device the backend reduces "
                "on, checkpoints carry its state, and the LR finder leaves it untouched."
            )
        if metric.device != self.device:
            raise MisconfigurationError(
                f"self.log({name!r}): metric {path!r} keeps its state on {metric.device}, but this job reduces on "
                f"{self.device}; compute() would fail (or reduce on the wrong backend). It was moved off the device "
                "after setup: leave its placement to phalanx."
            )
        return path

    def _log_metric(self, entry: LoggedEntry, metric: Any) -> None:
        if metric is not entry.metric:
            raise MisconfigurationError(
                f"self.log({entry.name!r}) was given {type(metric).__name__} this time and "
                f"{type(entry.metric).__name__ if entry.metric is not None else 'plain values'} earlier in this "
                "epoch; log one Metric object (or only plain values) per name."
            )
        if entry.on_step:
            value = metric._forward_cache
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise MisconfigurationError(
                    f"self.log({entry.name!r}, metric, on_step=True) logs the value of the metric's last forward "
                    "call, and there is none (or it is not a scalar): call the metric (self.metric(preds, target)) "
                    "rather than metric.update(...) before logging it, or log it with on_step=False."
                )
            entry.step_value, entry.step_weight = value.detach(), 1.0
            self.pending = True
            if entry.prog_bar:
                self.pending_prog_bar = True

    def _fold(self, entry: LoggedEntry) -> None:
        if not entry.values:
            return
        stacked = _stack(entry.values, self.device)
        fx = entry.reduce_fx
        if fx == "mean":
            weights = on_device(entry.weights, self.device, _DTYPE)
            entry.total = entry.total + (stacked * weights).sum()
            entry.weight += sum(entry.weights)
        else:
            if fx == "sum":
                entry.total = entry.total + stacked.sum()
            elif fx == "max":
                entry.total = torch.maximum(entry.total, stacked.max())
            else:
                entry.total = torch.minimum(entry.total, stacked.min())
            entry.weight += len(entry.values)
        entry.values, entry.weights = [], []

    # ------------------------------------------------------------------ reducing across ranks
    def sync_step(self, fabric: Any) -> dict[str, torch.Tensor]:
        """Values logged since the last call, identical on every rank: name -> a 0-d float64 tensor on the
        device (nothing is read on the host: whoever shows or logs them reads them, in one batch)."""
        pending = sorted((e for e in self.entries.values() if e.step_value is not None), key=lambda e: e.name)
        self.pending = self.pending_prog_bar = False
        if not pending:
            return {}
        out: dict[str, torch.Tensor] = {}
        if fabric.world_size == 1:
            for e in pending:
                out[e.name] = _f(e.step_value, self.device)
                e.step_value = None
            return out
        rows = [torch.stack([_f(e.step_value, self.device) * e.step_weight, _f(e.step_weight, self.device)])
                for e in pending]
        gathered = self._gather(fabric, torch.stack(rows), [e.name for e in pending], "step", late=True)
        for i, e in enumerate(pending):
            col = gathered[:, i]
            if not e.sync_dist or e.metric is not None:
                value = col[0, 0] / col[0, 1]
            elif e.reduce_fx == "mean":
                value = col[:, 0].sum() / col[:, 1].sum()
            else:
                value = _reduce(col[:, 0] / col[:, 1], e.reduce_fx)
            out[e.name] = value
            e.step_value = None
        return out

    def sync_epoch(self, fabric: Any) -> dict[str, torch.Tensor]:
        """This epoch's values of every on_epoch entry, identical on every rank: name -> a 0-d float64 tensor
        on the device, where the step values are too (the caller reads them all at once). Computes and resets
        the logged Metrics (a collective inside torchmetrics: every rank gets here at the same point)."""
        if self.names_differ is not None:  # the step syncs' check, read at the epoch's end at the latest
            self.check_names(float(self.names_differ))
        entries = sorted((e for e in self.entries.values() if e.on_epoch), key=lambda e: e.name)
        out: dict[str, torch.Tensor] = {}
        scalars = [e for e in entries if e.metric is None]
        metrics = [e for e in entries if e.metric is not None]
        if scalars or metrics:
            for e in scalars:
                self._fold(e)
            # The names of both kinds travel in this gather, so ranks that logged different metrics are
            # told so before any of them enters a Metric's compute() (whose collectives would not match).
            rows = torch.stack([torch.stack([e.total, _f(e.weight, self.device)]) for e in scalars]) if scalars \
                else torch.zeros(0, 2, dtype=_DTYPE, device=self.device)
            gathered = self._gather(fabric, rows, [e.name for e in entries], "epoch")
            for i, e in enumerate(scalars):
                col = gathered[:, i]
                if not e.sync_dist:
                    col = col[:1]
                if e.reduce_fx == "mean":
                    value = col[:, 0].sum() / col[:, 1].sum()
                else:
                    value = _reduce(col[:, 0], e.reduce_fx)
                out[e.name] = value
        if metrics:
            computed = []
            for e in metrics:
                value = e.metric.compute()
                if not isinstance(value, torch.Tensor) or value.numel() != 1:
                    raise MisconfigurationError(
                        f"self.log({e.name!r}, metric): {type(e.metric).__name__}.compute() returned "
                        f"{type(value).__name__}, not a scalar; log a metric that computes one number (log the "
                        "members of a MetricCollection with self.log_dict(collection))."
                    )
                computed.append(value.detach().reshape(()).to(device=self.device, dtype=_DTYPE))
            values = torch.stack(computed).reshape(-1, 1).expand(-1, 2)
            if fabric.world_size > 1:  # rank 0's computed values, so every rank publishes the same numbers
                values = self._gather(fabric, values, [e.name for e in metrics], "epoch Metric")[0]
            for i, e in enumerate(metrics):
                out[e.name] = values[i, 0]
        self.reset_metrics()
        return out

    def reset_metrics(self) -> None:
        """Reset every Metric logged this epoch (also on_step-only ones: their state must not grow)."""
        for e in self.entries.values():
            if e.metric is not None:
                e.metric.reset()

    def _gather(self, fabric: Any, rows: torch.Tensor, names: list[str], what: str, late: bool = False) -> torch.Tensor:
        """Every rank's ``rows``, one row block per data shard. ``late``: the check that every rank logged the
        same names is read later, with the values (:meth:`check_names`), instead of now."""
        if fabric.world_size == 1:  # nothing to gather or compare, and so nothing to read on the host
            return rows.reshape(1, rows.shape[0], 2)
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
        mismatch = (tags != tags[0]).any()
        if late:
            self.names_differ = mismatch if self.names_differ is None else self.names_differ | mismatch
            self._last_names = (names, what)
        else:
            self._check_names(bool(mismatch), names, what)
        if self._shard_rows is None:  # the same for the whole fit: read once
            shards = gathered[:, -2].tolist()
            self._shard_rows = [i for i, s in enumerate(shards) if s not in shards[:i]]
        first = self._shard_rows
        block = gathered if len(first) == gathered.shape[0] else gathered[first]
        return block[:, :-2].reshape(len(first), rows.shape[0], 2)

    def _check_names(self, mismatch: bool, names: list[str], what: str) -> None:
        if mismatch:
            raise MisconfigurationError(
                f"Ranks logged different {what} metrics in stage {self.stage!r} (this rank: {names}). Every rank "
                "must call self.log with the same names at the same points; log a placeholder where a rank has "
                "nothing to report."
            )

    def check_names(self, differ: float) -> None:
        """Raise if :attr:`names_differ`, read by the caller in its batch of values, found ranks logging
        different names."""
        self.names_differ = None
        self._check_names(bool(differ), *self._last_names)

    # ------------------------------------------------------------------ bookkeeping
    def reset(self) -> None:
        self.entries = {}
        self.suffix = ""
        self.dataloader_idx = 0
        self.in_epoch_end = False
        self.pending = self.pending_prog_bar = False

    def state_dict(self, host: bool = True) -> dict[str, Any]:
        """Accumulators (tensors, numbers and strings only, so a checkpoint opens with ``weights_only=True``);
        ``load_state_dict`` puts them on ``self.device``. ``host``: copied to the CPU (a checkpoint); otherwise
        copies where they are (a snapshot, which copies device tensors itself, without a host wait). A logged
        Metric is stored by its path in the Module: its state is saved with the Module's metric states."""
        out: dict[str, Any] = {}
        where = torch.device("cpu") if host else self.device
        for name, e in self.entries.items():
            values = _stack(e.values, self.device).to(where) if e.values else torch.zeros(0, dtype=_DTYPE, device=where)
            out[name] = {**{k: getattr(e, k) for k in ("on_step", "on_epoch", "prog_bar", "logger", "sync_dist",
                                                        "reduce_fx", "dataloader_idx", "metric_path")},
                         "total": e.total.detach().to(where, copy=True), "weight": float(e.weight),
                         "values": values, "weights": [float(w) for w in e.weights]}
        return out

    def load_state_dict(self, state: dict[str, Any], module: Any = None) -> None:
        self.reset()
        metrics = {p: m for p, m in module.named_modules() if is_metric(m)} if module is not None else {}
        for name, s in state.items():
            entry = LoggedEntry(
                name, s["on_step"], s["on_epoch"], s["prog_bar"], s["logger"], s["sync_dist"], s["reduce_fx"],
                s["dataloader_idx"], s["total"].to(self.device, _DTYPE), float(s["weight"]),
            )
            if "values" in s:
                entry.values = list(s["values"].to(self.device, _DTYPE).unbind())
                entry.weights = [float(w) for w in s["weights"]]
            if s.get("metric_path"):
                if s["metric_path"] not in metrics:
                    raise MisconfigurationError(
                        f"The checkpoint's epoch metrics log {name!r} from metric {s['metric_path']!r}, which the "
                        "Module does not have; resume with the Module that wrote the checkpoint."
                    )
                entry.metric, entry.metric_path = metrics[s["metric_path"]], s["metric_path"]
            self.entries[name] = entry

    def devices(self) -> set[torch.device]:
        """Where the accumulators live (a test hook: always ``{fabric.device}``)."""
        out = {e.total.device for e in self.entries.values()}
        out |= {v.device for e in self.entries.values() for v in e.values if isinstance(v, torch.Tensor)}
        return out


def _f(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=_DTYPE)
    return torch.full((), float(value), dtype=_DTYPE, device=device)  # filled there: no copy that waits


def _reduce(values: torch.Tensor, fx: str) -> torch.Tensor:
    if fx == "sum":
        return values.sum()
    if fx == "max":
        return values.max()
    return values.min()
