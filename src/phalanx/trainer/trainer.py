"""``phalanx.Trainer``: the managed loop, built only on ``phalanx.Fabric``'s public API.

Everything backend-specific (DDP, FSDP, DeepSpeed, precision) is Fabric's business; this file
never asks which strategy it runs on. It holds the Trainer's constructor, its entry points
(``fit``/``validate``/``test``/``predict``/``save_checkpoint``) and how a stage runs (launch, attach the
model, the hooks around it); what a Trainer holds and Lightning's public attributes over it are
:class:`phalanx.trainer.attributes.TrainerAttributes`, the loops are :mod:`phalanx.trainer.loops`.

When processes start (as in Lightning): constructing a Trainer starts nothing. Under torchrun or
``phalanx run`` the ranks are known from the environment right away (``trainer.global_rank``); the
process group is joined at the first ``fit``/``validate``/``test``/``predict``/tuner call. Under plain
``python train.py`` with ``devices=N``, that first call re-runs the script in N processes and the
original process only supervises them (it exits with the job's code when they finish).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.checkpoint.snapshot import Cadence
from phalanx.core.datamodule import DataModule
from phalanx.core.module import Module, overrides
from phalanx.distributed.replica_groups import group_folder
from phalanx.fabric.fabric import Fabric
from phalanx.precision import Precision
from phalanx.profilers import resolve_profiler
from phalanx.trainer import loops
from phalanx.trainer.attributes import TrainerAttributes
from phalanx.trainer.checkpoint_connector import CheckpointConnector
from phalanx.trainer.defaults import make_callbacks, make_loggers, ordered
from phalanx.trainer.settings import (
    TrainerArguments,
    check_manual_optimization,
    check_weights_only,
    deterministic,
    refuse_batch_transfer_hooks,
    resolve_settings,
    split_datamodule,
)
from phalanx.utils import diagnostics
from phalanx.utils.errors import MisconfigurationError, note_step
from phalanx.utils.seed import RngCapture, capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    from phalanx.tuner.view import TunedTrainer


class Trainer(TrainerAttributes):
    """Runs a :class:`phalanx.Module`'s steps on any strategy, with logging, checkpoints and callbacks.

    The arguments are Lightning's, with its defaults and meaning (docs/trainer.md; deliberate
    differences are listed in docs/porting.md). Every one is implemented or refused with a reason.
    Once resolved they are ``trainer.settings`` (frozen; ``trainer.max_epochs`` etc. read it), and the
    loop's counters are ``trainer.loop_state`` (``trainer.global_step`` etc. read it).

    Args:
        accelerator, strategy, devices, num_nodes, precision: passed to :class:`phalanx.Fabric`.
        logger: None/True (a CSVLogger under default_root_dir), False, a logger or a list of loggers.
        callbacks: objects whose hook methods (``on_train_epoch_end(trainer, module)``, ...) are called.
        fast_dev_run: run N (True: 1) batches of each loop once, without loggers or checkpoints.
        max_epochs / min_epochs / max_steps / min_steps / max_time: when training stops; a stop request
            (early stopping) is deferred until the minimums are met.
        limit_{train,val,test,predict}_batches / overfit_batches: int (batches) or float (fraction).
        val_check_interval: validate every this many training batches (int) or fraction of an epoch (float).
        check_val_every_n_epoch: validate at the end of every n-th epoch (None: only val_check_interval).
        num_sanity_val_steps: validation batches run before training to catch bugs early (-1: all).
            Their metrics are discarded and every RNG is put back, so the fit is the same with or without.
        deterministic: ``torch.use_deterministic_algorithms(True)`` (``"warn"``: warn only) and
            ``cudnn.benchmark = False`` while fit/validate/test/predict (or the tuner) runs; the previous
            settings are restored when it returns, so code after it, or another Trainer, is unaffected.
        log_every_n_steps: how often step-level metrics go to the loggers.
        enable_checkpointing / enable_progress_bar / enable_model_summary: add the default callbacks.
        accumulate_grad_batches, gradient_clip_val, gradient_clip_algorithm ("norm" or "value").
        benchmark: ``torch.backends.cudnn.benchmark`` (None: leave it, False when deterministic).
        inference_mode: evaluate under ``torch.inference_mode`` (else ``torch.no_grad``).
        use_distributed_sampler: let phalanx shard the data across ranks (see phalanx.trainer.loaders).
        profiler: "simple", "advanced", "pytorch" or a :class:`phalanx.profilers.Profiler`.
        barebones: turn off everything that costs time outside the steps (refuses arguments that need it).
        plugins: refused (see :func:`phalanx.trainer.settings.refuse_plugins` for each equivalent).
        sync_batchnorm: convert BatchNorm layers to SyncBatchNorm before setup.
        reload_dataloaders_every_n_epochs: call the ``*_dataloader()`` methods again every n epochs.
        default_root_dir: where logs and checkpoints go (default: the working directory); with replica groups
            (``fault_tolerance=``, ``phalanx run --replica-groups``) each group's go to its own
            ``<default_root_dir>/replica_group_<i>``.
        enable_autolog_hparams: send ``module.hparams`` to the loggers when fit starts.
        model_registry: refused (phalanx uploads nothing).
        max_restarts: with ``devices>1`` under plain ``python``, restart the job's processes up to this many
            times after one fails; a restarted attempt resumes from the newest checkpoint or snapshot
            (:class:`phalanx.trainer.checkpoint_connector.CheckpointConnector`). A preemption signal
            (SIGTERM/SIGUSR1) always ends the fit with a checkpoint at the next optimizer step.
        fault_tolerance: run as one of several fault-tolerant replica groups, as ``Fabric(fault_tolerance=...)``
            (docs/faults.md).
        detect_anomaly: check every backward's loss and gradients for nan/inf and stop naming the parameter
            (``Fabric(detect_anomaly=True)``, see :mod:`phalanx.fabric.anomaly` for the cost). Without it, a
            non-finite training loss still stops the run before the optimizer step (see
            :mod:`phalanx.trainer.loops`).
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: Any = "auto",
        devices: int | str = "auto",
        num_nodes: int = 1,
        precision: str | int | Precision | None = None,
        logger: Any = None,
        callbacks: Any = None,
        fast_dev_run: int | bool = False,
        max_epochs: int | None = None,
        min_epochs: int | None = None,
        max_steps: int = -1,
        min_steps: int | None = None,
        max_time: Any = None,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        overfit_batches: int | float = 0.0,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int | None = None,
        log_every_n_steps: int | None = None,
        enable_checkpointing: bool | None = None,
        enable_progress_bar: bool | None = None,
        enable_model_summary: bool | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
        deterministic: bool | str | None = None,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        use_distributed_sampler: bool = True,
        profiler: Any = None,
        detect_anomaly: bool = False,
        barebones: bool = False,
        plugins: Any = None,
        sync_batchnorm: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
        default_root_dir: str | Path | None = None,
        enable_autolog_hparams: bool = True,
        model_registry: str | None = None,
        max_restarts: int = 0,
        fault_tolerance: Any = None,
    ) -> None:
        settings = resolve_settings(TrainerArguments(
            logger=logger, fast_dev_run=fast_dev_run, max_epochs=max_epochs, min_epochs=min_epochs,
            max_steps=max_steps, min_steps=min_steps, limit_train_batches=limit_train_batches,
            limit_val_batches=limit_val_batches, limit_test_batches=limit_test_batches,
            limit_predict_batches=limit_predict_batches, overfit_batches=overfit_batches,
            val_check_interval=val_check_interval, check_val_every_n_epoch=check_val_every_n_epoch,
            num_sanity_val_steps=num_sanity_val_steps, log_every_n_steps=log_every_n_steps,
            enable_checkpointing=enable_checkpointing, enable_progress_bar=enable_progress_bar,
            enable_model_summary=enable_model_summary, accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm,
            deterministic=deterministic, benchmark=benchmark, inference_mode=inference_mode,
            use_distributed_sampler=use_distributed_sampler, profiler=profiler, detect_anomaly=detect_anomaly,
            barebones=barebones, plugins=plugins, sync_batchnorm=sync_batchnorm,
            reload_dataloaders_every_n_epochs=reload_dataloaders_every_n_epochs, default_root_dir=default_root_dir,
            enable_autolog_hparams=enable_autolog_hparams, model_registry=model_registry,
        ))
        settings = dataclasses.replace(settings, default_root_dir=group_folder(settings.default_root_dir,
                                                                               fault_tolerance))
        fabric = Fabric(
            accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy,
            precision=precision,
            loggers=make_loggers(settings.logger, settings.default_root_dir), detect_anomaly=detect_anomaly,
            # The Trainer checks every window's losses itself and stops on a non-finite one (stepping.py).
            warn_nonfinite_loss=False, max_restarts=max_restarts, root_dir=settings.default_root_dir,
            fault_tolerance=fault_tolerance,
        )
        if settings.fast_dev_run:
            diagnostics.info(f"Running in fast_dev_run mode: each loop runs {settings.fast_dev_run} batch(es); "
                             "logging and checkpointing are off.", rank=fabric.global_rank)
        super().__init__(settings, fabric, make_callbacks(callbacks, settings, max_time), resolve_profiler(profiler))
        self.checkpoint_connector = CheckpointConnector(self)
        self._snapshot_rng = RngCapture()  # per-step snapshots reuse NumPy's state while it is untouched

    # ------------------------------------------------------------------ public entry points
    def fit(
        self,
        model: Module,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | Path | None = None,
        weights_only: bool | None = None,
    ) -> None:
        """Train ``model``; with ``ckpt_path`` (a path, "last" or "best") resume exactly where it stopped.

        Data: ``train_dataloaders``/``val_dataloaders``, or a ``datamodule`` (also accepted in the
        place of ``train_dataloaders``), or the module's own ``train_dataloader()``/``val_dataloader()``."""
        check_weights_only(weights_only)
        if isinstance(train_dataloaders, DataModule):
            if datamodule is not None:
                raise MisconfigurationError("trainer.fit() got two datamodules (train_dataloaders= and datamodule=).")
            datamodule, train_dataloaders = train_dataloaders, None
        if datamodule is not None and (train_dataloaders is not None or val_dataloaders is not None):
            raise MisconfigurationError(
                "trainer.fit() got both dataloaders and a datamodule; pass one source of data."
            )
        self.run_stage("fit", model, datamodule, self._fit, train_dataloaders, val_dataloaders, ckpt_path)

    def _fit(self, train_dataloaders: Any, val_dataloaders: Any, ckpt_path: Any) -> None:
        self.loop_state.stop_requested = False
        check_manual_optimization(self.module, self.fabric.strategy, self.settings)
        self.prepare_fit(train_dataloaders, val_dataloaders)
        path = self.checkpoint_connector.starting_point(ckpt_path)
        self.ckpt_path = str(path) if path is not None else None
        if path is not None:
            self.checkpoint_connector.restore(path)
        self.checkpoint_connector.started_from(path)
        self.checkpoint_connector.announce_resume(path)
        self.checkpoint_connector.share_with_replica_groups()
        module = self.lightning_module
        if self.enable_autolog_hparams and self.is_global_zero and module.hparams_to_loggers:
            hparams = dict(module.hparams)
            if self.datamodule is not None and self.datamodule.hparams_to_loggers:
                hparams.update(self.datamodule.hparams)
            if hparams:
                self.fabric.log_hyperparams(hparams)
        self.hooks.call("on_fit_start")
        module.on_fit_start()
        self._sanity_check()
        self.current_stage = "train"
        self.hooks.run("on_train_start")
        # Starts listening; a signal during set-up stops before the first step.
        self.checkpoint_connector.check_preemption()
        try:
            loops.run_fit(self, self.checkpoint_connector.check_preemption)
        finally:
            self.fabric.release_signals()  # after fit, SIGTERM ends the process again
        self.current_stage = "train"
        self.hooks.run("on_train_end")
        self.current_stage = None
        self.hooks.call("on_fit_end")
        module.on_fit_end()
        for cb in self.checkpoint_callbacks:  # loggers that upload checkpoints at the end (log_model=True)
            self.hooks.after_save_checkpoint(cb)
        self.checkpoint_connector.fit_done()

    def prepare_fit(self, train_dataloaders: Any = None, val_dataloaders: Any = None) -> None:
        """Loaders, model and optimizer for fitting (also used by the Tuner before a fit)."""
        self.data.set_fit_sources(train_dataloaders, val_dataloaders)
        self.data.prepare_train(self.module)
        self.logger_connector.reset_results()
        self.setup_optimizers()

    def _sanity_check(self) -> None:
        """Run a few validation batches before training, then put everything back: their metrics are
        dropped, nothing is logged, and every RNG state is restored, so the fit that follows is the
        same as without the check."""
        n = self.num_sanity_val_steps
        if not n or not self.val_dataloaders or self.limit_val_batches == 0:
            return
        rng = capture_rng_state()
        with self.logger_connector.discarded("validate"):
            self.sanity_checking = True
            try:
                self.hooks.call("on_sanity_check_start")
                limited = max(self.num_val_batches)  # what limit_val_batches allows, per Lightning's min(...)
                limit = self.limit_val_batches if math.isinf(n) else int(min(n, limited))
                self.run_evaluation("validate", self.val_dataloaders, limit)
                self.hooks.call("on_sanity_check_end")
            finally:
                self.sanity_checking = False
        restore_rng_state(rng)

    def validate(
        self, model: Module | None = None, dataloaders: Any = None, ckpt_path: str | Path | None = None,
        verbose: bool = True, datamodule: DataModule | None = None, weights_only: bool | None = None,
    ) -> list[dict[str, float]]:
        """Run ``validation_step`` over the data; returns one dict of epoch metrics per dataloader."""
        check_weights_only(weights_only)
        dataloaders, datamodule = split_datamodule(dataloaders, datamodule)
        return self.run_stage(  # type: ignore[no-any-return]
            "validate", model, datamodule, self._evaluate, "validate", dataloaders, ckpt_path, verbose)

    def test(
        self, model: Module | None = None, dataloaders: Any = None, ckpt_path: str | Path | None = None,
        verbose: bool = True, datamodule: DataModule | None = None, weights_only: bool | None = None,
    ) -> list[dict[str, float]]:
        """Run ``test_step`` over the data; returns one dict of epoch metrics per dataloader."""
        check_weights_only(weights_only)
        dataloaders, datamodule = split_datamodule(dataloaders, datamodule)
        return self.run_stage(  # type: ignore[no-any-return]
            "test", model, datamodule, self._evaluate, "test", dataloaders, ckpt_path, verbose)

    def _evaluate(self, stage: str, dataloaders: Any, ckpt_path: Any, verbose: bool) -> list[dict[str, float]]:
        getter = "val_dataloader" if stage == "validate" else "test_dataloader"
        loaders = self.data.eval_loaders(dataloaders, getter, self.module)
        if not loaders:
            raise MisconfigurationError(
                f"trainer.{stage}() needs data: pass dataloaders= or datamodule=, or implement the module's {getter}()."
            )
        if stage == "test":
            self.data.test_dataloaders = loaders
        else:
            self.data.val_dataloaders = loaders
        self.model_connector.setup()
        path = self._resolve_ckpt_path(ckpt_path)
        if path is not None:
            self.checkpoint_connector.load_weights(path)
        limit = self.limit_val_batches if stage == "validate" else self.limit_test_batches
        out = self.run_evaluation(stage, loaders, limit)
        if verbose:
            for i, metrics in enumerate(out):
                shown = ", ".join(f"{k}={v:.6g}" for k, v in sorted(metrics.items()))
                self.print(f"[{stage}{f' dataloader {i}' if len(out) > 1 else ''}] {shown}")
        return out

    def predict(
        self, model: Module | None = None, dataloaders: Any = None, datamodule: DataModule | None = None,
        return_predictions: bool | None = None, ckpt_path: str | Path | None = None, weights_only: bool | None = None,
    ) -> Any:
        """``predict_step`` outputs of THIS rank's share of the data (a list per dataloader when there
        are several; None with ``return_predictions=False``). Gather them with
        ``trainer.fabric.all_gather`` if every rank needs all of them."""
        check_weights_only(weights_only)
        dataloaders, datamodule = split_datamodule(dataloaders, datamodule)
        out = self.run_stage("predict", model, datamodule, self._predict, dataloaders, ckpt_path)
        return None if return_predictions is False else out

    def _predict(self, dataloaders: Any, ckpt_path: Any) -> list[Any]:
        loaders = self.data.eval_loaders(dataloaders, "predict_dataloader", self.module)
        if not loaders:
            raise MisconfigurationError(
                "trainer.predict() needs data: pass dataloaders= or datamodule=, or implement the module's "
                "predict_dataloader()."
            )
        self.data.predict_dataloaders = loaders
        self.model_connector.setup()
        path = self._resolve_ckpt_path(ckpt_path)
        if path is not None:
            self.checkpoint_connector.load_weights(path)
        self.current_stage = "predict"
        out = self.run_predict(loaders, self.limit_predict_batches)
        return out[0] if len(out) == 1 else out

    def save_checkpoint(
        self, filepath: str | Path, weights_only: bool | None = None, storage_options: Any = None
    ) -> None:
        """Save everything needed to resume (call on every rank; rank 0 writes atomically)."""
        if storage_options is not None:
            raise MisconfigurationError(
                "save_checkpoint(storage_options=...) is not supported: checkpoints are written by the strategy "
                "(atomically, to a local or mounted path). Remove storage_options."
            )
        self.checkpoint_connector.save(filepath, bool(weights_only))

    def save_snapshot(self, dirpath: str | Path, keep: int = 2, overlap: bool = True,
                      every_n_steps: int | str | Cadence = 1, max_overhead: float = 0.05) -> Path | None:
        """Snapshot everything needed to resume into ``dirpath`` (node-local shared memory) when one is due (call
        on every rank at every optimizer step; ``every_n_steps``, ``max_overhead``, ``overlap``: see
        ``fabric.save_snapshot``): what ``callbacks.Snapshot`` calls. Returns the snapshot's reference, which
        ``fit(ckpt_path=...)`` accepts, or None when none was written at this step."""
        folder = dirpath if isinstance(dirpath, Path) else Path(dirpath)
        return self.checkpoint_connector.snapshot(folder, keep, overlap, every_n_steps, max_overhead,
                                                  self._snapshot_rng)

    # ------------------------------------------------------------------ loop pieces (what the tuners run)
    def training_windows(self, epoch: int) -> Iterator[tuple[int, Any, int, bool]]:
        """Epoch ``epoch`` of the training data from its first batch, as the fit reads it (sampler epoch, device
        moves, accumulation windows): ``(batch_idx, batch, window size, whether the window's step follows)``."""
        batches = loops.start_epoch(self.fabric, self.train_dataloader, epoch)
        return loops.windows(batches, 0, self.num_training_batches, self.accumulate_grad_batches)

    def training_micro_batch(self, batch: Any, batch_idx: int, window_size: int, boundary: bool) -> tuple[Any, Any]:
        """Forward and backward of one training micro-batch through the set-up model (gradient sync skipped
        inside a window), with the Module's own backward hooks and no callback's; returns ``training_step``'s
        output and its loss."""
        return loops.micro_batch(self, batch, batch_idx, window_size, boundary)

    def optimizer_step_without_callbacks(self, optimizer: Any) -> None:
        """One real optimizer step without callbacks or counting: the Module's own ``on_before_optimizer_step``
        and ``configure_gradient_clipping`` (the Trainer's clipping settings), ``step``, ``zero_grad``."""
        loops.optimizer_step(self, optimizer)

    def run_evaluation(self, stage: str, loaders: list[Any], limit: int | float) -> list[dict[str, float]]:
        """The ``stage`` loop ("validate" or "test") over ``loaders`` (at most ``limit`` batches of each), with
        its hooks; returns each loader's epoch metrics."""
        return loops.run_evaluation(self, stage, loaders, limit)

    def run_predict(self, loaders: list[Any], limit: int | float) -> list[list[Any]]:
        """The predict loop over ``loaders`` (at most ``limit`` batches of each), with its hooks."""
        return loops.run_predict(self, loaders, limit)

    def _resolve_ckpt_path(self, ckpt_path: str | Path | None) -> Path | None:
        return self.checkpoint_connector.resolve(ckpt_path)

    # ------------------------------------------------------------------ running a stage
    def _attach(self, model: Module | None, datamodule: DataModule | None, stage: str) -> Module:
        if model is None:
            if self.model_connector.module is None:
                raise MisconfigurationError(f"trainer.{stage}() needs a model: pass one (no earlier fit set one).")
            model = self.model_connector.module
        if not isinstance(model, Module):
            raise MisconfigurationError(
                f"The Trainer runs phalanx.Module subclasses (LightningModule); got {type(model).__name__}. Subclass "
                "phalanx.LightningModule (or write the loop yourself with phalanx.Fabric)."
            )
        self.model_connector.attach(model)
        if datamodule is not None:
            if not isinstance(datamodule, DataModule) and not hasattr(datamodule, "train_dataloader"):
                raise MisconfigurationError(
                    f"datamodule must be a phalanx.DataModule, got {type(datamodule).__name__}."
                )
            self.data.datamodule = datamodule
            datamodule.trainer = self
        owners: list[Any] = [self.datamodule] if self.datamodule is not None else []
        owners.append(model)
        for owner in owners:
            if overrides(owner, "prepare_data"):
                per_node = getattr(owner, "prepare_data_per_node", True)
                with self.fabric.rank_zero_first(local=per_node):
                    if (self.local_rank if per_node else self.global_rank) == 0:
                        owner.prepare_data()
        if self.datamodule is not None:
            self.datamodule.setup(stage)
        return model

    def _launch(self) -> None:
        """Start or join the processes (see the module docstring), then put per-process state on the
        device this rank got."""
        if not self.fabric.launched:
            self.fabric.launch()
            self.logger_connector.reset_results()

    def run_stage(self, stage: str, model: Module | None, datamodule: DataModule | None, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` as stage ``stage`` of this Trainer, as fit/validate/test/predict do: start or join
        the processes, attach ``model`` (None: the one attached before) and ``datamodule``, and call the setup
        and teardown hooks of the callbacks, the module and the datamodule around it (the loggers' runs end with
        it). The tuner runs its searches through it (``stage="lr_find"``). Returns what ``fn`` returns."""
        if self.stage is not None:
            raise MisconfigurationError(f"trainer.{stage}() was called while trainer.{self.stage}() is running.")
        self._launch()
        module = self._attach(model, datamodule, stage)
        refuse_batch_transfer_hooks(module, self.datamodule)
        self.stage = stage
        self.interrupted = False
        self._add_module_callbacks(module)
        self.accumulation = self._accumulation_schedule()
        self.profiler.setup(stage, self.global_rank, None)
        if stage == "fit":  # before anything of the fit is written
            self.checkpoint_connector.claim_folder()
        try:
            with deterministic(self.settings.deterministic, self.settings.benchmark):
                self.hooks.call("setup", stage)
                module.setup(stage)
                if overrides(module, "configure_model"):
                    with self.fabric.init_module():
                        module.configure_model()
                return fn(*args)
        except BaseException as exc:
            self.interrupted = True
            if isinstance(exc, Exception):
                note_step(exc, self.global_step)  # a launcher compares it with the next attempt's failure
            self.hooks.call("on_exception", exc)
            if self.datamodule is not None:
                self.datamodule.on_exception(exc)
            raise
        finally:
            self.hooks.call("teardown", stage)
            module.teardown(stage)
            if self.datamodule is not None:
                self.datamodule.teardown(stage)
            self.fabric.finalize_loggers("failed" if self.interrupted else "success")  # as in Lightning, per stage
            self.profiler.describe()
            self.profiler.teardown(stage)
            # After the fit's last write. A preempted fit ended as it should: its rerun is a new run.
            self.checkpoint_connector.release_folder(failed=self.interrupted and self.fabric.preemption is None)
            self.stage = None
            self.current_stage = None

    def _add_module_callbacks(self, module: Module) -> None:
        """``configure_callbacks()``: the module's callbacks replace the Trainer's of the same type."""
        extra = module.configure_callbacks()
        extra = list(extra) if isinstance(extra, (list, tuple)) else ([] if extra is None else [extra])
        if not extra:
            return
        types = {type(c) for c in extra}
        kept = [c for c in self.callbacks if type(c) not in types]
        self.callbacks = ordered(kept + extra)


if TYPE_CHECKING:
    def _tuned(trainer: Trainer) -> TunedTrainer:
        """Where mypy checks that the Trainer has every member the tuners use (``TunedTrainer``)."""
        return trainer
