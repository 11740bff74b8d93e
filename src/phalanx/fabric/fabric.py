"""``phalanx.Fabric``: keep your own training loop; phalanx handles devices, processes, precision,
gradient sync, collectives and checkpoints.

This class is deliberately thin. It never asks which backend it runs on: everything that differs
between single-device, DDP, FSDP and DeepSpeed is a method of the strategy object. Its public surface is
declared here, once; the work is done by the parts it owns: :class:`~phalanx.fabric.models.Models` (what
was set up), :class:`~phalanx.fabric.backward.Backward`, :class:`~phalanx.fabric.collectives.Collectives`,
:class:`~phalanx.fabric.persistence.Persistence` (save, load, resume),
:class:`~phalanx.fabric.preemption.Preemption` and :class:`~phalanx.fabric.snapshots.Snapshots`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from phalanx.distributed import launch as launcher
from phalanx.distributed import restarts
from phalanx.distributed.launch import restart_count
from phalanx.distributed.preemption import PreemptionSignals, Stop
from phalanx.distributed.replica_groups import FaultTolerance
from phalanx.fabric.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator, accelerator_name
from phalanx.fabric.anomaly import LOSS_WATCH_VARIABLE, AnomalyDetector, LossWatch
from phalanx.fabric.backward import Backward
from phalanx.fabric.collectives import Collectives
from phalanx.fabric.config import FabricConfig, as_tuple
from phalanx.fabric.connector import configured_strategy, refuse_plugins
from phalanx.fabric.data import setup_dataloader
from phalanx.fabric.job import Job
from phalanx.fabric.logging import Logging
from phalanx.fabric.models import Models
from phalanx.fabric.persistence import Persistence
from phalanx.fabric.preemption import Preemption
from phalanx.fabric.snapshots import Snapshots
from phalanx.fabric.wrappers import FabricModule, FabricOptimizer
from phalanx.loggers import Logger
from phalanx.precision import Precision
from phalanx.strategies import Strategy
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.init import skipping_init
from phalanx.utils.seed import seed_everything as _seed_everything
from phalanx.utils.tensors import move_to_device

if TYPE_CHECKING:
    from phalanx.checkpoint import AsyncCheckpoint
    from phalanx.checkpoint.snapshot import Cadence


class Fabric:
    """Scale a hand-written PyTorch loop from one CPU to many devices without changing it.

    Args:
        accelerator: ``"auto"``, ``"cpu"`` or ``"cuda"`` (``"gpu"`` is an alias), or a ``CPUAccelerator()`` /
            ``CUDAAccelerator()`` object (:mod:`phalanx.accelerators`).
        devices: processes per node (``"auto"``: every GPU, or 1 on CPU).
        num_nodes: number of machines.
        strategy: ``"auto"``, ``"single"``, ``"ddp"``, ``"fsdp"``, ``"deepspeed"`` or a Strategy instance.
        precision: a name of ``phalanx.precision.PRECISIONS`` (``"32-true"``, ``"64-true"``, ``"bf16-mixed"``,
            ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``, ...) or a :class:`phalanx.precision.Precision` instance
            (one built with options, or a subclass), which the strategy uses as given.
        loggers: a logger or a list of loggers (``phalanx.loggers.Logger`` subclasses, e.g. ``CSVLogger``).
        callbacks: objects whose methods ``fabric.call(name, ...)`` invokes.
        lockstep: ``"default"`` (compare operation names and tensor shapes before each collective) or
            ``"strict"`` (also compare call sites); None keeps the strategy's choice (or the
            ``PHALANX_LOCKSTEP`` environment variable).
        detect_anomaly: stop at the first ``fabric.backward`` whose loss or gradients hold nan/inf, naming
            the backward call and the parameter (see :mod:`phalanx.fabric.anomaly` for the cost).
        warn_nonfinite_loss: warn (once, naming the rank and the backward call) when a loss passed to
            ``backward`` is nan/inf, checked every few calls without a per-step device sync
            (:class:`phalanx.fabric.anomaly.LossWatch`). ``False`` (or ``PHALANX_WARN_NONFINITE_LOSS=0``)
            turns it off.
        max_restarts: how many times the launcher phalanx starts (``fabric.launch()`` under plain ``python``)
            restarts the job's processes after one fails (torch's elastic agent; 0: a failure ends the job).
        preemption_signals: the signals :meth:`stop_requested` reports (default SIGTERM and SIGUSR1, or
            ``PHALANX_PREEMPTION_SIGNALS``); ``[]`` turns preemption handling off.
        root_dir: the run's folder: the launcher's run logs go under it (``<root_dir>/phalanx_logs/<run id>``),
            and :meth:`exit_preempted` records a preempted run there (``preempted.json``); None: the first
            logger's ``root_dir``, else the working directory.
        fault_tolerance: run as one of several fault-tolerant replica groups (torchft, ``pip install
            'phalanx[ft]'``): a :class:`~phalanx.distributed.replica_groups.FaultTolerance`, or True for its
            defaults. A group that dies stops no other; it restarts and heals from a live one
            (:meth:`join_replica_groups`). ``phalanx run --replica-groups N`` turns it on too. See docs/faults.md.
    """

    def __init__(
        self,
        accelerator: str | Accelerator = FabricConfig.accelerator,
        devices: int | str = FabricConfig.devices,
        num_nodes: int = FabricConfig.num_nodes,
        strategy: str | Strategy = FabricConfig.strategy,
        precision: str | int | Precision | None = FabricConfig.precision,
        loggers: Any = None,
        callbacks: Any = None,
        lockstep: str | None = FabricConfig.lockstep,
        detect_anomaly: bool = FabricConfig.detect_anomaly,
        plugins: Any = None,
        warn_nonfinite_loss: bool = FabricConfig.warn_nonfinite_loss,
        max_restarts: int = FabricConfig.max_restarts,
        preemption_signals: Any = FabricConfig.preemption_signals,
        root_dir: str | Path | None = FabricConfig.root_dir,
        fault_tolerance: FaultTolerance | bool | None = FabricConfig.fault_tolerance,
    ) -> None:
        refuse_plugins(plugins)
        self.config = config = FabricConfig(
            accelerator=accelerator_name(accelerator), devices=devices, num_nodes=num_nodes, strategy=strategy,
            precision=FabricConfig.precision if precision is None else precision, loggers=as_tuple(loggers),
            callbacks=as_tuple(callbacks), lockstep=lockstep, detect_anomaly=detect_anomaly,
            warn_nonfinite_loss=warn_nonfinite_loss, max_restarts=launcher.check_max_restarts(max_restarts),
            preemption_signals=preemption_signals, root_dir=Path(root_dir) if root_dir is not None else None,
            fault_tolerance=fault_tolerance,
        )
        self._logging = Logging(list(config.loggers), lambda: self.is_global_zero)
        self._callbacks = list(config.callbacks)
        self._run_root = config.root_dir if config.root_dir is not None else self._logging.root_dir
        self._strategy = strategy_ = configured_strategy(config)
        self._preemption = Preemption(strategy_, PreemptionSignals(preemption_signals), self._run_root)
        self._snapshots = Snapshots(strategy_)
        self._persistence = Persistence(strategy_, self._snapshots, self._run_root)
        self._collectives = Collectives(strategy_)
        self._models = Models(strategy_, self)
        watch = warn_nonfinite_loss and not detect_anomaly and os.environ.get(LOSS_WATCH_VARIABLE, "1") != "0"
        self._backward = Backward(strategy_, AnomalyDetector(strategy_) if detect_anomaly else None,
                                  LossWatch(lambda: self.global_rank) if watch else None)
        self._job = Job(strategy_, self.teardown)

    # ------------------------------------------------------------------ launching
    def launch(self, function: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """Start or join the processes of this job.

        Under torchrun, SLURM or ``phalanx run`` this joins the existing job. Under plain
        ``python script.py`` with more than one process, ``launch()`` re-runs the script in N processes
        (this process only supervises them and exits with the job's code), and ``launch(fn, *args)``
        runs ``fn(fabric, *args)`` in N processes and returns rank 0's result.
        """
        factory = functools.partial(Fabric, **self.config.arguments())
        return self._job.launch(self, function, args, kwargs, factory, self.config.max_restarts, self._run_root)

    @property
    def launched(self) -> bool:
        """Whether :meth:`launch` ran in this process (the Trainer launches its Fabric on its first stage)."""
        return self._job.launched

    @property
    def root_dir(self) -> Path | None:
        """The folder the run logs go under (see the ``root_dir`` argument); None: the working directory."""
        return self._run_root

    # ------------------------------------------------------------------ properties
    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def device(self) -> torch.device:
        return self._strategy.root_device

    @property
    def accelerator(self) -> Accelerator:
        """Lightning's accelerator object for this Fabric's device type: ``CUDAAccelerator()`` or
        ``CPUAccelerator()``."""
        return CUDAAccelerator() if self._strategy.device_type == "cuda" else CPUAccelerator()

    # Before launch() these are the launched job's (torchrun, `phalanx run`, SLURM) or the configuration's.
    @property
    def global_rank(self) -> int:
        return self._job.global_rank

    @property
    def local_rank(self) -> int:
        return self._job.local_rank

    @property
    def node_rank(self) -> int:
        return self._job.node_rank

    @property
    def world_size(self) -> int:
        return self._job.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def loggers(self) -> list[Logger]:
        return self._logging.loggers

    @property
    def logger(self) -> Logger | None:
        return self._logging.loggers[0] if self._logging.loggers else None

    # ------------------------------------------------------------------ setup
    def setup(
        self, module: nn.Module, *optimizers: Optimizer, scheduler: Any = None, move_to_device: bool = True
    ) -> Any:
        """Set up a module with its optimizers; returns ``model`` or ``(model, *optimizers[, scheduler])``.
        A ``torch.compile``d module is set up uncompiled and compiled again after wrapping, with the same
        settings (:mod:`phalanx.fabric.compiled`). ``move_to_device=False`` refuses a module that is not on
        this rank's device already (or on the meta device)."""
        self._job.ensure_launched()
        wrapped, opts = self._models.setup(module, optimizers, move_to_device)
        if scheduler is not None:
            return (wrapped, *opts, scheduler)
        return (wrapped, *opts) if opts else wrapped

    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> FabricModule:
        self._job.ensure_launched()
        return self._models.setup_module(module, move_to_device)

    def setup_optimizers(self, *optimizers: Optimizer) -> Any:
        self._job.ensure_launched()
        opts = [self._models.setup_optimizer(opt) for opt in optimizers]
        return opts[0] if len(opts) == 1 else tuple(opts)

    def release(self, model: FabricModule) -> None:
        """Forget a set-up model: the strategy frees what it built for it (DeepSpeed's engine, which it
        holds one of), so another model can be set up. The tuners use it for the scratch copy they search
        on where the optimizer cannot be set up apart from its model. Use ``model`` no more afterwards."""
        self._models.release(model)

    def setup_dataloaders(
        self, *dataloaders: DataLoader[Any], use_distributed_sampler: bool = True, move_to_device: bool = True
    ) -> Any:
        """Shard each loader across ranks (DistributedSampler) and move its batches to the device."""
        self._job.ensure_launched()
        out = [setup_dataloader(self._strategy, loader, use_distributed_sampler, move_to_device, self.broadcast)
               for loader in dataloaders]
        return out[0] if len(out) == 1 else out

    # ------------------------------------------------------------------ training step
    def backward(self, tensor: torch.Tensor, *args: Any, model: FabricModule | None = None, **kwargs: Any) -> None:
        """``loss.backward()`` with loss scaling and gradient sync; after it, gradients of every
        trainable parameter are identical on all ranks (unless inside ``no_backward_sync``). A loss from
        modules none of which was set up is refused on several processes (:mod:`phalanx.fabric.backward`)."""
        modules = self._models.modules
        if not modules:
            self._backward.run_unmanaged(tensor, self.world_size, args, kwargs)
            return
        # A restarted attempt that did not say where it resumed says so now (a replica group says it when it heals).
        if restarts.pending() and self._strategy.replica_groups is None:
            self._persistence.say_started_over()
        self._backward.run(tensor, [model] if model is not None else modules, args, kwargs)

    def clip_gradients(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        clip_val: float | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        """Clip by value (``clip_val``, the third positional argument as in Lightning) or by total norm
        (``max_norm=``, returns the norm)."""
        if (max_norm is None) == (clip_val is None):
            raise MisconfigurationError("Pass exactly one of max_norm= or clip_val= to clip_gradients.")
        raw = optimizer.optimizer if isinstance(optimizer, FabricOptimizer) else optimizer
        return self._strategy.clip_gradients(raw, max_norm, clip_val, norm_type, error_if_nonfinite)

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient sync for backward passes inside this block (gradient accumulation). Put both
        forward and backward of the non-final micro-batches inside it."""
        if not isinstance(module, FabricModule):
            raise MisconfigurationError(
                "no_backward_sync needs the module returned by fabric.setup(), not the original module."
            )
        return self._strategy.no_backward_sync(module.forward_module, enabled)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision's forward context, for code that runs outside the set-up model's forward."""
        return self._strategy.precision.forward_context()

    def init_module(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager[Any]:
        """Create a module directly on the device and in the precision's dtype.

        ``empty_init=True``, as in Lightning: skip the layers' default initialisation (you load a
        checkpoint into the parameters or initialise them yourself). The ``torch.nn.init`` initialisers of
        the built-in layers do nothing inside the block (:class:`phalanx.utils.init.SkipInit`), so
        parameters hold uninitialised memory and no random number is drawn: your own initialisation
        afterwards draws exactly what it would under Lightning. Sharding strategies (FSDP) create the
        parameters on the meta device instead and materialise them at setup."""
        self._job.ensure_launched()
        if not empty_init:
            return self._strategy.init_context(empty_init)
        return skipping_init(self._strategy.init_context(empty_init))

    def init_tensor(self) -> contextlib.AbstractContextManager[Any]:
        """Tensors created inside are on the device, in the precision's dtype."""
        self._job.ensure_launched()
        return self._strategy.init_context(None)

    def to_device(self, obj: Any) -> Any:
        if isinstance(obj, nn.Module):
            return obj.to(self.device)
        return move_to_device(obj, self.device)

    def verify_in_sync(self, module: nn.Module, grads: bool = True, params: bool = True, rtol: float = 1e-5) -> None:
        """Check that parameters and/or gradients agree across ranks; raise naming the first that differs."""
        self._models.verify_in_sync(module, grads, params, rtol)

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        self._job.ensure_launched()
        self._collectives.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._job.ensure_launched()
        return self._collectives.broadcast(obj, src)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Gather tensors, numbers and bools (or a collection of them) from every rank. Each becomes a
        tensor with a leading world dimension, also on one process (shape ``(1, ...)``), so code written
        for N ranks runs unchanged on one. ``sync_grads=True`` lets gradients flow back to every rank's
        input (as ``torch.distributed.nn.functional.all_gather``)."""
        self._job.ensure_launched()
        return self._collectives.all_gather(data, group, sync_grads)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object from every rank (index = rank), e.g. per-rank RNG states."""
        self._job.ensure_launched()
        return self._collectives.all_gather_object(obj)

    def all_reduce(self, data: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce tensors, numbers (or a collection of them) across ranks with ``reduce_op``: "mean"
        (or "avg"), "sum", "max", "min", "product", or a ``torch.distributed.ReduceOp``. As in Lightning,
        a tensor already on this rank's device receives the result in place and is returned. The mean
        of an integer tensor is refused (it would be truncated); Python ints are averaged as floats."""
        self._job.ensure_launched()
        return self._collectives.all_reduce(data, group, reduce_op)

    def rank_zero_first(self, local: bool = False) -> contextlib.AbstractContextManager[None]:
        """Rank 0 (of the node with ``local=True``) runs the block first, e.g. to download data once."""
        self._job.ensure_launched()
        return self._collectives.rank_zero_first(local)

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_global_zero:
            print(*args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path, state: dict[str, Any], filter: Any = None) -> AsyncCheckpoint | None:
        """Save ``state`` (modules, optimizers, stateful objects and plain values). Call it on every rank:
        the strategy decides who writes. The write is atomic. Returns None, or the handle of a save that
        continues in the background (``FSDPStrategy(async_save=True)``, ``ModelParallelStrategy`` too)."""
        self._job.ensure_launched()
        return self._persistence.save(path, state, filter)

    def load(
        self, path: str | Path, state: dict[str, Any] | None = None, strict: bool = True, *,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from ``path``; returns the checkpoint entries ``state`` did not ask
        for (or the whole checkpoint when ``state`` is None). Call it on every rank. ``strict=False``
        loads what matches and warns what it skipped. ``weights_only`` (None means True): open only
        tensors and plain values; pass False for a trusted file holding other objects (unpickling
        those can run code). Loading what ``latest_checkpoint`` found says where the run resumed (rank 0)."""
        self._job.ensure_launched()
        return self._persistence.load(path, state, strict, weights_only)

    def load_raw(
        self, path: str | Path, obj: nn.Module | Optimizer, strict: bool = True, *, weights_only: bool | None = None
    ) -> None:
        """Load a plain state dict (e.g. from ``torch.save(model.state_dict())``) into one module/optimizer."""
        self._job.ensure_launched()
        self._persistence.load_raw(path, obj, strict, weights_only)

    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete a checkpoint written by ``save`` (a file or a sharded directory). Call it on every rank."""
        self._job.ensure_launched()
        self._persistence.remove(path)

    def latest_checkpoint(self, directory: str | Path, *more: str | Path) -> Path | None:
        """The newest complete checkpoint in ``directory`` (and the other directories given): a file, or a
        sharded directory whose save finished; None when there is none. Interrupted saves are skipped.
        With more than one process, rank 0 decides and every rank gets its answer (call it on every rank).
        Under a restarting launcher (``Fabric(max_restarts=K)``, ``torchrun --max-restarts K``) or a
        requeued job, this is where the next attempt continues from."""
        if self._strategy.num_processes > 1:
            self._job.ensure_launched()
        return self._persistence.latest([Path(directory), *map(Path, more)])

    # ------------------------------------------------------------------ replica groups
    def join_replica_groups(self, state: dict[str, Any] | Callable[[], dict[str, Any]],
                            on_heal: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Share ``state`` with the job's other replica groups (``fault_tolerance=``; does nothing without it).

        ``state`` is what ``fabric.save`` would take: modules, optimizers, schedulers, set-up dataloaders, counters.
        A group that (re)joins, or fell behind, receives it from a live group at its next ``optimizer.step()``,
        in place and checked (checksums, format version: :mod:`phalanx.checkpoint.peer`); from then on it is
        what this group sends. Call it once on every rank, before the loop; write the loop over the counters in
        ``state`` (``while state["step"] < total``), since they jump when a group heals.

        ``state`` may be a function that builds the dict when it is needed (the Trainer's way); ``on_heal(state)``
        is then called with the dict it built and filled, after a heal."""
        self._job.ensure_launched()
        self._strategy.share_state_with_groups(state, on_heal)

    @property
    def replica_groups(self) -> Any:
        """This process's part of the fault-tolerant job (:class:`~phalanx.distributed.replica_groups.ReplicaGroups`:
        its group, the count of what was trained and skipped), or None without ``fault_tolerance``."""
        return self._strategy.replica_groups

    # ------------------------------------------------------------------ preemption, restarts, snapshots
    def stop_requested(self) -> bool:
        """True on every rank, at the same call, once any rank received a preemption signal (SIGTERM or
        SIGUSR1 by default: ``Fabric(preemption_signals=...)`` or ``PHALANX_PREEMPTION_SIGNALS``).

        Call it on every rank at the same point of the loop, e.g. after each optimizer step: with more
        than one process it is a collective (one all-reduce of two integers). The first call starts
        listening for the signals; until then they keep their default effect (SIGTERM ends the process),
        so a loop that never asks is not left running after its scheduler asked it to stop. Once True, it
        stays True without communicating again. Where the collective runs on a GPU, its answer is read two calls
        later (still the same call on every rank), so asking never makes the GPU wait for the host."""
        self._job.ensure_launched()
        return self._preemption.stop_requested()

    def release_signals(self) -> None:
        """Stop listening: the preemption signals get their previous handlers back (SIGTERM ends the process
        again). The next :meth:`stop_requested` listens anew; an agreed stop stays agreed."""
        self._preemption.signals.uninstall()

    @property
    def preemption(self) -> Stop | None:
        """The agreed stop (signal and rank) once :meth:`stop_requested` returned True, else None."""
        return self._preemption.stop

    def exit_preempted(self, checkpoint_path: str | Path | None = None, step: int | None = None) -> NoReturn:
        """End this rank after a preemption stop: rank 0 prints one line (step, signal, rank, checkpoint,
        how to resume) and, under SLURM, requeues the job; every rank exits with code 75
        (:data:`phalanx.distributed.preemption.EXIT_PREEMPTED`) without a traceback. Call it on every
        rank, after the checkpoint is saved: a complete one is recorded in the run's folder (``preempted.json``),
        and no later run saves over it before loading it."""
        self._preemption.exit(checkpoint_path, step)

    @property
    def restart_count(self) -> int:
        """How many times the launcher restarted this job's processes (0 on the first attempt)."""
        return restart_count()

    @property
    def snapshot_dir(self) -> Path:
        """Where :meth:`save_snapshot` writes by default: node-local shared memory, one folder per script and
        working directory (the same for every attempt of the run)."""
        return self._snapshots.default_dir

    def save_snapshot(self, state: dict[str, Any] | Callable[[], dict[str, Any]], step: int,
                      directory: str | Path | None = None, keep: int = 2, overlap: bool = True,
                      every_n_steps: int | str | Cadence = "auto", max_overhead: float = 0.05) -> Path | None:
        """Snapshot ``state`` at ``step`` when one is due (default folder: :attr:`snapshot_dir`), keeping the
        newest ``keep``: per-step state in node-local memory for restarts, so a crashed rank costs only the
        steps since the last snapshot.

        Call it on every rank at every step, between optimizer steps; ``state`` may be a function that builds
        the dict (called when a snapshot is due, and under ``"auto"`` once at the first call, to set the
        shared memory up before the first snapshot). ``every_n_steps``: an int snapshots when ``step`` is a
        multiple of it; ``"auto"`` (the default) measures the step and the snapshot and snapshots as often as
        ``max_overhead`` (a share of the run's time) allows, the same steps on every rank, and says its choice
        once (:class:`phalanx.checkpoint.snapshot.Cadence`; pass your own Cadence to read it). Each rank copies
        its own part, without a collective (:mod:`phalanx.fabric.snapshots`); ``overlap=False`` copies before
        returning. The snapshot of a step counts once every rank has written it.

        Resume with ``fabric.load(fabric.latest_checkpoint(checkpoint_dir, fabric.snapshot_dir), state)``: the
        newest complete state among checkpoints and snapshots, on the same topology (same strategy and ranks,
        same node). Returns the reference of the snapshot written at this call (a path ``fabric.load``
        accepts), or None when none was (not due, or this rank could not write it: the message says why;
        restarts then use the disk checkpoints). The folder is removed when the job ends without an error."""
        return self._snapshots.save(directory, state, step, keep, overlap, every_n_steps, max_overhead)

    def remove_snapshots(self, directory: str | Path | None = None) -> None:
        """Delete the snapshots in ``directory`` (default: :attr:`snapshot_dir`) once this rank's last copy is
        complete: each rank removes its own part, the last one the folder (no collective)."""
        self._snapshots.remove(directory)

    def close_snapshots(self, directory: str | Path | None = None) -> None:
        """Complete this rank's last snapshot in ``directory`` (default: :attr:`snapshot_dir`) and let go of the
        folder, keeping its snapshots: what a run that did not finish leaves for its restart or rerun, which
        may be another Trainer or Fabric in this same process (no collective)."""
        self._snapshots.close(directory)

    # ------------------------------------------------------------------ logging and callbacks
    def log(self, name: str, value: Any, step: int | None = None) -> None:
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Send metrics to every logger, on rank 0 only (reduce them first if you need global values)."""
        self._logging.log_metrics(metrics, step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Send hyperparameters to every logger, on rank 0 only."""
        self._logging.log_hyperparams(params)

    def finalize_loggers(self, status: str = "success") -> None:
        """End every logger's run (rank 0; ``status`` "success" or "failed"): what the job's end does, and the
        Trainer at the end of each stage. A logger may log again afterwards."""
        self._logging.finalize(status)

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call ``hook_name(*args, **kwargs)`` on every callback that defines it."""
        for callback in self._callbacks:
            method = getattr(callback, hook_name, None)
            if callable(method):
                method(*args, **kwargs)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = True) -> int:
        return _seed_everything(seed, bool(workers), verbose=verbose)

    def teardown(self, error: BaseException | None = None) -> None:
        """Finalize the loggers and leave the job now (otherwise both happen at interpreter exit). ``error``:
        what this rank ends with, which its peers are told at once instead of waiting for it in a collective
        (the launcher's ``launch(fn)`` passes the exception ``fn`` raised); an exception ending the
        interpreter counts too."""
        failed = error is not None or getattr(sys, "last_value", None) is not None
        self._backward.flush()
        self._logging.finalize("failed" if failed else "success")
        self._preemption.signals.uninstall()
        self._snapshots.end(failed)
        self._strategy.stop_replica_groups(failed)
        self._persistence.end(failed or self._preemption.exited)
        self._strategy.teardown(error)
        atexit.unregister(self.teardown)
