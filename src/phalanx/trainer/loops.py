"""The training, evaluation and prediction loops.

Gradient accumulation means one thing on every strategy: a window of N micro-batches (or the
shorter last window of an epoch) runs forward and backward with the loss divided by the window's
size, gradient sync is skipped on all but the last micro-batch (forward and backward both inside
``fabric.no_backward_sync``), and then exactly one optimizer step, one ``global_step`` increment,
one round of step-interval schedulers and one ``on_before_optimizer_step`` happen.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from itertools import count
from typing import TYPE_CHECKING, Any

import torch

from phalanx.errors import MisconfigurationError
from phalanx.seed import capture_rng_state, restore_rng_state
from phalanx.trainer.data import num_batches
from phalanx.trainer.optim import step_schedulers
from phalanx.trainer.stepping import train_batch

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer


def loss_of(output: Any) -> torch.Tensor:
    """The tensor to backpropagate from what ``training_step`` returned."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        loss = output["loss"]
    else:
        raise MisconfigurationError(
            f"training_step returned {type(output).__name__}; return the loss tensor or a dict with a 'loss' tensor. "
            "(Skipping a batch by returning None is not supported: on several ranks it would leave the others "
            "waiting in backward.)"
        )
    if loss.numel() != 1:
        raise MisconfigurationError(
            f"training_step returned a loss of shape {tuple(loss.shape)}; reduce it to a scalar."
        )
    return loss


def detached(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, Mapping):
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in output.items()}
    return output


def windows(iterator: Iterator[Any], start: int, total: int | None, n: int) -> Iterator[tuple[int, Any, int, bool]]:
    """``(batch_idx, batch, window_size, is_boundary)`` for each batch from ``start``.

    With a known length the window sizes are computed; without one, each window is read ahead so
    the size of the last (partial) window is known before its first backward.
    """
    if total is not None:
        for batch_idx in range(start, total):
            try:
                batch = next(iterator)
            except StopIteration:
                return
            first = batch_idx - batch_idx % n
            size = min(n, total - first)
            yield batch_idx, batch, size, batch_idx + 1 == first + size
        return
    batch_idx = start
    while True:
        window = []
        for _ in range(n - batch_idx % n):
            try:
                window.append(next(iterator))
            except StopIteration:
                break
        if not window:
            return
        for i, batch in enumerate(window):
            yield batch_idx, batch, len(window), i == len(window) - 1
            batch_idx += 1


def start_epoch(fabric: Any, loader: Any, epoch: int) -> Iterator[Any]:
    """An iterator over one pass of a set-up loader, created NOW.

    Iterating the set-up loader itself would create the DataLoader's iterator lazily, at the first
    batch; that creation draws a seed from torch's RNG, so when it happens matters for exact
    resume. Here it happens at the call, always before the resumed RNG state is put back.
    """
    raw = loader.loader
    for sampler in (getattr(raw, "sampler", None), getattr(raw.batch_sampler, "sampler", None)):
        if sampler is not None and callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)
            break
    iterator = iter(raw)
    return (fabric.to_device(batch) for batch in iterator)


def micro_batch(trainer: Trainer, batch: Any, batch_idx: int, window_size: int, boundary: bool) -> Any:
    """Forward and backward of one micro-batch; returns training_step's output."""
    fabric, model = trainer.fabric, trainer.model
    with fabric.no_backward_sync(model, enabled=not boundary):
        output = model.training_step(batch, batch_idx)
        loss = loss_of(output)
        fabric.backward(loss / window_size if window_size > 1 else loss, model=model)
    return output


def optimizer_step(trainer: Trainer, optimizer: Any, hooks: bool = True) -> None:
    """One real step: hooks, clipping, the optimizer's step, zero_grad."""
    module = trainer.module
    if hooks:
        module.on_before_optimizer_step(optimizer)
        trainer.call("on_before_optimizer_step", optimizer)
    if trainer.gradient_clip_val is not None:
        if trainer.gradient_clip_algorithm == "norm":
            trainer.fabric.clip_gradients(trainer.model, optimizer, max_norm=trainer.gradient_clip_val,
                                          error_if_nonfinite=False)
        else:
            trainer.fabric.clip_gradients(trainer.model, optimizer, clip_val=trainer.gradient_clip_val)
    if hooks:
        module.optimizer_step(trainer.current_epoch, trainer.batches_done, optimizer)
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _takes_dataloader_idx(method: Any) -> bool:
    """With several loaders, steps that declare ``dataloader_idx`` (or ``**kwargs``) receive it."""
    params = inspect.signature(method).parameters.values()
    return any(p.name == "dataloader_idx" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _val_due_mid_epoch(trainer: Trainer, batch_idx: int, total: int | None) -> bool:
    interval = trainer.val_check_batches
    if interval is None or not trainer.val_dataloaders or (total is not None and batch_idx + 1 >= total):
        return False
    return (batch_idx + 1) % interval == 0


def _val_due_at_epoch_end(trainer: Trainer) -> bool:
    every = trainer.check_val_every_n_epoch
    return bool(trainer.val_dataloaders) and every is not None and (trainer.current_epoch + 1) % every == 0


def run_train_epoch(trainer: Trainer) -> None:
    t = trainer
    resume = t.take_resume_state()
    start = resume["batches_done"] if resume else 0
    if resume is not None:
        restore_rng_state(resume["epoch_rng"] if start > 0 and resume["epoch_rng"] else resume["rng"])
    t.epoch_start_rng = capture_rng_state()
    results = t.results["train"]
    results.reset()
    if start > 0 and resume is not None and resume.get("results") is not None:
        results.load_state_dict(resume["results"])
    t.reload_dataloaders_if_due()
    t.module.train()
    t.module.on_train_epoch_start()
    t.call("on_train_epoch_start")
    if t.train_sampler is not None:
        t.train_sampler.skip = resume["samples"] if resume else 0
    iterator = start_epoch(t.fabric, t.train_dataloader, t.current_epoch)
    if t.train_sampler is None:
        for _ in range(start):  # the user's own sampler: re-read and discard what was consumed
            next(iterator, None)
    if resume is not None and start > 0:
        restore_rng_state(resume["rng"])
    total = t.num_training_batches
    for batch_idx, batch, size, boundary in windows(iterator, start, total, t.accumulate_grad_batches):
        results.batch = batch
        t.in_window = not boundary
        if not t.batch_start(batch, batch_idx):
            break
        output = train_batch(t, batch, batch_idx, size, boundary)
        t.batches_done = batch_idx + 1
        t.publish_step_metrics(results.sync_step(t.fabric), results, log=boundary)
        # Validation before the batch-end hooks: a checkpoint they write then already reflects it
        # (its metrics, and the RNG draws it made), so resuming from it does not replay it.
        if boundary and _val_due_mid_epoch(t, batch_idx, total):
            run_evaluation(t, "validate", t.val_dataloaders, t.limit_val_batches)
        t.module.on_train_batch_end(detached(output), batch, batch_idx)
        t.call("on_train_batch_end", detached(output), batch, batch_idx)
        t.in_window = False
        if boundary and (t.should_stop or t.max_steps_reached):
            break
    del iterator
    if _val_due_at_epoch_end(t):
        run_evaluation(t, "validate", t.val_dataloaders, t.limit_val_batches)
    t.epoch_finished = True
    results.in_epoch_end = True
    t.module.on_train_epoch_end()
    results.in_epoch_end = False
    t.publish_epoch_metrics(results.sync_epoch(t.fabric), results)
    step_schedulers(t.module, t.lr_scheduler_configs, "epoch", t.current_epoch + 1, t.callback_metrics)
    t.call("on_train_epoch_end")
    t.current_epoch += 1
    t.batches_done = 0
    t.epoch_finished = False


def run_fit(trainer: Trainer) -> None:
    while not trainer.should_stop and not trainer.max_steps_reached and trainer.current_epoch < trainer.max_epochs:
        run_train_epoch(trainer)


def run_evaluation(trainer: Trainer, stage: str, loaders: list[Any], limit: int | float) -> list[dict[str, float]]:
    """Validation or test over every loader; returns one dict of epoch metrics per loader."""
    t = trainer
    hook = "validation" if stage == "validate" else "test"
    results = t.results[stage]
    results.reset()
    was_training = t.module.training
    previous_stage = t.current_stage
    t.current_stage = stage
    getattr(t.module, f"on_{hook}_model_eval")()
    t.hook(f"on_{hook}_start")
    getattr(t.module, f"on_{hook}_epoch_start")()
    t.call(f"on_{hook}_epoch_start")
    step_fn = getattr(t.model, f"{hook}_step")
    takes_idx = _takes_dataloader_idx(getattr(t.module, f"{hook}_step"))
    t.num_eval_batches = [num_batches(loader, limit) for loader in loaders]
    with eval_grad_mode(t):
        for idx, loader in enumerate(loaders):
            results.dataloader_idx = idx
            results.suffix = f"/dataloader_idx_{idx}" if len(loaders) > 1 else ""
            n = num_batches(loader, limit)
            for batch_idx, batch in zip(range(n) if n is not None else count(), loader):
                results.batch = batch
                extra = {"dataloader_idx": idx} if len(loaders) > 1 and takes_idx else {}
                t.hook(f"on_{hook}_batch_start", batch, batch_idx, *([idx] if len(loaders) > 1 else []))
                output = step_fn(batch, batch_idx, **extra)
                t.publish_step_metrics(results.sync_step(t.fabric), results, log=True)
                t.hook(f"on_{hook}_batch_end", output, batch, batch_idx, *([idx] if len(loaders) > 1 else []))
    results.in_epoch_end = True
    with eval_grad_mode(t):
        getattr(t.module, f"on_{hook}_epoch_end")()
    results.in_epoch_end = False
    metrics = t.publish_epoch_metrics(results.sync_epoch(t.fabric), results)
    t.call(f"on_{hook}_epoch_end")
    t.hook(f"on_{hook}_end")
    t.current_stage = previous_stage
    if was_training:
        getattr(t.module, f"on_{hook}_model_train")()
    per_loader: list[dict[str, float]] = [{} for _ in loaders]
    for name, entry in results.entries.items():
        if entry.on_epoch:
            key = f"{name}_epoch" if entry.on_step else name
            per_loader[entry.dataloader_idx][key] = metrics[name]
    return per_loader


def run_predict(trainer: Trainer, loaders: list[Any], limit: int | float) -> list[list[Any]]:
    t = trainer
    was_training = t.module.training
    t.module.on_predict_model_eval()
    t.hook("on_predict_start")
    t.hook("on_predict_epoch_start")
    out: list[list[Any]] = []
    takes_idx = _takes_dataloader_idx(t.module.predict_step)
    with eval_grad_mode(t):
        for idx, loader in enumerate(loaders):
            preds: list[Any] = []
            n = num_batches(loader, limit)
            for batch_idx, batch in zip(range(n) if n is not None else count(), loader):
                extra = {"dataloader_idx": idx} if len(loaders) > 1 and takes_idx else {}
                t.hook("on_predict_batch_start", batch, batch_idx, *([idx] if len(loaders) > 1 else []))
                preds.append(t.model.predict_step(batch, batch_idx, **extra))
                t.hook("on_predict_batch_end", preds[-1], batch, batch_idx, *([idx] if len(loaders) > 1 else []))
            out.append(preds)
    t.hook("on_predict_epoch_end")
    t.hook("on_predict_end")
    t.module.train(was_training)
    return out


def eval_grad_mode(trainer: Trainer) -> Any:
    """``Trainer(inference_mode=True)``: torch.inference_mode where the strategy allows it (see
    ``Strategy.supports_inference_mode``), else torch.no_grad."""
    allowed = trainer.inference_mode and trainer.fabric.strategy.supports_inference_mode
    return torch.inference_mode() if allowed else torch.no_grad()
