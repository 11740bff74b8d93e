"""Checkpoints of a DeepSpeed engine: its shard layout, and its state consolidated for single files.

Sharded (a directory, through the checkpoint layer): DeepSpeed's own engine checkpoint, every rank
writing its optimizer partition; the layer adds the marker file (everything in the state that is
not the engine's model or optimizer) and publishes the directory atomically. DeepSpeed's own load
takes it at the same world size and ZeRO stage (its partitions are laid out for them); at any other,
every rank merges the partitions into full state (``phalanx.checkpoint.deepspeed_shards``) and loads
that as it loads a single file. Other strategies read it the same way.

Full (one file): float32 master weights and the optimizer state consolidated into torch's own
layout (the one ``optimizer.state_dict()`` gives under DDP), so it loads at any world size, into any
ZeRO stage, and into the other strategies.

This module is handed the engine by the strategy and never imports it back (no import cycle);
DeepSpeed itself is imported only when a helper runs (an engine exists by then).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx import checkpoint
from phalanx.checkpoint.deepspeed_shards import DeepSpeedShards
from phalanx.checkpoint.protocol import MODULE, OPTIMIZER, Entry, Shapes
from phalanx.checkpoint.reshard import converting
from phalanx.checkpoint.snapshot import load_module_local
from phalanx.utils.errors import CheckpointError

TAG = "checkpoint"
GATHERED = ":gathered"  # the key suffix of a ZeRO-3 parameter's full value (see local_module_state)
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
Scope = Callable[[str], contextlib.AbstractContextManager[Any]]


def _utils() -> Any:
    import deepspeed

    return deepspeed.utils


@contextlib.contextmanager
def _gathered(params: list[nn.Parameter], modifier_rank: int | None) -> Iterator[None]:
    """Full (unpartitioned) values of ZeRO-3 parameters inside the block; no-op for stages 1 and 2."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank):
        yield


def _attempt(fn: Callable[..., object], *args: Any) -> Exception | None:
    """``fn(*args)``'s failure, returned rather than raised (see ``load_full_module_state``)."""
    try:
        fn(*args)
    except Exception as err:
        return err
    return None


def _copy(target: torch.Tensor, value: torch.Tensor) -> None:
    target.copy_(value.to(device=target.device, dtype=target.dtype))


def _partition(value: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """This rank's ZeRO-3 partition of a full float32 ``value`` of ``param``: ``ceil(numel / ranks)``
    elements, zero past the end. (DeepSpeed's own ``set_full_hp_param`` slices without that padding and
    fails on the rank whose partition lies past the end, e.g. rank 1 of a 1-element bias on 2 ranks.)"""
    size = param.ds_tensor.numel()  # type: ignore[attr-defined]
    group = getattr(param, "ds_process_group", None)
    rank = torch.distributed.get_rank(group) if torch.distributed.is_initialized() else 0
    flat = value.detach().reshape(-1).to(torch.float32)
    chunk = flat[rank * size : (rank + 1) * size]
    out = torch.zeros(size, dtype=torch.float32, device=param.ds_tensor.device)  # type: ignore[attr-defined]
    out[: chunk.numel()] = chunk
    return out


def owned_values(param: torch.Tensor) -> torch.Tensor:
    """The elements of a ZeRO-3 parameter that this rank's partition really holds.

    DeepSpeed splits a parameter into equal partitions of ``ceil(numel / ranks)`` and allocates them
    with ``torch.empty``: the tail past ``numel`` (all of rank 1's partition of a 1-element bias on two
    ranks) is never written and holds whatever the allocator left there. Read whole, that garbage
    made ``weights_finite`` report nan/inf now and then, and ModelCheckpoint skip every save of a run.
    """
    part: torch.Tensor = param.ds_tensor  # type: ignore[attr-defined]
    group = getattr(param, "ds_process_group", None)
    rank = torch.distributed.get_rank(group) if torch.distributed.is_initialized() else 0
    size = part.numel()
    owned = min(size, max(0, int(param.ds_numel) - rank * size))  # type: ignore[attr-defined]
    return part.narrow(0, 0, owned)


def _set_fp32(utils: Any, param: nn.Parameter, value: torch.Tensor) -> None:
    """The float32 master copy of ``param`` (none for a frozen parameter: it is not in the optimizer)."""
    if not param.requires_grad:
        return
    if hasattr(param, "ds_tensor"):
        utils.safe_set_local_fp32_param(param, _partition(value, param))
    else:
        utils.safe_set_full_fp32_param(param, value.to(device=param.device, dtype=torch.float32))


class DeepSpeedCheckpointIO:
    """The checkpoint side of one engine (``phalanx.checkpoint.protocol.ShardIO`` for the sharded form).

    Args:
        engine, optimizer: the engine and the user's torch optimizer it wraps.
        param_groups: the optimizer's parameters per group, in their order before DeepSpeed
            flattened them (the layout of a consolidated optimizer state).
        stage, world_size: what a sharded checkpoint is laid out for.
        guarded / unguarded: the strategy's lockstep scopes for phases that run DeepSpeed's collectives.
    """

    layout = DeepSpeedShards.layout

    def __init__(
        self, engine: Any, optimizer: Optimizer, param_groups: list[list[nn.Parameter]], stage: int,
        world_size: int, guarded: Scope, unguarded: Scope,
    ) -> None:
        self.engine, self.optimizer, self.param_groups = engine, optimizer, param_groups
        self.stage, self.world_size = stage, world_size
        self._guarded, self._unguarded = guarded, unguarded

    # ------------------------------------------------------------------ sharded form (ShardIO)
    def _own(self, entries: list[Entry]) -> tuple[Entry | None, Entry | None]:
        model = next((e for e in entries if e.kind == MODULE and e.obj is self.engine.module), None)
        opt = next((e for e in entries if e.kind == OPTIMIZER and e.obj is self.optimizer), None)
        return model, opt

    def write(self, directory: Path, entries: list[Entry]) -> dict[str, Any]:
        model, opt = self._own(entries)
        if model is None:
            raise CheckpointError(
                "fabric.save with DeepSpeed (state_dict_type='sharded') needs the model returned by fabric.setup in "
                "the state; it is missing. Add it, e.g. fabric.save(path, {'model': model, 'optimizer': optimizer})."
            )
        with self._unguarded("save (DeepSpeed engine checkpoint)"):
            self.engine.save_checkpoint(str(directory), tag=TAG, client_state={}, save_latest=False)
        sharded = [model.key] + ([opt.key] if opt is not None else [])
        return {"sharded": sharded, "stage": self.stage, "world_size": self.world_size}

    def _native(self, info: dict[str, Any]) -> bool:
        """Whether DeepSpeed's own load can take the checkpoint: its partitions are cut for one world size
        and stage. Any other is merged into full state (``DeepSpeedShards``) and loaded as a file is."""
        return info.get("world_size") == self.world_size and info.get("stage") == self.stage

    def check(self, directory: Path, info: dict[str, Any], entries: list[Entry], weights_only: bool = True) -> None:
        if not self._native(info):
            DeepSpeedShards().check(directory, info, entries, weights_only)
        model, opt = self._own(entries)
        for e in entries:
            if e is not model and e is not opt:
                raise CheckpointError(
                    f"Entry {e.key!r} of {directory} is DeepSpeed's engine checkpoint, but the object under that key "
                    "is not the model (or optimizer) set up with this strategy. Pass the objects fabric.setup returned."
                )
        if opt is not None and model is None:
            raise CheckpointError(f"Loading DeepSpeed's optimizer state from {directory} needs its model in the state.")

    def saved_shapes(self, directory: Path, info: dict[str, Any], key: str) -> Shapes | None:
        return None  # DeepSpeed checks its own module state on load

    def read(self, directory: Path, info: dict[str, Any], entries: list[Entry], strict: bool) -> None:
        model, opt = self._own(entries)
        if not self._native(info):
            loader = f"'deepspeed' ZeRO stage {self.stage} on {self.world_size} ranks"
            with converting(directory, info, self.layout, loader):
                # Every rank merges the partitions itself (no collective), then loads like a single file. Rank 0
                # verified the checksums before any rank reads (the checkpoint layer's load plan).
                full = checkpoint.read_everything(directory, verify=False)
                if model is not None:
                    self.load_full_module_state(full[model.key])
                if opt is not None:
                    self.load_full_optimizer_state(full[opt.key])
            return
        with self._unguarded("load (DeepSpeed engine checkpoint)"):
            loaded, _ = self.engine.load_checkpoint(
                str(directory), tag=TAG, load_module_strict=strict, load_optimizer_states=opt is not None,
                load_lr_scheduler_states=False,
            )
        if loaded is None:
            raise CheckpointError(f"DeepSpeed could not load the engine checkpoint in {directory} (see its log above).")

    # ------------------------------------------------------------------ full form
    def _module_entries(self) -> dict[str, Any]:
        """state_dict keys of the engine's module mapped to their parameter or buffer objects."""
        return dict(self.engine.module.state_dict(keep_vars=True))

    def module_layout(self) -> Shapes:
        def shape(value: Any) -> tuple[int, ...] | None:
            if hasattr(value, "ds_shape"):
                return tuple(value.ds_shape)
            return tuple(value.shape) if isinstance(value, torch.Tensor) else None

        return {k: shape(v) for k, v in self._module_entries().items()}

    def full_module_state(self) -> dict[str, Any]:
        """The module's state dict with float32 master weights (what DDP's module would hold)."""
        utils = _utils()
        out: dict[str, Any] = {}
        with self._guarded("consolidate DeepSpeed weights"):
            for key, value in self._module_entries().items():
                if isinstance(value, nn.Parameter):
                    full = utils.safe_get_full_fp32_param(value)
                    if full is None:  # frozen: not in the optimizer, so no fp32 master copy
                        with _gathered([value], None):
                            full = value.detach().clone()
                    out[key] = full.detach().cpu().clone()
                else:
                    out[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
        return out

    def load_full_module_state(self, state: dict[str, Any]) -> None:
        """Write a full state dict (checked by the checkpoint layer) into the engine: the working (possibly
        bf16, possibly partitioned) parameters and the float32 master copies both, so the next step starts
        from exactly these values.

        Under ZeRO-3 each parameter's gather is a collective. A rank whose own copy fails still takes part
        in every remaining gather and raises only at the end: leaving the loop early would send it to the
        next collective while the others wait in this one (a CollectiveMismatchError hiding the cause)."""
        utils = _utils()
        failure: Exception | None = None
        with self._guarded("load consolidated DeepSpeed weights"), torch.no_grad():
            for key, target in self._module_entries().items():
                if key not in state or not isinstance(target, torch.Tensor):
                    continue
                value = state[key]
                if not isinstance(target, nn.Parameter):
                    failure = failure or _attempt(_copy, target, value)
                    continue
                with _gathered([target], 0):
                    failure = failure or _attempt(_copy, target.data, value)
                failure = failure or _attempt(_set_fp32, utils, target, value)
        if failure is not None:
            raise failure

    def _flat_tensors(self) -> list[torch.Tensor]:
        """This rank's flat fp32 partitions, which the wrapped torch optimizer keys its state by. (ZeRO-3
        puts them into the optimizer's param_groups only while it steps, so ask ZeRO, not the groups.)"""
        zero = self.engine.optimizer
        for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
            flats = getattr(zero, attr, None)
            if flats is not None:
                return list(flats)
        raise CheckpointError(
            f"Cannot find the fp32 partitions of {type(zero).__name__}: with this DeepSpeed version phalanx can "
            "neither consolidate its state ('full' checkpoints) nor snapshot it. Use state_dict_type='sharded', and "
            "disk checkpoints instead of snapshots."
        )

    def _flat_states(self) -> list[dict[str, Any]]:
        """The wrapped torch optimizer's per-partition states."""
        return [self.optimizer.state[t] for t in self._flat_tensors() if t in self.optimizer.state]

    def full_optimizer_state(self) -> dict[str, Any]:
        """The optimizer state in torch's layout, as ``optimizer.state_dict()`` would give it under DDP."""
        utils = _utils()
        flat = self._flat_states()
        tensor_keys = sorted({k for s in flat for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0})
        scalars = {k: v for s in flat for k, v in s.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
        state: dict[int, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        index = 0
        with self._guarded("consolidate DeepSpeed optimizer state"):
            for group, params in zip(self.optimizer.param_groups, self.param_groups):
                ids = []
                for p in params:
                    if tensor_keys and p.requires_grad:
                        entry = {k: utils.safe_get_full_optimizer_state(p, k).detach().cpu().clone()
                                 for k in tensor_keys}
                        entry.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()})
                        state[index] = entry
                    ids.append(index)
                    index += 1
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def load_full_optimizer_state(self, saved: dict[str, Any]) -> None:
        groups = saved.get("param_groups", [])
        sizes = [len(g) for g in self.param_groups]
        if [len(g["params"]) for g in groups] != sizes:
            raise CheckpointError(
                f"The checkpoint's optimizer has parameter groups of sizes {[len(g['params']) for g in groups]}, but "
                f"this optimizer has {sizes}. Is it a checkpoint of another model or optimizer?"
            )
        for group, saved_group in zip(self.optimizer.param_groups, groups):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        per_param = saved.get("state", {})
        if not per_param:
            return
        first = next(iter(per_param.values()))
        tensor_keys = [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        scalars = {k: v for k, v in first.items() if k not in tensor_keys}
        self._ensure_flat_state(tensor_keys)
        for s in self._flat_states():
            s.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()})
        utils = _utils()
        params = [p for g in self.param_groups for p in g]
        # Each rank writes its own partitions only: no collective, so a failure on one rank reaches the
        # others through the checkpoint layer's closing exchange, never as a mismatch of collectives.
        with torch.no_grad():
            for index, p in enumerate(params):
                entry = per_param.get(index)
                if entry is None or not p.requires_grad:
                    continue
                for key in tensor_keys:
                    value = entry[key].to(torch.float32)
                    if hasattr(p, "ds_tensor"):
                        utils.safe_set_local_optimizer_state(p, _partition(value, p), key)
                    else:
                        utils.safe_set_full_optimizer_state(p, value, key)

    # ------------------------------------------------------------------ this rank's part (snapshots)
    def local_module_state(self) -> dict[str, torch.Tensor]:
        """This rank's live parameters and buffers, no collective: under ZeRO-3 each parameter's partition
        (and, for a parameter ZeRO keeps gathered between steps, its full value too: ZeRO refreshes it from
        the partitions only at a step, so a restore must put it back itself)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.engine.module.named_parameters():
            if hasattr(p, "ds_tensor"):
                out[name] = owned_values(p)
                if getattr(p, "ds_persist", False) and p.data.numel() == p.ds_numel:
                    out[name + GATHERED] = p.data
            else:
                out[name] = p.data
        out.update(self.engine.module.named_buffers())
        return out

    def load_local_module_state(self, saved: dict[str, Any], strict: bool) -> None:
        """Put back what :meth:`local_module_state` gave, in place. A full value saved for a parameter that is not
        gathered now (a fresh engine, before its first forward) is skipped: ZeRO gathers it from the restored
        partition when it is next used."""
        live = self.local_module_state()
        kept = {k: v for k, v in saved.items() if not k.endswith(GATHERED) or k in live}
        load_module_local(self.engine.module, live, kept, strict)

    def local_optimizer_state(self) -> dict[str, Any]:
        """This rank's ZeRO partition of the optimizer, as live tensors: the fp32 master weights, the torch
        optimizer's state on them, its hyperparameters, and the engine's step counters and loss scale."""
        zero = self.engine.optimizer
        scaler = getattr(zero, "loss_scaler", None)
        flats = self._flat_tensors()
        return {
            "fp32": flats,
            "state": [dict(self.optimizer.state.get(t, {})) for t in flats],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "counters": {k: int(getattr(self.engine, k)) for k in ENGINE_COUNTERS},
            "loss_scaler": {k: getattr(scaler, k) for k in SCALER_FIELDS if hasattr(scaler, k)},
        }

    def load_local_optimizer_state(self, saved: dict[str, Any]) -> None:
        """Put back what :meth:`local_optimizer_state` gave, in place (no collective; same world size and stage)."""
        flats = self._flat_tensors()
        shapes, live = [tuple(t.shape) for t in saved.get("fp32", [])], [tuple(t.shape) for t in flats]
        if shapes != live:
            raise CheckpointError(
                f"The snapshot's ZeRO partitions have shapes {shapes}, this engine's {live}: "
                "it was taken of another model, ZeRO stage or world size. Resume from a disk checkpoint.")
        keys = sorted({k for s in saved["state"] for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0})
        self._ensure_flat_state(keys)
        with torch.no_grad():
            for flat, value, entry in zip(flats, saved["fp32"], saved["state"]):
                flat.copy_(value)
                live = self.optimizer.state[flat]
                for k, v in entry.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        live[k].copy_(v)
                    else:
                        live[k] = v.clone() if isinstance(v, torch.Tensor) else v
        for group, saved_group in zip(self.optimizer.param_groups, saved["param_groups"]):
            group.update(saved_group)
        for k, v in saved["counters"].items():
            setattr(self.engine, k, v)
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        for k, v in saved["loss_scaler"].items():
            setattr(scaler, k, v)

    def _ensure_flat_state(self, keys: list[str]) -> None:
        """Torch optimizers create their state at the first step. Before it (a fresh job resuming), create
        zero tensors for each flat partition and let ZeRO map its per-parameter views onto them."""
        created = False
        for flat in self._flat_tensors():
            entry = self.optimizer.state[flat]
            for key in keys:
                if key not in entry:
                    entry[key] = torch.zeros_like(flat, dtype=torch.float32)
                    created = True
        zero = self.engine.optimizer
        if created and hasattr(zero, "_hp_optimizer_states_linked"):
            # ZeRO 1/2 link each parameter to its slice of the optimizer state once, lazily at the first step.
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()
