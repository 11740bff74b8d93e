"""The training, evaluation and prediction loops.

Gradient accumulation means one thing on every strategy: a window of N micro-batches (or the
shorter last window of an epoch) runs forward and backward with the loss divided by the window's
size, gradient sync is skipped on all but the last micro-batch (forward and backward both inside
``fabric.no_backward_sync``), and then exactly one optimizer step, one ``global_step`` increment,
one round of step-interval schedulers and one ``on_before_optimizer_step`` happen.

A non-finite training loss stops the run, naming epoch, global step, batch and rank
(:mod:`phalanx.trainer.loss_check`: on a CPU before the optimizer step, on a GPU a few steps late with the step
skipped on the device, so the GPU never waits for the check). A rank that raises ends the job; its peers are
stopped by the launcher with this rank's error as the cause. ``Trainer(detect_anomaly=True)`` adds the full
gradient check of :mod:`phalanx.fabric.anomaly`.

The loops run on :class:`~phalanx.trainer.attributes.TrainerAttributes` (what a Trainer holds, without its entry
points, which call these loops); per batch they touch the loop state and the settings through locals
bound once per epoch, not through the Trainer's properties.

What ``self.log`` records reaches ``callback_metrics``, the progress bar and the loggers through the
Trainer's :class:`~phalanx.trainer.logger_connector.LoggerConnector`, which the loops tell where they are
(epoch start, batch, batch end, epoch end); it decides where step values are synced and read.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from itertools import count, repeat
from typing import TYPE_CHECKING, Any

import torch

from phalanx.core.module import overrides
from phalanx.core.optimizers import step_schedulers
from phalanx.trainer.loaders import empty_loader_error, num_batches
from phalanx.trainer.loss_check import LossCheck
from phalanx.trainer.stepping import StepPlan, as_outputs, clips, loss_of, train_batch
from phalanx.utils import diagnostics
from phalanx.utils.seed import capture_rng_state, restore_rng_state
from phalanx.utils.tensors import move_to_device

if TYPE_CHECKING:
    from phalanx.trainer.attributes import TrainerAttributes


def detached(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, Mapping):
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in output.items()}
    return output


def windows(iterator: Iterator[Any], start: int, total: int | None, n: int) -> Iterator[tuple[int, Any, int, bool]]:
    """``(batch_idx, batch, window_size, is_boundary)`` for each batch from ``start``.

    With a known length the window sizes are computed; without one, each window is read ahead so
    the size of the last (partial) window is known before its first backward. Windows end at
    multiples of ``n``; a ``start`` inside a window (a resume with another global batch size) makes
    the first window shorter, as the epoch's last one may be.
    """
    if total is not None and n == 1:
        # No accumulation: every batch is its own window. Built from C iterators (no Python frame per
        # batch); zip asks the range first, so no batch is read past ``total``.
        return zip(range(start, total), iterator, repeat(1), repeat(True))
    return _windows(iterator, start, total, n)


def _windows(iterator: Iterator[Any], start: int, total: int | None, n: int) -> Iterator[tuple[int, Any, int, bool]]:
    if total is not None:
        for batch_idx in range(start, total):
            try:
                batch = next(iterator)
            except StopIteration:
                return
            first = batch_idx - batch_idx % n
            end = min(first + n, total)
            # A resume at another batch size may start inside a window: that window is shorter.
            yield batch_idx, batch, end - max(first, start), batch_idx + 1 == end
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
    return map(move_to_device, iter(raw), repeat(fabric.device))


def micro_batch(
    trainer: TrainerAttributes, batch: Any, batch_idx: int, window_size: int, boundary: bool, step: Any = None
) -> tuple[Any, Any]:
    """Forward and backward of one micro-batch (the tuners' steps), with the Module's own
    ``on_before_backward``/``on_after_backward`` and no callback's; returns training_step's output and its
    loss. ``step``: ``trainer.model.training_step`` looked up once by the caller (it is a redirect through
    the strategy's forward that finds the method at each call)."""
    fabric, model = trainer.fabric, trainer.model
    if step is None:
        step = model.training_step
    with contextlib.nullcontext() if boundary else fabric.no_backward_sync(model, enabled=True):
        output = step(batch, batch_idx)
        loss = loss_of(output)
        scaled = loss / window_size if window_size > 1 else loss
        trainer.hooks.run_module("on_before_backward", scaled)
        fabric.backward(scaled, model=model)
        trainer.hooks.run_module("on_after_backward")
    return output, loss


def optimizer_step(trainer: TrainerAttributes, optimizer: Any) -> None:
    """One real step without callbacks or counting (the tuners' steps): the Module's own
    ``on_before_optimizer_step`` and ``configure_gradient_clipping`` (with the Trainer's clipping settings),
    the optimizer's step, zero_grad. A Module's hooks shape the update a fit makes (clipping, a gradient
    edited after backward), so a search without them would measure another training; callbacks observe
    and are left out. The Trainer's own steps, with Lightning's whole hook protocol, are
    :func:`phalanx.trainer.stepping.train_batch`."""
    module, hooks = trainer.module, trainer.hooks
    hooks.run_module("on_before_optimizer_step", optimizer)
    value, algorithm = trainer.settings.gradient_clip_val, trainer.settings.gradient_clip_algorithm
    if clips(module, value):
        module.configure_gradient_clipping(optimizer, value, algorithm)
    optimizer.step()
    hooks.run_module("on_before_zero_grad", optimizer)
    optimizer.zero_grad(set_to_none=True)


def _takes_dataloader_idx(method: Any) -> bool:
    """With several loaders, steps that declare ``dataloader_idx`` (or ``**kwargs``) receive it."""
    params = inspect.signature(method).parameters.values()
    return any(p.name == "dataloader_idx" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _val_due_mid_epoch(trainer: TrainerAttributes, batch_idx: int, total: int | None) -> bool:
    interval = trainer.val_check_batches
    if interval is None or not trainer.val_dataloaders or (total is not None and batch_idx + 1 >= total):
        return False
    return (batch_idx + 1) % interval == 0


def _val_due_at_epoch_end(trainer: TrainerAttributes) -> bool:
    every = trainer.settings.check_val_every_n_epoch
    return bool(trainer.val_dataloaders) and every is not None and (trainer.loop_state.current_epoch + 1) % every == 0


def _bar_refresh_rate(trainer: TrainerAttributes) -> int:
    from phalanx.callbacks import ProgressBar

    rates = [cb.refresh_rate for cb in trainer.callbacks if isinstance(cb, ProgressBar) and cb.refresh_rate > 0]
    return min(rates) if rates else 0


def resume_start(trainer: TrainerAttributes, resume: dict[str, Any]) -> int:
    """The batch a resumed epoch continues at, in batches of this run's size (``batches_done`` is set to it).

    The saved position is global: ``samples`` of the epoch's order (the same for every world size). With
    the checkpoint's global batch size the batch is the saved one; with another, the run continues at
    that sample, so its batches are counted from there: ``start`` is the epoch's batch count at this size
    minus the batches left, and the first batch begins at the saved sample even where that is not a
    multiple of this run's batch (then the first accumulation window is shorter, see :func:`windows`).
    """
    t, state = trainer, trainer.loop_state
    start, samples = int(resume["batches_done"]), int(resume["samples"])
    saved, ours = int(resume.get("samples_per_batch") or 0), t.train_samples_per_batch
    sampler, total = t.train_sampler, t.num_training_batches
    if sampler is None or not saved or not (samples or start):
        return start  # (the user's own sampler: the loop re-reads and discards ``start`` batches)
    if saved != ours:
        skip = sampler.skip
        sampler.skip = 0
        full = len(t.train_dataloader)
        sampler.skip = samples
        start = max(0, full - len(t.train_dataloader))
        sampler.skip = skip
        state.batches_done = min(start, total) if total is not None else start
    state.samples_offset = samples - state.batches_done * ours  # so the next checkpoint counts the true position
    return start


def say_batch_change(trainer: TrainerAttributes, resume: dict[str, Any], start: int) -> None:
    """Rank 0's one message when the checkpoint's samples per optimizer step differ from this run's."""
    t, state, sampler = trainer, trainer.loop_state, trainer.train_sampler
    samples, saved, ours = int(resume["samples"]), int(resume.get("samples_per_batch") or 0), t.train_samples_per_batch
    composition, n, total = resume.get("composition"), t.accumulate_grad_batches, t.num_training_batches
    if sampler is None or not saved or not (samples or start) or (
            saved == ours and (composition is None or composition[2] == n)):
        return
    if composition:
        replicas_then, batch_then, n_then = composition
        how = (f"{saved * n_then} samples per optimizer step ({_ranks(replicas_then)} x batch {batch_then} x "
               f"accumulation {n_then})")
    else:
        how = f"{saved} samples per batch"
    replicas = sampler.num_replicas
    ours_how = f"{ours * n} ({_ranks(replicas)} x batch {ours // replicas} x accumulation {n})"
    if total is not None and start >= total:
        at = f"the epoch's {total} batches at the new size are done"
    else:
        at = f"batch {start} of {total} at the new size" if total is not None else f"batch {start} at the new size"
        if samples % ours:
            at += ", the first one starting at that sample"
    diagnostics.notice(
        f"The checkpoint was written with {how} and this run takes {ours_how}: it continues at sample {samples} "
        f"of epoch {state.current_epoch} ({at}); global_step continues from {state.global_step}, each further step "
        f"consuming {ours * n} samples.", rank=t.global_rank)


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def run_train_epoch(trainer: TrainerAttributes, check_preemption: Callable[[], None]) -> None:
    """One training epoch (resumed mid-epoch where a checkpoint left it). ``check_preemption`` runs at every
    optimizer-step boundary, on every rank (it ends the process with a checkpoint when a rank was signalled)."""
    t = trainer
    state, settings = t.loop_state, t.settings
    resume = t.take_resume_state()
    mid = resume is not None and (resume["batches_done"] > 0 or resume["samples"] > 0)  # resuming mid-epoch
    if resume is not None:
        restore_rng_state(resume["epoch_rng"] if mid and resume["epoch_rng"] else resume["rng"])
    state.epoch_start_rng = capture_rng_state()
    logging = t.logger_connector
    saved = resume.get("results") if mid and resume is not None else None
    logging.start_epoch("train", _bar_refresh_rate(t), saved, t.module)
    t.data.reload_if_due(state.current_epoch, state.batches_done, t.module)
    start = resume_start(t, resume) if resume is not None else 0  # before the hooks: they may read batches_done
    t.module.train()
    t.module.on_train_epoch_start()
    t.hooks.call("on_train_epoch_start")
    if resume is not None:
        say_batch_change(t, resume, start)
    if t.train_sampler is not None:
        t.train_sampler.skip = resume["samples"] if resume else 0
    iterator = start_epoch(t.fabric, t.train_dataloader, state.current_epoch)
    if t.train_sampler is None:
        for _ in range(start):  # the user's own sampler: re-read and discard what was consumed
            next(iterator, None)
    if mid and resume is not None:
        restore_rng_state(resume["rng"])
    total = t.num_training_batches
    # Per-epoch decisions, so a step does only the work that applies (a step's own cost is the
    # Trainer's overhead over a hand-written loop).
    max_steps = settings.max_steps
    plan = StepPlan(module=t.module, model=t.model, fabric=t.fabric, settings=settings, state=state, hooks=t.hooks,
                    accumulate=t.accumulate_grad_batches, optimizers=t.step_optimizers, loss_check=t.loss_check,
                    window=t.window_losses, schedulers=t.lr_scheduler_configs,
                    metrics=lambda: logging.callback_metrics, sync_metrics=logging.sync_step_metrics)
    batch_start = "on_train_batch_start" in plan.live
    batch_end = overrides(t.module, "on_train_batch_end")
    cb_end = bool(t.hooks.callback_methods("on_train_batch_end"))
    val_due = t.val_check_batches is not None and bool(t.val_dataloaders)
    seen = False
    for batch_idx, batch, size, boundary in windows(iterator, start, total, plan.accumulate):
        seen = True
        logging.set_batch("train", batch)
        state.in_window = not boundary
        if batch_start and not t.hooks.batch_start(batch, batch_idx):
            break
        steps_before = state.global_step
        output = train_batch(plan, batch, batch_idx, size, boundary)
        # A replica group that took a live peer's state in this step goes on from the peer's position (its counters
        # are the peer's already): the epoch in progress ends after this batch's hooks.
        healed = state.healed
        if not healed:
            state.batches_done = batch_idx + 1
        logging.train_batch_end(batch_idx, state.global_step, state.global_step > steps_before)
        # Validation before the batch-end hooks: a checkpoint they write then already reflects it
        # (its metrics, and the RNG draws it made), so resuming from it does not replay it.
        if boundary and val_due and not healed and _val_due_mid_epoch(t, batch_idx, total):
            run_evaluation(t, "validate", t.val_dataloaders, settings.limit_val_batches)
        if batch_end or cb_end:
            out = detached(as_outputs(output))
            if batch_end:  # the default is a no-op
                logging.sync_step_metrics()  # the user's hook may read callback_metrics (on one rank only)
                t.module.on_train_batch_end(out, batch, batch_idx)
            t.hooks.call("on_train_batch_end", out, batch, batch_idx)
        state.in_window = False
        if boundary:
            check_preemption()  # every rank, same step
        # (t.should_stop or t.max_steps_reached, read without the two property calls: this runs per step)
        if healed or (boundary and (t.should_stop or 0 <= max_steps <= state.global_step)):
            break
    del iterator
    if state.healed:
        state.healed = False
        return
    if not seen and not mid:
        raise empty_loader_error("training", t.train_dataloader, "limit_train_batches", settings.limit_train_batches,
                                 t.world_size)
    t.loss_check.flush()  # the epoch's losses, before anything is built on its end
    if _val_due_at_epoch_end(t):
        run_evaluation(t, "validate", t.val_dataloaders, settings.limit_val_batches)
    state.epoch_finished = True
    logging.sync_step_metrics()
    with logging.in_epoch_end("train"):
        t.module.on_train_epoch_end()
    logging.end_epoch("train", state.current_epoch, state.global_step)
    step_schedulers(t.module, t.lr_scheduler_configs, "epoch", state.current_epoch + 1, t.callback_metrics)
    t.hooks.call("on_train_epoch_end")
    state.current_epoch += 1
    state.batches_done = state.samples_offset = 0
    state.epoch_finished = False


def check_data(trainer: TrainerAttributes) -> None:
    """Refuse loaders with no batches before the first epoch: an empty training loader would run
    ``max_epochs`` empty epochs (and write checkpoints of an untrained model); an empty validation
    loader would leave every monitored ``val_*`` metric missing."""
    t, settings = trainer, trainer.settings
    if t.num_training_batches == 0:
        raise empty_loader_error("training", t.train_dataloader, "limit_train_batches", settings.limit_train_batches,
                                 t.world_size)
    for loader in t.val_dataloaders:
        if num_batches(loader, settings.limit_val_batches) == 0:
            raise empty_loader_error("validation", loader, "limit_val_batches", settings.limit_val_batches,
                                     t.world_size)


def run_fit(trainer: TrainerAttributes, check_preemption: Callable[[], None]) -> None:
    check_data(trainer)
    t = trainer
    t.loss_check = LossCheck(t.fabric.device, t.settings.log_every_n_steps, t.global_rank if t.world_size > 1 else None)
    state, max_epochs = t.loop_state, t.settings.max_epochs
    while not t.should_stop and not t.max_steps_reached and state.current_epoch < max_epochs:
        run_train_epoch(t, check_preemption)
    t.loss_check.flush()


def run_evaluation(
    trainer: TrainerAttributes, stage: str, loaders: list[Any], limit: int | float
) -> list[dict[str, float]]:
    """Validation or test over every loader; returns one dict of epoch metrics per loader."""
    t = trainer
    hook = "validation" if stage == "validate" else "test"
    limit_name = "limit_val_batches" if stage == "validate" else "limit_test_batches"
    t.loss_check.flush()  # a validation mid-epoch reports on weights that are finite
    logging = t.logger_connector
    logging.start_epoch(stage)
    was_training = t.module.training
    previous_stage = t.current_stage
    t.current_stage = stage
    logging.sync_step_metrics()  # pending training values: hooks below may read them, on any rank
    getattr(t.module, f"on_{hook}_model_eval")()
    t.hooks.run(f"on_{hook}_start")
    getattr(t.module, f"on_{hook}_epoch_start")()
    t.hooks.call(f"on_{hook}_epoch_start")
    step_fn = getattr(t.model, f"{hook}_step")
    takes_idx = _takes_dataloader_idx(getattr(t.module, f"{hook}_step"))
    t.data.num_eval_batches = [num_batches(loader, limit) for loader in loaders]
    with eval_grad_mode(t):
        for idx, loader in enumerate(loaders):
            logging.set_dataloader(stage, idx, len(loaders))
            n = num_batches(loader, limit)
            if n == 0:
                raise empty_loader_error(hook, loader, limit_name, limit, t.world_size)
            seen = False
            for batch_idx, batch in zip(range(n) if n is not None else count(), loader):
                seen = True
                logging.set_batch(stage, batch)
                extra = {"dataloader_idx": idx} if len(loaders) > 1 and takes_idx else {}
                t.hooks.run(f"on_{hook}_batch_start", batch, batch_idx, *([idx] if len(loaders) > 1 else []))
                output = step_fn(batch, batch_idx, **extra)
                logging.eval_batch_end(stage, t.loop_state.global_step, log=not t.sanity_checking)
                t.hooks.run(f"on_{hook}_batch_end", output, batch, batch_idx, *([idx] if len(loaders) > 1 else []))
            if not seen:
                raise empty_loader_error(hook, loader, limit_name, limit, t.world_size)
    with logging.in_epoch_end(stage), eval_grad_mode(t):
        getattr(t.module, f"on_{hook}_epoch_end")()
    state = t.loop_state
    metrics = logging.end_epoch(stage, state.current_epoch, state.global_step, log=not t.sanity_checking)
    t.hooks.call(f"on_{hook}_epoch_end")
    t.hooks.run(f"on_{hook}_end")
    t.current_stage = previous_stage
    if was_training:
        getattr(t.module, f"on_{hook}_model_train")()
    return logging.by_dataloader(stage, metrics, len(loaders))


def run_predict(trainer: TrainerAttributes, loaders: list[Any], limit: int | float) -> list[list[Any]]:
    t = trainer
    was_training = t.module.training
    t.module.on_predict_model_eval()
    t.hooks.run("on_predict_start")
    t.hooks.run("on_predict_epoch_start")
    out: list[list[Any]] = []
    takes_idx = _takes_dataloader_idx(t.module.predict_step)
    with eval_grad_mode(t):
        for idx, loader in enumerate(loaders):
            preds: list[Any] = []
            n = num_batches(loader, limit)
            for batch_idx, batch in zip(range(n) if n is not None else count(), loader):
                extra = {"dataloader_idx": idx} if len(loaders) > 1 and takes_idx else {}
                t.hooks.run("on_predict_batch_start", batch, batch_idx, *([idx] if len(loaders) > 1 else []))
                preds.append(t.model.predict_step(batch, batch_idx, **extra))
                t.hooks.run("on_predict_batch_end", preds[-1], batch, batch_idx, *([idx] if len(loaders) > 1 else []))
            out.append(preds)
    t.hooks.run("on_predict_epoch_end")
    t.hooks.run("on_predict_end")
    t.module.train(was_training)
    return out


def eval_grad_mode(trainer: TrainerAttributes) -> Any:
    """``Trainer(inference_mode=True)``: torch.inference_mode where the strategy allows it (see
    ``Strategy.supports_inference_mode``), else torch.no_grad."""
    allowed = trainer.settings.inference_mode and trainer.fabric.strategy.supports_inference_mode
    return torch.inference_mode() if allowed else torch.no_grad()
