"""Learning-rate range test (``Tuner(trainer).lr_find(...)``) that leaves no trace.

The search trains for a few steps while raising the learning rate, records the loss, and then puts
back *everything* it could have touched (:mod:`phalanx.core.module_state`): everything the module
holds (weights and gradients, buffers, torchmetrics state, plain attributes its steps change), the
fit's optimizer and scheduler state, the loss scaler, every rank's RNG state, the trainer's counters
and metrics. It never calls callbacks or loggers, and it logs into fresh metric accumulators created
on ``fabric.device`` (then drops them), so nothing it did can leak into the fit that follows. The
probe fits it runs after the sweep (:mod:`phalanx.tuner.suggest`) start from that same state and are
undone the same way, each.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from phalanx.core.module_state import preserved
from phalanx.core.optimizers import parse_optimizers
from phalanx.tuner.preconditions import refuse_without_separate_optimizers
from phalanx.tuner.suggest import (
    LONG_PROBE,
    MIN_POINTS,
    Suggestion,
    decide,
    long_probes,
    lower_rungs,
    next_rung,
    probe_ladder,
    probe_score,
    probe_steps,
    rung_below,
    suggest,
)
from phalanx.utils.diagnostics import warn
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.tensors import optional_module

if TYPE_CHECKING:
    from phalanx.core.module import Module
    from phalanx.tuner.view import TunedTrainer


_T = TypeVar("_T")


class Isolated(Protocol):
    """Runs ``work(optimizer)`` from the state the search started from and puts everything back after it
    (``optimizer``: the one to step, or None for a fresh one from ``configure_optimizers``)."""

    def __call__(self, work: Callable[[Any], _T]) -> _T: ...


@dataclass
class LRFinderResult:
    """The learning rates tried, the loss of each step (``raw_losses``) and its exponential moving
    average (``losses``, beta=0.98, which the early stop watches, as in Lightning), and the probe fits
    the search ran after it: their learning rates (``probe_lrs``), the loss of each of their steps
    (``probe_losses``), their scores (``probe_scores``, ``inf`` for one that diverged or rose) and the
    steps of each (``probe_length``; a longer one runs where :mod:`phalanx.tuner.suggest` says so)."""

    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    mode: str = "exponential"
    raw_losses: list[float] = field(default_factory=list)
    global_rank: int | None = None  # set by the search: only rank 0 warns (None: this process warns)
    probe_lrs: list[float] = field(default_factory=list)
    probe_losses: list[list[float]] = field(default_factory=list)
    probe_length: int = 0
    _suggestions: dict[tuple[int, int], Suggestion] = field(default_factory=dict, init=False, repr=False,
                                                             compare=False)

    @property
    def probe_scores(self) -> list[float]:
        """Each probe fit's score (:func:`phalanx.tuner.suggest.probe_score`): the mean loss of its last
        quarter of steps, ``inf`` where it diverged or ended above where it started."""
        return [probe_score(losses) for losses in self.probe_losses]

    @property
    def results(self) -> dict[str, list[float]]:
        """Lightning's name for the same data: ``{"lr": [...], "loss": [...]}``."""
        return {"lr": list(self.lrs), "loss": list(self.losses)}

    def suggestion(self, skip_begin: int = 0, skip_end: int = 0) -> float | None:
        """The learning rate of the probe fit whose loss ended lowest, where the search ran them (see
        :mod:`phalanx.tuner.suggest`); otherwise, and for other ``skip_begin``/``skip_end`` (points left
        out at the start and the end of the curve), the curve's: where the centred, smoothed log-loss
        falls fastest on its way down to its lowest point, at most that point's learning rate / 2.
        None, with a warning that says why and what to change, when neither the curve nor a probe shows
        a clear fall, with too few finite points, or when every probe diverged: the first time per
        result and arguments."""
        return self._suggest(skip_begin, skip_end).lr

    def _suggest(self, skip_begin: int, skip_end: int) -> Suggestion:
        key = (skip_begin, skip_end)
        if key not in self._suggestions:
            # A result built from a moving average only (what Lightning records) is judged on that.
            losses = self.raw_losses if len(self.raw_losses) == len(self.lrs) else self.losses
            found = suggest(self.lrs, losses, self.mode, skip_begin, skip_end)
            ladder = probe_ladder(found)
            if ladder and self.probe_lrs[:len(ladder)] == ladder:  # the probes ran for this curve
                found = decide(found, self.probe_lrs, self.probe_losses, self.raw_losses, self.probe_length)
            self._suggestions[key] = found
            if found.lr is None:
                warn(found.reason, rank=self.global_rank, stacklevel=3)
        return self._suggestions[key]

    def plot(self, suggest: bool = True, skip_begin: int = 0, skip_end: int = 0) -> Any:
        """A matplotlib Figure (``fig.savefig("lr.png")``): each step's loss, the curve the suggestion
        is taken from, the probe fits' scores if any ran and, with ``suggest``, the suggestion (or, in the
        title, that there is none)."""
        figure = optional_module("matplotlib.figure", "LRFinderResult.plot()", "plot")
        fig = figure.Figure(figsize=(6, 4))
        ax = fig.subplots()
        found = self._suggest(skip_begin, skip_end)
        ax.plot(self.lrs, self.raw_losses or self.losses, ".", color="0.75", markersize=3, label="loss of each step")
        ax.plot(found.lrs, found.smoothed, label="smoothed (centred)")
        probes = [(lr, score) for lr, score in zip(self.probe_lrs, self.probe_scores) if math.isfinite(score)]
        if probes:
            ax.plot(*zip(*probes), "x", color="black", markersize=8, label="probe fits (loss at their end)")
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("loss")
        if suggest and found.lr is not None:
            # The probe fits' choice is marked at its score: it need not lie on the curve.
            y = (self.probe_scores[self.probe_lrs.index(found.lr)] if found.probed
                 else found.smoothed[found.lrs.index(found.lr)])
            ax.plot([found.lr], [y], marker="o", markersize=9, color="red")
            ax.set_title(f"suggested lr = {found.lr:.3g}" + (" (probe fits)" if found.probed else ""))
        elif suggest:
            ax.set_title("no suggestion (the warning says why)")
        ax.legend()
        fig.tight_layout()
        return fig


class Tuner:
    """Hyperparameter helpers that run on a Trainer without disturbing it."""

    def __init__(self, trainer: TunedTrainer) -> None:
        self.trainer = trainer

    def scale_batch_size(
        self, model: Module, train_dataloaders: Any = None, val_dataloaders: Any = None, dataloaders: Any = None,
        datamodule: Any = None, method: str = "fit", mode: str = "power", steps_per_trial: int = 3,
        init_val: int = 2, max_trials: int = 25, batch_arg_name: str = "batch_size", margin: float = 0.05,
        max_val: int = 8192,
    ) -> int:
        """Find the largest batch size that fits (see :mod:`phalanx.tuner.batch_size`)."""
        from phalanx.tuner.batch_size import scale_batch_size

        return scale_batch_size(self.trainer, model, train_dataloaders, val_dataloaders, dataloaders, datamodule,
                                method, mode, steps_per_trial, init_val, max_trials, batch_arg_name, margin, max_val)

    def lr_find(
        self,
        model: Module,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        method: str = "fit",
        min_lr: float = 1e-8,
        max_lr: float = 1.0,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
        probe: bool = True,
    ) -> LRFinderResult:
        """Train ``num_training`` optimizer steps with the learning rate rising from ``min_lr`` to
        ``max_lr`` and record the loss (averaged over ranks, exponentially smoothed). Stops early when
        the loss exceeds ``early_stop_threshold`` times the best seen (from the 8th step, the fewest the
        suggestion needs: before that the average is a few batches' noise), or is not finite. The curve
        brackets the learning rate; with ``probe`` the search then trains four short fits from the
        initial state at constant learning rates inside the bracket (a third of a decade apart, the
        highest at most half the learning rate of the curve's lowest point; ``max(15, num_training //
        3)`` steps each), up to two more above them where the curve was still falling and the highest
        did best, or below them where the lowest did best clearly; where the curve never fell clearly and
        no probe showed a fall, four more a decade lower and then the best again for twice as many steps;
        the suggestion is the one whose loss ends lowest (:mod:`phalanx.tuner.suggest`). With
        ``update_attr=True`` sets ``model.lr``/``model.learning_rate`` (or ``attr_name``) to the suggestion
        and, inside a fit, rebuilds the optimizer from ``configure_optimizers``; when the curve gives none, a
        warning says why and what to change, and the attribute stays."""
        if method != "fit":
            raise MisconfigurationError(f"lr_find(method={method!r}): the LR range test trains; use method='fit'.")
        if dataloaders is not None:
            raise MisconfigurationError("lr_find(dataloaders=...) is for evaluation methods; pass train_dataloaders=.")
        # val_dataloaders are accepted for Lightning's signature; the range test does not validate.
        del val_dataloaders
        if mode not in ("exponential", "linear"):
            raise MisconfigurationError(f"lr_find mode={mode!r}; use 'exponential' or 'linear'.")
        if not 0 < min_lr < max_lr:
            raise MisconfigurationError(f"lr_find needs 0 < min_lr < max_lr, got min_lr={min_lr}, max_lr={max_lr}.")
        if num_training < 2:
            raise MisconfigurationError(f"lr_find needs num_training >= 2, got {num_training}.")
        t = self.trainer
        if update_attr:
            attr_name = lr_attribute(model, attr_name)
        inside_fit = t.stage == "fit" and t.model is not None and t.module is model
        separate = t.fabric.strategy.sets_up_optimizers_separately
        if inside_fit:
            refuse_without_separate_optimizers(t, "lr_find", "inside a fit (the LearningRateFinder callback)")
            result = self._search(min_lr, max_lr, num_training, mode, early_stop_threshold, probe)
        elif not separate:
            if t.model is not None:
                refuse_without_separate_optimizers(t, "lr_find", "after this Trainer set the model up")
            result = t.run_stage("lr_find", model, datamodule, self._on_scratch_copy, train_dataloaders, min_lr, max_lr,
                            num_training, mode, early_stop_threshold, probe)
        else:
            result = t.run_stage("lr_find", model, datamodule, self._standalone, train_dataloaders, min_lr, max_lr,
                            num_training, mode, early_stop_threshold, probe)
        if update_attr:
            lr = result.suggestion()
            if lr is None:
                t.print(f"[phalanx] lr_find: no suggestion (see the warning); {attr_name} stays "
                        f"{getattr(model, attr_name)}.")
            else:
                setattr(model, attr_name, lr)
                if inside_fit:
                    t.setup_optimizers()
        return result

    def _standalone(self, train_dataloaders: Any, *args: Any) -> LRFinderResult:
        self.trainer.prepare_fit(train_dataloaders, None)
        return self._search(*args)

    def _on_scratch_copy(
        self, train_dataloaders: Any, min_lr: float, max_lr: float, num_training: int, mode: str,
        threshold: float | None, probe: bool,
    ) -> LRFinderResult:
        """The search where the optimizer is built with its model, once (DeepSpeed's engine): on a copy of
        the module with an engine of its own, released afterwards, and each probe fit on a fresh copy (an
        engine's optimizer holds state a restore does not reach: ZeRO's fp32 master weights, which its
        next step would write back into the module). The module itself is never set up or touched, so the
        fit that follows builds its engine from ``configure_optimizers`` as usual (with the learning rate
        found). Costs a second copy of the model while the search runs."""

        def on_copy(work: Callable[[Any], _T]) -> _T:
            return self._on_copy(train_dataloaders, work)

        return self._search(min_lr, max_lr, num_training, mode, threshold, probe, on_copy)

    def _on_copy(self, train_dataloaders: Any, work: Callable[[Any], _T]) -> _T:
        """``work(optimizer)`` on a fresh copy of the module, set up with its optimizer, then released."""
        t = self.trainer
        scratch = copy.deepcopy(t.module, memo={id(t): t, id(t.fabric): t.fabric})
        with t.using_module(scratch), preserved(t):
            t.prepare_fit(train_dataloaders, None)
            return work(t.optimizers[0])

    def _in_place(self, work: Callable[[Any], _T]) -> _T:
        """``work(None)`` (a fresh optimizer of its own) on the module, put back exactly afterwards."""
        with preserved(self.trainer):
            return work(None)

    def _search(
        self, min_lr: float, max_lr: float, num_training: int, mode: str, threshold: float | None, probe: bool,
        isolated: Isolated | None = None,
    ) -> LRFinderResult:
        """The sweep, then the probe fits if its curve asks for them; ``isolated`` runs each of them from
        the state the search started from, leaving no trace (``_in_place`` unless given)."""
        isolated = isolated or self._in_place
        result = isolated(functools.partial(self._run_search, min_lr, max_lr, num_training, mode, threshold))
        if probe:
            self._run_probes(result, num_training, isolated)
        return result

    def _run_probes(self, result: LRFinderResult, num_training: int, isolated: Isolated) -> None:
        """A short fit at each learning rate of the curve's probe ladder (none where no probe can help),
        then above it while :func:`~phalanx.tuner.suggest.next_rung` asks for one more, a decade below it
        where :func:`~phalanx.tuner.suggest.lower_rungs` asks, below it while
        :func:`~phalanx.tuner.suggest.rung_below` asks for one more, and two again, longer, where
        :func:`~phalanx.tuner.suggest.long_probes` asks for them."""
        steps = probe_steps(num_training)
        found = suggest(result.lrs, result.raw_losses, result.mode)
        result.probe_length = steps

        def run(lr: float, length: int = steps) -> None:
            result.probe_lrs.append(lr)
            result.probe_losses.append(isolated(functools.partial(self._probe, lr, length)))

        for lr in probe_ladder(found):
            run(lr)
        while (rung := next_rung(found, result.probe_lrs, result.probe_scores)) is not None:
            run(rung)
        for lr in lower_rungs(found, result.probe_lrs, result.probe_losses, result.raw_losses, steps):
            run(lr)
        while (below := rung_below(found, result.probe_lrs, result.probe_losses, result.raw_losses, steps)) is not None:
            run(below)
        for again in long_probes(found, result.probe_lrs, result.probe_losses, result.raw_losses, steps):
            run(again, LONG_PROBE * steps)

    def _probe(self, lr: float, steps: int, optimizer: Any) -> list[float]:
        """The losses of ``steps`` optimizer steps at ``lr``, up to the first that is not finite."""
        losses: list[float] = []
        for loss in self._steps(self._prepare(optimizer), functools.partial(constant, lr), steps):
            losses.append(loss)
            if not math.isfinite(loss):
                break
        return losses

    def _prepare(self, optimizer: Any) -> Any:
        """The optimizer to step (a fresh one from configure_optimizers when None; its schedulers are
        ignored: the search drives the learning rate), with fresh metric accumulators."""
        t = self.trainer
        if optimizer is None:
            raw, _ = parse_optimizers(t.module.configure_optimizers())
            optimizer = t.fabric.setup_optimizers(raw)
        t.logger_connector.reset_results()
        t.current_stage = "train"
        t.module.train()
        return optimizer

    def _run_search(
        self, min_lr: float, max_lr: float, num_training: int, mode: str, threshold: float | None,
        optimizer: Any = None,
    ) -> LRFinderResult:
        t = self.trainer
        result = LRFinderResult(mode=mode, global_rank=t.global_rank)

        def lr_at(step: int) -> float:
            frac = step / (num_training - 1)
            return min_lr * (max_lr / min_lr) ** frac if mode == "exponential" else min_lr + (max_lr - min_lr) * frac

        smoothed, best, beta = 0.0, math.inf, 0.98
        for step, loss in enumerate(self._steps(self._prepare(optimizer), lr_at, num_training)):
            smoothed = beta * smoothed + (1 - beta) * loss if math.isfinite(loss) else loss
            value = smoothed / (1 - beta ** (step + 1)) if math.isfinite(loss) else loss
            result.lrs.append(lr_at(step))
            result.losses.append(value)
            result.raw_losses.append(loss)
            if not math.isfinite(value):
                break
            # Over its first steps the moving average is a batch or a few: where batch losses vary by more than
            # the threshold (small batches of a heavy-tailed loss) it crosses threshold x its lowest on noise
            # alone, and a stop before the rule has its MIN_POINTS losses can only end in a refusal.
            if step + 1 < MIN_POINTS:
                continue
            if threshold is not None and value > threshold * best:
                break
            best = min(best, value)
        return result

    def _steps(self, optimizer: Any, lr_at: Callable[[int], float], num_steps: int) -> Iterator[float]:
        """Up to ``num_steps`` optimizer steps, the n-th at learning rate ``lr_at(n)``, from epoch 0 of the
        training data: yields each step's loss, the mean over its micro-batches and over ranks (every rank
        gets the same value, so every rank stops at the same step)."""
        t = self.trainer
        epoch, step = 0, 0
        while step < num_steps:
            if t.train_sampler is not None:
                t.train_sampler.skip = 0
            window_losses: list[torch.Tensor] = []
            progressed = False
            for batch_idx, batch, size, boundary in t.training_windows(epoch):
                progressed = True
                if not window_losses:
                    for group in optimizer.param_groups:
                        group["lr"] = lr_at(step)
                t.logger_connector.set_batch("train", batch)
                _, loss = t.training_micro_batch(batch, batch_idx, size, boundary)
                window_losses.append(loss.detach().reshape(()).float())
                if not boundary:
                    continue
                t.optimizer_step_without_callbacks(optimizer)
                mean = float(t.fabric.all_reduce(torch.stack(window_losses).mean(), reduce_op="mean"))
                window_losses = []
                step += 1
                yield mean
                if step >= num_steps:
                    return
            if not progressed:
                raise MisconfigurationError("lr_find: the training dataloader yielded no batches.")
            epoch += 1


def constant(lr: float, step: int) -> float:
    """A probe fit's learning rate at every step."""
    return lr


def lr_attribute(model: Any, attr_name: str) -> str:
    """The model attribute that holds the learning rate: ``attr_name``, else ``lr`` or ``learning_rate``."""
    if attr_name:
        if not hasattr(model, attr_name):
            raise MisconfigurationError(f"lr_find(attr_name={attr_name!r}): the model has no such attribute.")
        return attr_name
    for name in ("lr", "learning_rate"):
        if hasattr(model, name):
            return name
    raise MisconfigurationError(
        f"lr_find(update_attr=True) sets model.lr or model.learning_rate, but {type(model).__name__} has neither. "
        "Add one (and use it in configure_optimizers), or pass attr_name=."
    )
