"""Checkpoints of a DeepSpeed engine, in two forms.

Sharded (a directory): DeepSpeed's own engine checkpoint, every rank writing its optimizer partition,
plus ``phalanx_meta.pt`` (everything in the state that is not the engine's model or optimizer, and
what the checkpoint was written with). It is written into a hidden temporary directory; only after a
guarded barrier (every rank finished its shard) does rank 0 write the meta file and rename the
directory into place. The meta file is written last, so a directory without it is incomplete and
``load`` refuses it. Resuming needs the same world size and ZeRO stage (DeepSpeed's partitions are
laid out for them); anything else is refused with the way out: the full form.

Full (one file): float32 master weights and the optimizer state consolidated into torch's own
layout (the one ``optimizer.state_dict()`` gives under DDP), written atomically by rank 0. It loads at
any world size, into any ZeRO stage, and into the other strategies.

Every helper here is a collective: all ranks call it, inside the strategy's guarded checkpoint op.
"""

from __future__ import annotations

import contextlib
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx.checkpoint import io as ckpt_io
from phalanx.errors import CheckpointError

if TYPE_CHECKING:
    from phalanx.strategies.deepspeed import DeepSpeedStrategy

META_FILE = "phalanx_meta.pt"
TAG = "checkpoint"


def _engine_keys(strategy: DeepSpeedStrategy, state: dict[str, Any]) -> tuple[str | None, str | None]:
    """Which entries of ``state`` are the engine's model and its optimizer."""
    model_key = opt_key = None
    for key, value in state.items():
        raw = getattr(value, "_phalanx_unwrapped", value)
        if strategy._engine is not None and raw is strategy._engine.module:
            model_key = key
        elif raw is not None and raw is strategy._client_optimizer:
            opt_key = key
    return model_key, opt_key


# ---------------------------------------------------------------------- save
def save(strategy: DeepSpeedStrategy, path: Path, state: dict[str, Any]) -> None:
    if strategy.state_dict_type == "full":
        full = ckpt_io.collect_state(state, strategy)
        if strategy.is_global_zero:
            ckpt_io.atomic_save(full, path)
        return
    model_key, opt_key = _engine_keys(strategy, state)
    if model_key is None:
        raise CheckpointError(
            "fabric.save with DeepSpeed (state_dict_type='sharded') needs the model returned by fabric.setup in "
            "the state; it is missing. Add it, e.g. fabric.save(path, {'model': model, 'optimizer': optimizer})."
        )
    if path.exists() and not (path.is_file() or (path / META_FILE).is_file()):
        raise CheckpointError(
            f"{path} exists and is not a phalanx checkpoint; refusing to replace it. Choose another path."
        )
    token = strategy.collectives.broadcast_object(uuid.uuid4().hex[:10], 0, name="save (temporary name)")
    tmp = path.with_name(f".{path.name}.tmp-{token}")
    with strategy.guard.unguarded("save (DeepSpeed engine checkpoint)"):
        strategy._engine.save_checkpoint(str(tmp), tag=TAG, client_state={}, save_latest=False)
    rest = {k: v for k, v in state.items() if k not in (model_key, opt_key)}
    meta = ckpt_io.collect_state(rest, strategy)
    meta[ckpt_io.META_KEY].update(
        {"deepspeed_stage": strategy.stage, "model_key": model_key, "optimizer_key": opt_key, "form": "sharded"}
    )
    strategy.collectives.barrier("save (every shard written)")
    if strategy.is_global_zero:
        ckpt_io.atomic_save(meta, tmp / META_FILE)
        _replace_dir(tmp, path)


def _replace_dir(tmp: Path, path: Path) -> None:
    """Move ``tmp`` to ``path``. A directory cannot be renamed over a non-empty one, so the previous
    checkpoint moves aside first and is deleted only once the new one is in place."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:10]}")
        path.rename(old)
    try:
        tmp.rename(path)
    except BaseException:
        if old is not None:
            old.rename(path)
        raise
    if old is not None:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    ckpt_io._fsync_dir(path.parent)


# ---------------------------------------------------------------------- load
def load(strategy: DeepSpeedStrategy, path: Path, state: dict[str, Any] | None, strict: bool) -> dict[str, Any]:
    if path.is_file():
        ckpt = ckpt_io.read_checkpoint(path)
        if state is None:
            return ckpt_io.strip_meta(ckpt)
        return ckpt_io.apply_state(state, ckpt, strategy, strict)
    if not path.exists():
        raise CheckpointError(f"No checkpoint at {path}.")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(
            f"{path} is not a complete phalanx DeepSpeed checkpoint: it has no {META_FILE}, which is written last. "
            "The save that produced it was interrupted (or it is not a phalanx checkpoint); use an earlier one."
        )
    meta_ckpt = ckpt_io.read_checkpoint(meta_path)
    meta = meta_ckpt.get(ckpt_io.META_KEY, {})
    _check_compatible(strategy, meta, path)
    rest_ckpt = dict(meta_ckpt)
    if state is None:
        return ckpt_io.strip_meta(rest_ckpt)
    model_key, opt_key = _engine_keys(strategy, state)
    saved_model, saved_opt = meta.get("model_key"), meta.get("optimizer_key")
    if model_key is not None and model_key != saved_model:
        raise CheckpointError(
            f"The model is under key {model_key!r} in the state, but the checkpoint stored it under {saved_model!r}. "
            "Use the same key as when saving."
        )
    if opt_key is not None and opt_key != saved_opt:
        raise CheckpointError(
            f"The optimizer is under key {opt_key!r} in the state, but the checkpoint stored "
            f"{'no optimizer' if saved_opt is None else repr(saved_opt)}. Use the same key as when saving, or leave "
            "the optimizer out of the state."
        )
    if model_key is not None:
        with strategy.guard.unguarded("load (DeepSpeed engine checkpoint)"):
            loaded, _ = strategy._engine.load_checkpoint(
                str(path), tag=TAG, load_module_strict=strict, load_optimizer_states=opt_key is not None,
                load_lr_scheduler_states=False,
            )
        if loaded is None:
            raise CheckpointError(f"DeepSpeed could not load the engine checkpoint in {path} (see its log above).")
    elif strict and saved_model is not None:
        raise CheckpointError(
            f"The checkpoint holds the model under {saved_model!r}, but the state has no model set up with this "
            "strategy. Add it to the state, or pass strict=False."
        )
    rest_state = {k: v for k, v in state.items() if k not in (model_key, opt_key)}
    extra = ckpt_io.apply_state(rest_state, rest_ckpt, strategy, strict)
    state.update(rest_state)  # plain values (counters) were replaced in rest_state, not in place
    return extra


def _check_compatible(strategy: DeepSpeedStrategy, meta: dict[str, Any], path: Path) -> None:
    saved_ws, saved_stage = meta.get("world_size"), meta.get("deepspeed_stage")
    how = (
        "Resume with the configuration it was saved with, or save it in the portable form: in the original "
        "setup, use DeepSpeedStrategy(state_dict_type='full'), which loads at any world size and stage."
    )
    if saved_ws != strategy.world_size:
        raise CheckpointError(
            f"The sharded DeepSpeed checkpoint {path} was written by {saved_ws} ranks, but this job has "
            f"{strategy.world_size}; ZeRO's partitions cannot be re-cut on load. {how}"
        )
    if saved_stage != strategy.stage:
        raise CheckpointError(
            f"The sharded DeepSpeed checkpoint {path} was written with ZeRO stage {saved_stage}, but this strategy "
            f"runs stage {strategy.stage}. {how}"
        )


# ---------------------------------------------------------------------- consolidation (full form)
def _deepspeed_utils() -> Any:
    from phalanx.strategies.deepspeed import import_deepspeed

    return import_deepspeed().utils


@contextlib.contextmanager
def _gathered(params: list[nn.Parameter], modifier_rank: int | None) -> Any:
    """Full (unpartitioned) values of ZeRO-3 parameters inside the block; no-op for stages 1 and 2."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    from phalanx.strategies.deepspeed import import_deepspeed

    with import_deepspeed().zero.GatheredParameters(partitioned, modifier_rank=modifier_rank):
        yield


def _module_entries(strategy: DeepSpeedStrategy) -> dict[str, Any]:
    """state_dict keys of the engine's module mapped to their parameter or buffer objects."""
    module = strategy._engine.module
    return dict(module.state_dict(keep_vars=True))


def full_module_state(strategy: DeepSpeedStrategy) -> dict[str, Any]:
    """The module's state dict with float32 master weights (what DDP's module would hold)."""
    utils = _deepspeed_utils()
    out: dict[str, Any] = {}
    with strategy.guard.guarded("consolidate DeepSpeed weights"):
        for key, value in _module_entries(strategy).items():
            if isinstance(value, nn.Parameter):
                full = utils.safe_get_full_fp32_param(value)
                if full is None:  # frozen: not in the optimizer, so no fp32 master copy
                    with _gathered([value], None):
                        full = value.detach().clone()
                out[key] = full.detach().cpu().clone()
            else:
                out[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    return out


def _expected_shape(value: Any) -> tuple[int, ...] | None:
    if hasattr(value, "ds_shape"):
        return tuple(value.ds_shape)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def load_full_module_state(strategy: DeepSpeedStrategy, state: dict[str, Any], strict: bool) -> None:
    """Write a full state dict into the engine: the working (possibly bf16, possibly partitioned)
    parameters and the float32 master copies both, so the next step starts from exactly these values."""
    entries = _module_entries(strategy)
    missing = [k for k in entries if k not in state]
    unexpected = [k for k in state if k not in entries]
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {_expected_shape(v)}"
        for k, v in entries.items()
        if k in state and isinstance(state[k], torch.Tensor) and tuple(state[k].shape) != _expected_shape(v)
    ]
    if shapes or (strict and (missing or unexpected)):
        parts = [f"{name}: {items[:12]}" for name, items in
                 (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)) if items]
        raise CheckpointError(
            f"The checkpoint does not match {type(strategy._engine.module).__name__}: {'; '.join(parts)}. "
            "Is it a checkpoint of another model?"
            + ("" if shapes else " Pass strict=False to load the matching entries.")
        )
    utils = _deepspeed_utils()
    with strategy.guard.guarded("load consolidated DeepSpeed weights"), torch.no_grad():
        for key, target in entries.items():
            if key not in state:
                continue
            value = state[key]
            if isinstance(target, nn.Parameter):
                with _gathered([target], 0):
                    target.data.copy_(value.to(device=target.device, dtype=target.dtype))
                master = value.to(device=target.device, dtype=torch.float32)
                utils.safe_set_full_fp32_param(target, master)
            elif isinstance(target, torch.Tensor):
                target.copy_(value.to(device=target.device, dtype=target.dtype))


def _flat_tensors(strategy: DeepSpeedStrategy) -> list[torch.Tensor]:
    """This rank's flat fp32 partitions, which the wrapped torch optimizer keys its state by. (ZeRO-3
    puts them into the optimizer's param_groups only while it steps, so ask ZeRO, not the groups.)"""
    zero = strategy._engine.optimizer
    for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        flats = getattr(zero, attr, None)
        if flats is not None:
            return list(flats)
    raise CheckpointError(
        f"Cannot find the fp32 partitions of {type(zero).__name__}: this DeepSpeed version is not supported by "
        "phalanx's consolidated ('full') checkpoints. Use state_dict_type='sharded'."
    )


def _flat_states(strategy: DeepSpeedStrategy) -> list[dict[str, Any]]:
    """The wrapped torch optimizer's per-partition states."""
    opt = strategy._client_optimizer
    assert opt is not None
    return [opt.state[t] for t in _flat_tensors(strategy) if t in opt.state]


def full_optimizer_state(strategy: DeepSpeedStrategy) -> dict[str, Any]:
    """The optimizer state in torch's layout, as ``optimizer.state_dict()`` would give it under DDP."""
    utils = _deepspeed_utils()
    opt = strategy._client_optimizer
    assert opt is not None
    flat = _flat_states(strategy)
    tensor_keys = sorted({k for s in flat for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0})
    scalars = {k: v for s in flat for k, v in s.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    with strategy.guard.guarded("consolidate DeepSpeed optimizer state"):
        for group, params in zip(opt.param_groups, strategy._param_groups):
            ids = []
            for p in params:
                if tensor_keys and p.requires_grad:
                    entry = {k: utils.safe_get_full_optimizer_state(p, k).detach().cpu().clone() for k in tensor_keys}
                    entry.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()})
                    state[index] = entry
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state(strategy: DeepSpeedStrategy, saved: dict[str, Any]) -> None:
    opt = strategy._client_optimizer
    assert opt is not None
    groups = saved.get("param_groups", [])
    sizes = [len(g) for g in strategy._param_groups]
    if [len(g["params"]) for g in groups] != sizes:
        raise CheckpointError(
            f"The checkpoint's optimizer has parameter groups of sizes {[len(g['params']) for g in groups]}, but "
            f"this optimizer has {sizes}. Is it a checkpoint of another model or optimizer?"
        )
    for group, saved_group in zip(opt.param_groups, groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    per_param = saved.get("state", {})
    if not per_param:
        return
    first = next(iter(per_param.values()))
    tensor_keys = [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
    scalars = {k: v for k, v in first.items() if k not in tensor_keys}
    _ensure_flat_state(strategy, tensor_keys)
    for s in _flat_states(strategy):
        s.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()})
    utils = _deepspeed_utils()
    params = [p for g in strategy._param_groups for p in g]
    with strategy.guard.guarded("load consolidated DeepSpeed optimizer state"), torch.no_grad():
        for index, p in enumerate(params):
            entry = per_param.get(index)
            if entry is None or not p.requires_grad:
                continue
            for key in tensor_keys:
                utils.safe_set_full_optimizer_state(p, entry[key].to(torch.float32), key)


def _ensure_flat_state(strategy: DeepSpeedStrategy, keys: list[str]) -> None:
    """Torch optimizers create their state at the first step. Before it (a fresh job resuming), create
    zero tensors for each flat partition and let ZeRO map its per-parameter views onto them."""
    opt = strategy._client_optimizer
    assert opt is not None
    created = False
    for flat in _flat_tensors(strategy):
        entry = opt.state[flat]
        for key in keys:
            if key not in entry:
                entry[key] = torch.zeros_like(flat, dtype=torch.float32)
                created = True
    zero = strategy._engine.optimizer
    if created and hasattr(zero, "_hp_optimizer_states_linked"):
        # ZeRO 1/2 link each parameter to its slice of the optimizer state once, lazily at the first step.
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
