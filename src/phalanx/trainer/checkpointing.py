"""What a Trainer checkpoint holds, and putting it back exactly.

Saved: the model, optimizer, schedulers (and the precision's loss scaler, through fabric.save), the
loop counters and the position inside the epoch, every callback's ``state_dict``, the datamodule's
state, and per rank: the RNG states (now and at the start of the epoch) and the training metric
accumulators. Resuming restores all of it, so a run killed mid-epoch and resumed ends bit-identical
to one that never stopped (deterministic CPU runs).

Checkpoints are taken only between optimizer steps: saving inside an accumulation window would drop
the gradients accumulated so far, so the Trainer refuses.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.errors import CheckpointError, MisconfigurationError
from phalanx.module_state import load_metric_states, metric_states
from phalanx.seed import capture_rng_state

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer

FORMAT = 1


def callback_keys(callbacks: list[Any]) -> list[tuple[str, Any]]:
    """A stable key per stateful callback: its ``state_key`` (or class name), numbered if repeated."""
    seen: dict[str, int] = {}
    out = []
    for cb in callbacks:
        if not callable(getattr(cb, "state_dict", None)):
            continue
        key = getattr(cb, "state_key", None) or type(cb).__qualname__
        n = seen.get(key, 0)
        seen[key] = n + 1
        out.append((key if n == 0 else f"{key}#{n}", cb))
    return out


def save(trainer: Trainer, path: str | Path, weights_only: bool = False) -> None:
    """Write a checkpoint (call on every rank; rank 0 writes, atomically)."""
    t = trainer
    if t.model is None:
        raise MisconfigurationError("trainer.save_checkpoint() needs a model: call it during or after fit/validate.")
    if t.in_window:
        raise MisconfigurationError(
            "trainer.save_checkpoint() was called inside a gradient-accumulation window: the gradients accumulated "
            "so far are not part of a checkpoint, so resuming would not match. Save after an optimizer step "
            "(e.g. when trainer.global_step changes), as ModelCheckpoint does."
        )
    state: dict[str, Any] = {"model": t.model, "phalanx_trainer": FORMAT, "hyper_parameters": dict(t.module.hparams)}
    if not weights_only:
        if t.optimizer is not None:
            state["optimizer"] = t.optimizer
        for i, config in enumerate(t.lr_scheduler_configs):
            state[f"lr_scheduler_{i}"] = config.scheduler
        done = t.epoch_finished
        state["loops"] = {
            "epoch": t.current_epoch + 1 if done else t.current_epoch,
            "batches_done": 0 if done else t.batches_done,
            "global_step": t.global_step,
            "should_stop": t.should_stop,
            "world_size": t.world_size,
            "samples_consumed": 0 if done else t.batches_done * t.train_samples_per_batch,
        }
        state["callbacks"] = {key: cb.state_dict() for key, cb in callback_keys(t.callbacks)}
        if t.datamodule is not None:
            state["datamodule"] = t.datamodule.state_dict()
        own = {
            "rng": capture_rng_state(),
            "epoch_rng": None if done else t.epoch_start_rng,
            "results": None if done else t.results["train"].state_dict(),
            "metrics": metric_states(t.module),  # torchmetrics state: not in state_dict (non-persistent)
        }
        state["rank_states"] = t.fabric.all_gather_object(own)
    for cb in t.callbacks:
        hook = getattr(cb, "on_save_checkpoint", None)
        if callable(hook):
            hook(t, t.module, state)
    t.module.on_save_checkpoint(state)
    t.fabric.save(path, state)


def load_weights(trainer: Trainer, path: str | Path) -> None:
    """Only the model (for validate/test/predict with ckpt_path)."""
    trainer.fabric.load(path, {"model": trainer.model}, strict=False)


def restore(trainer: Trainer, path: str | Path) -> None:
    """Restore everything ``save`` wrote; the loops pick up the resume state at the next epoch start."""
    t = trainer
    state: dict[str, Any] = {"model": t.model, "optimizer": t.optimizer}
    for i, config in enumerate(t.lr_scheduler_configs):
        state[f"lr_scheduler_{i}"] = config.scheduler
    try:
        rest = t.fabric.load(path, state, strict=True)
    except CheckpointError as err:
        raise CheckpointError(
            f"Cannot resume training from {path}: {err} (a weights-only checkpoint, or one written with a "
            "different configure_optimizers, cannot resume a fit; load its weights with trainer.validate/test"
            "(ckpt_path=...) or fabric.load instead)."
        ) from err
    if rest.get("phalanx_trainer") != FORMAT or "loops" not in rest:
        raise CheckpointError(f"{path} was not written by phalanx.Trainer.save_checkpoint; it cannot resume a fit.")
    loops = rest["loops"]
    t.current_epoch, t.global_step = int(loops["epoch"]), int(loops["global_step"])
    t.batches_done, t.should_stop = int(loops["batches_done"]), bool(loops["should_stop"])
    saved = rest.get("callbacks", {})
    current = dict(callback_keys(t.callbacks))
    for key, cb_state in saved.items():
        if key in current:
            current[key].load_state_dict(cb_state)
        elif t.is_global_zero:
            print(f"[phalanx] The checkpoint holds state of callback {key!r}, which this Trainer does not have; "
                  "it is ignored.", file=sys.stderr)
    if t.datamodule is not None and "datamodule" in rest:
        t.datamodule.load_state_dict(rest["datamodule"])
    ranks = rest["rank_states"]
    if len(ranks) == t.world_size:
        mine = ranks[t.global_rank]
    else:
        # A different world size cannot replay per-rank random streams; say so, keep going.
        if t.is_global_zero:
            print(f"[phalanx] The checkpoint was written by {len(ranks)} ranks and this job has {t.world_size}: data "
                  "order and counters are restored, per-rank RNG states and partial epoch metrics are not.",
                  file=sys.stderr)
        mine = {"rng": capture_rng_state(), "epoch_rng": None, "results": None}
    load_metric_states(t.module, mine.get("metrics"))
    t.set_resume_state({
        "batches_done": t.batches_done, "samples": int(loops.get("samples_consumed", 0)),
        "rng": mine["rng"], "epoch_rng": mine["epoch_rng"],
        "results": mine["results"],
    })
    for cb in t.callbacks:
        hook = getattr(cb, "on_load_checkpoint", None)
        if callable(hook):
            hook(t, t.module, rest)
    t.module.on_load_checkpoint(rest)
