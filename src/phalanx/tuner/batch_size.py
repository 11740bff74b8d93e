"""Batch-size finder (``Tuner(trainer).scale_batch_size(model)``) that leaves no trace.

It grows the batch size (``model.batch_size``, ``model.hparams.batch_size`` or the datamodule's, or
``batch_arg_name``) and runs a few training steps (or evaluation batches) at each size until one
runs out of memory: "power" mode keeps the last size that fit, "binsearch" then bisects between the
last success and the first failure. The data must come from the module's or datamodule's
``*_dataloader()`` methods, which read the attribute each time they are called.

Afterwards everything is as before, like the LR finder: weights and gradients, optimizer and
scheduler state, loss scaler, RNG states, counters and metrics (the LR finder's restore point); only the
batch-size attribute changes to the size found. Every rank agrees on each trial's outcome (a failure
on any rank fails the trial everywhere). Limitation: an out-of-memory error inside a collective (e.g.
DDP's gradient all-reduce) on one rank leaves the others waiting until the guard's timeout ends them.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

import torch

from phalanx.utils import diagnostics
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.tuner.view import TunedTrainer

_METHODS = ("fit", "validate", "test", "predict")


def is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("out of memory" in text or "CUDNN_STATUS_NOT_SUPPORTED" in text)


def _holders(trainer: TunedTrainer, name: str) -> list[Any]:
    module, dm = trainer.module, trainer.datamodule
    candidates = [module, module.hparams]
    if dm is not None:
        candidates += [dm, dm.hparams]
    return [c for c in candidates if (name in c if isinstance(c, dict) else hasattr(c, name))]


def get_size(trainer: TunedTrainer, name: str) -> int:
    holders = _holders(trainer, name)
    if not holders:
        raise MisconfigurationError(
            f"scale_batch_size looks for {name!r} on the module, module.hparams and the datamodule, and found it "
            "nowhere. Add the attribute (and use it in *_dataloader()), or pass batch_arg_name=."
        )
    first = holders[0]
    return int(first[name] if isinstance(first, dict) else getattr(first, name))


def set_size(trainer: TunedTrainer, name: str, value: int) -> None:
    for holder in _holders(trainer, name):
        if isinstance(holder, dict):
            holder[name] = value
        else:
            setattr(holder, name, value)


def _dataset_length(trainer: TunedTrainer, method: str) -> int | None:
    loader = trainer.train_dataloader if method == "fit" else None
    if method != "fit":
        loaders = {"validate": trainer.val_dataloaders, "test": trainer.test_dataloaders,
                   "predict": trainer.predict_dataloaders}[method]
        loader = loaders[0] if loaders else None
    dataset = getattr(getattr(loader, "loader", loader), "dataset", None)
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:
        return None


def _trial(trainer: TunedTrainer, method: str, steps: int) -> None:
    """A few steps at the current size, with the loaders rebuilt from their methods."""

    t = trainer
    if method == "fit":
        t.prepare_fit(None, None)
        optimizer = t.optimizers[0]
        t.current_stage = "train"
        t.module.train()
        done = 0
        for batch_idx, batch, size, boundary in t.training_windows(0):
            t.training_micro_batch(batch, batch_idx, size, boundary)
            if boundary:
                t.optimizer_step_without_callbacks(optimizer)
                done += 1
                if done >= steps:
                    break
        return
    getter = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}[method]
    loaders = t.data.eval_loaders(None, getter, t.module)
    if not loaders:
        raise MisconfigurationError(f"scale_batch_size(method={method!r}) needs the module's {getter}().")
    t.model_connector.setup()
    if method == "predict":
        t.data.predict_dataloaders = loaders
        t.run_predict(loaders, steps)
    else:
        if method == "test":
            t.data.test_dataloaders = loaders
        else:
            t.data.val_dataloaders = loaders
        t.run_evaluation("validate" if method == "validate" else "test", loaders, steps)


def _outcome(trainer: TunedTrainer, method: str, steps: int) -> bool:
    """Whether the trial fit in memory on every rank."""
    ok = True
    try:
        _trial(trainer, method, steps)
    except BaseException as err:
        if not is_oom(err):
            raise
        ok = False
    finally:
        for p in trainer.module.parameters():
            p.grad = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    votes = trainer.fabric.all_gather(torch.tensor(int(ok)))
    return bool(int(votes.min()))


def search(
    trainer: TunedTrainer, method: str, mode: str, steps_per_trial: int, init_val: int, max_trials: int,
    batch_arg_name: str, margin: float, max_val: int,
) -> int:
    """Run the search (the caller restores the trainer's state afterwards); returns the size found."""
    if method not in _METHODS:
        raise MisconfigurationError(f"scale_batch_size method={method!r}; use one of {_METHODS}.")
    if mode not in ("power", "binsearch"):
        raise MisconfigurationError(f"scale_batch_size mode={mode!r}; use 'power' or 'binsearch'.")
    if not 0.0 <= margin < 1.0:
        raise MisconfigurationError(f"scale_batch_size margin={margin}; it must be in [0, 1).")
    if steps_per_trial < 1 or init_val < 1 or max_trials < 1:
        raise MisconfigurationError("scale_batch_size needs steps_per_trial, init_val and max_trials >= 1.")
    t = trainer
    get_size(t, batch_arg_name)  # fail early when there is no attribute
    size = init_val
    set_size(t, batch_arg_name, size)
    best: int | None = None
    low, high = 1, None
    rank = t.global_rank
    for _ in range(max_trials):
        if _outcome(t, method, steps_per_trial):
            diagnostics.info(f"scale_batch_size: batch size {size} succeeded.", rank=rank)
            best = size
            low = size
            length = _dataset_length(t, method)
            if high is None:
                nxt = size * 2
                if length is not None and size >= length:
                    break  # a bigger batch would not change what is loaded
            else:
                nxt = (low + high) // 2
                if high - low <= 1:
                    break
            if nxt >= max_val:
                diagnostics.info(f"scale_batch_size: reached max_val={max_val}; stopping.", rank=rank)
                break
        else:
            diagnostics.info(f"scale_batch_size: batch size {size} ran out of memory.", rank=rank)
            high = size
            if mode == "power" and best is not None:
                break
            nxt = size // 2 if best is None else (low + high) // 2
            if nxt < 1 or (best is not None and nxt <= best):
                break
        size = nxt
        set_size(t, batch_arg_name, size)
    if best is None:
        raise MisconfigurationError(
            f"scale_batch_size: even batch size {size} ran out of memory; reduce the model or the input size."
        )
    if mode == "binsearch" and margin > 0:
        best = max(1, int(best * (1 - margin)))
    return best


def scale_batch_size(
    trainer: TunedTrainer, model: Any, train_dataloaders: Any = None, val_dataloaders: Any = None,
    dataloaders: Any = None, datamodule: Any = None, method: str = "fit", mode: str = "power",
    steps_per_trial: int = 3, init_val: int = 2, max_trials: int = 25, batch_arg_name: str = "batch_size",
    margin: float = 0.05, max_val: int = 8192,
) -> int:
    """``Tuner(trainer).scale_batch_size``: see the module docstring."""
    from phalanx.core.module_state import TrainerRestorePoint
    from phalanx.tuner.preconditions import refuse_without_separate_optimizers

    if train_dataloaders is not None or val_dataloaders is not None or dataloaders is not None:
        raise MisconfigurationError(
            "scale_batch_size cannot change the batch size of dataloaders passed in: build them in the module's "
            "(or datamodule's) *_dataloader() methods from self.batch_size, and pass no dataloaders."
        )
    t = trainer
    refuse_without_separate_optimizers(t, "scale_batch_size", "(it re-creates the optimizer for every trial)")
    inside_fit = t.stage == "fit" and t.model is not None and t.module is model

    def run() -> int:
        if t.model is None and method == "fit":
            t.prepare_fit(None, None)
        elif t.model is None:
            t.model_connector.setup()
        point = TrainerRestorePoint(t)
        sources = (t.train_dataloader, t.train_sampler, t.num_training_batches, list(t.val_dataloaders),
                   t.optimizers, t.step_optimizers)
        try:
            found = search(t, method, mode, steps_per_trial, init_val, max_trials, batch_arg_name, margin, max_val)
        finally:
            (t.data.train_dataloader, t.data.train_sampler, t.data.num_training_batches, t.data.val_dataloaders, opts,
             steps) = sources
            t.model_connector.optimizers, t.model_connector.step_optimizers = opts, steps
            point.restore(t)
        set_size(t, batch_arg_name, found)
        if inside_fit:
            t.data.prepare_train(t.module)  # the fit continues with loaders of the size found
        return found

    if inside_fit:
        return run()
    found: int = t.run_stage("scale_batch_size", model, datamodule, run)
    return found
