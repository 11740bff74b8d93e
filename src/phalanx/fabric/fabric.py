"""``phalanx.Fabric``: keep your own training loop; phalanx handles devices, processes, precision,
gradient sync, collectives and checkpoints.

This class is deliberately thin. It never asks which backend it runs on: everything that differs
between single-device, DDP, FSDP and DeepSpeed is a method of the strategy object.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from phalanx.distributed import launch as launcher
from phalanx.distributed import restarts
from phalanx.distributed.preemption import PreemptionSignals
from phalanx.fabric.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator, accelerator_name
from phalanx.fabric.anomaly import LOSS_WATCH_VARIABLE, AnomalyDetector, LossWatch
from phalanx.fabric.checkpoints import CheckpointMethods
from phalanx.fabric.collectives import CollectiveMethods
from phalanx.fabric.compiled import unwrap_compiled
from phalanx.fabric.connector import as_list, configured_strategy
from phalanx.fabric.data import FabricDataLoader, distribute_dataloader, shared_seed, warn_iterable
from phalanx.fabric.preemption import PreemptionMethods
from phalanx.fabric.snapshots import Snapshots
from phalanx.fabric.wrappers import FabricModule, FabricOptimizer, foreign_parameters, param_owner
from phalanx.strategies import Strategy
from phalanx.utils import exiting
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.init import skipping_init
from phalanx.utils.seed import seed_everything as _seed_everything
from phalanx.utils.tensors import move_to_device


class Fabric(CollectiveMethods, CheckpointMethods, PreemptionMethods):
    """Scale a hand-written PyTorch loop from one CPU to many devices without changing it.

    Args:
        accelerator: ``"auto"``, ``"cpu"`` or ``"cuda"`` (``"gpu"`` is an alias), or a ``CPUAccelerator()`` /
            ``CUDAAccelerator()`` object (:mod:`phalanx.accelerators`).
        devices: processes per node (``"auto"``: every GPU, or 1 on CPU).
        num_nodes: number of machines.
        strategy: ``"auto"``, ``"single"``, ``"ddp"``, ``"fsdp"``, ``"deepspeed"`` or a Strategy instance.
        precision: ``"32-true"``, ``"64-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``.
        loggers: a logger or a list of loggers (objects with ``log_metrics(metrics, step)``).
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
    """

    def __init__(
        self,
        accelerator: str | Accelerator = "auto",
        devices: int | str = "auto",
        num_nodes: int = 1,
        strategy: str | Strategy = "auto",
        precision: str | int | None = "32-true",
        loggers: Any = None,
        callbacks: Any = None,
        lockstep: str | None = None,
        detect_anomaly: bool = False,
        plugins: Any = None,
        warn_nonfinite_loss: bool = True,
        max_restarts: int = 0,
        preemption_signals: Any = None,
    ) -> None:
        if plugins is not None and plugins != []:
            raise MisconfigurationError(
                f"Fabric(plugins={plugins!r}) is not supported. phalanx has no plugin objects: choose the precision "
                "with precision=..., the cluster environment is detected from torchrun/SLURM/`phalanx run`, and "
                "checkpoint I/O belongs to the strategy (pass a Strategy instance with its options)."
            )
        if precision is None:
            precision = "32-true"
        accelerator = accelerator_name(accelerator)
        self._init_kwargs: dict[str, Any] = {
            "accelerator": accelerator, "devices": devices, "num_nodes": num_nodes, "strategy": strategy,
            "precision": precision, "loggers": loggers, "callbacks": callbacks, "lockstep": lockstep,
            "detect_anomaly": detect_anomaly, "warn_nonfinite_loss": warn_nonfinite_loss,
            "max_restarts": launcher.check_max_restarts(max_restarts), "preemption_signals": preemption_signals,
        }
        self._preemption, self._stop = PreemptionSignals(preemption_signals), None
        self._loggers, self._callbacks = as_list(loggers), as_list(callbacks)
        self._latest = None
        # The run's logs go under it (phalanx.distributed.runlogs): the first logger's root_dir, else the working
        # directory; the Trainer sets its default_root_dir.
        self._run_root: Path | None = next((Path(lg.root_dir) for lg in self._loggers if hasattr(lg, "root_dir")), None)
        self._strategy = configured_strategy(self._init_kwargs)
        self._snapshots = Snapshots(self._strategy, self.save, self.remove_checkpoint)
        self._anomaly = AnomalyDetector(self._strategy) if detect_anomaly else None
        watch = warn_nonfinite_loss and not detect_anomaly and os.environ.get(LOSS_WATCH_VARIABLE, "1") != "0"
        self._loss_watch = LossWatch(lambda: self.global_rank) if watch else None
        self._launched = False
        self._modules: list[FabricModule] = []
        # Under torchrun / `phalanx run` / SLURM the ranks are known now, before launch() joins the group.
        # A malformed environment is reported by launch(), where it is checked against this configuration.
        try:
            self._env = self._strategy.job_environment(launcher.detect_environment())
        except MisconfigurationError:
            self._env = None

    # ------------------------------------------------------------------ launching
    def launch(self, function: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """Start or join the processes of this job.

        Under torchrun, SLURM or ``phalanx run`` this joins the existing job. Under plain
        ``python script.py`` with more than one process, ``launch()`` re-runs the script in N processes
        (this process only supervises them and exits with the job's code), and ``launch(fn, *args)``
        runs ``fn(fabric, *args)`` in N processes and returns rank 0's result.
        """
        env = self._strategy.job_environment(launcher.detect_environment())
        if env is None and self._strategy.num_processes > 1:
            if self._launched:
                raise MisconfigurationError("fabric.launch() was already called.")
            launcher.check_cpu_processes(self._strategy.devices, self._strategy.device_type)
            limit, root = self._init_kwargs["max_restarts"], self._run_root
            if function is None:
                sys.exit(launcher.launch_script(self._strategy.num_processes, limit, root))
            factory = functools.partial(Fabric, **self._init_kwargs)
            target = functools.partial(function, **kwargs) if kwargs else function
            return launcher.launch_function(self._strategy.num_processes, factory, target, args, limit, root)
        self._join(env)
        return function(self, *args, **kwargs) if function is not None else None

    def _join(self, env: launcher.ClusterEnvironment | None) -> None:
        if self._launched:
            return
        self._strategy.setup_environment(env)
        self._launched = True
        # Leave the process group in order at exit, so peers see a clean "exited" instead of a hang.
        atexit.register(self.teardown)
        exiting.freeze_at_exit()

    def _ensure_launched(self) -> None:
        if self._launched:
            return
        env = self._strategy.job_environment(launcher.detect_environment())
        if env is None and self._strategy.num_processes > 1:
            raise MisconfigurationError(
                f"This Fabric runs {self._strategy.num_processes} processes: call fabric.launch() before "
                "setting up models, data or collectives."
            )
        self._join(env)

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

    # Before launch() these come from the launched job's environment when there is one (torchrun,
    # `phalanx run`, SLURM), else from the configuration (rank 0 of devices*num_nodes), as in Lightning.
    @property
    def global_rank(self) -> int:
        if not self._launched:
            return self._env.rank if self._env is not None else 0
        return self._strategy.global_rank

    @property
    def local_rank(self) -> int:
        if not self._launched:
            return self._env.local_rank if self._env is not None else 0
        return self._strategy.local_rank

    @property
    def node_rank(self) -> int:
        if not self._launched:
            return self._env.node_rank if self._env is not None else 0
        return self._strategy.node_rank

    @property
    def world_size(self) -> int:
        if not self._launched:
            return self._env.world_size if self._env is not None else self._strategy.num_processes
        return self._strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def loggers(self) -> list[Any]:
        return self._loggers

    @property
    def logger(self) -> Any:
        return self._loggers[0] if self._loggers else None

    # ------------------------------------------------------------------ setup
    def setup(
        self, module: nn.Module, *optimizers: Optimizer, scheduler: Any = None, move_to_device: bool = True
    ) -> Any:
        """Set up a module with its optimizers; returns ``model`` or ``(model, *optimizers[, scheduler])``.
        A ``torch.compile``d module is set up uncompiled and compiled again after wrapping, with the same
        settings (:mod:`phalanx.fabric.compiled`)."""
        self._ensure_launched()
        self._check_new_module(module)
        module, recompile = unwrap_compiled(module, self._strategy)
        self._check_placement(module, move_to_device)
        for opt in optimizers:
            self._check_new_optimizer(opt)
            self._check_owned(opt, module)
        forward_module, raw_opts = self._strategy.setup_module_and_optimizers(module, list(optimizers))
        if recompile is not None:
            recompile(forward_module)
        wrapped = FabricModule(forward_module, module, self._strategy)
        self._modules.append(wrapped)
        opts = [FabricOptimizer(opt, self._strategy, module) for opt in raw_opts]
        self._link_module(module, opts)
        if scheduler is not None:
            return (wrapped, *opts, scheduler)
        return (wrapped, *opts) if opts else wrapped

    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> FabricModule:
        self._ensure_launched()
        self._check_new_module(module)
        module, recompile = unwrap_compiled(module, self._strategy)
        self._check_placement(module, move_to_device)
        forward_module = self._strategy.setup_module(module)
        if recompile is not None:
            recompile(forward_module)
        wrapped = FabricModule(forward_module, module, self._strategy)
        self._modules.append(wrapped)
        self._link_module(module, [])
        return wrapped

    def _check_placement(self, module: nn.Module, move_to_device: bool) -> None:
        """``move_to_device=False``: the module stays where it is. Every strategy runs the module on this
        rank's device, so that holds when it is already there (or on the meta device, for the strategy
        to materialize); anywhere else is refused rather than moved behind the caller's back."""
        if move_to_device:
            return
        elsewhere = {str(t.device) for t in (*module.parameters(), *module.buffers())
                     if t.device.type != "meta" and t.device != self.device}
        if elsewhere:
            raise MisconfigurationError(
                f"setup(move_to_device=False): the module is on {sorted(elsewhere)} but this rank runs on "
                f"{self.device}, and the strategy runs the module there. Create it there (`with "
                "fabric.init_module():`) or move it yourself, or pass move_to_device=True."
            )

    def _link_module(self, module: nn.Module, optimizers: list[FabricOptimizer]) -> None:
        """A phalanx/Lightning Module run in a Fabric loop: its self.log, self.logger, self.optimizers(),
        self.manual_backward and self.all_gather go through this Fabric."""
        if hasattr(module, "_fabric_optimizers") and hasattr(module, "_fabric"):
            setattr(module, "_fabric", self)  # noqa: B010 - any module with these slots, not one class
            setattr(module, "_fabric_optimizers", list(optimizers))  # noqa: B010

    def release(self, model: FabricModule) -> None:
        """Forget a set-up model: the strategy frees what it built for it (DeepSpeed's engine, which it
        holds one of), so another model can be set up. The tuners use it for the scratch copy they search
        on where the optimizer cannot be set up apart from its model. Use ``model`` no more afterwards."""
        if not any(m is model for m in self._modules):
            raise MisconfigurationError("fabric.release(model): this model was not set up by this Fabric.")
        self._modules = [m for m in self._modules if m is not model]
        self._strategy.release_module(model.forward_module)

    def setup_optimizers(self, *optimizers: Optimizer) -> Any:
        self._ensure_launched()
        opts = [self._wrap_optimizer(opt, None) for opt in optimizers]
        return opts[0] if len(opts) == 1 else tuple(opts)

    @staticmethod
    def _check_new_module(module: Any) -> None:
        if isinstance(module, FabricModule):
            raise MisconfigurationError("This module was already set up by fabric.setup(); set it up once.")
        if not isinstance(module, nn.Module):
            raise MisconfigurationError(f"fabric.setup expects an nn.Module, got {type(module).__name__}.")

    @staticmethod
    def _check_new_optimizer(optimizer: Any) -> None:
        if isinstance(optimizer, FabricOptimizer):
            raise MisconfigurationError("This optimizer was already set up; set it up once.")
        if not isinstance(optimizer, Optimizer):
            raise MisconfigurationError(f"Expected a torch.optim.Optimizer, got {type(optimizer).__name__}.")

    def _check_owned(self, optimizer: Optimizer, module: nn.Module | None = None) -> None:
        """Refuse parameters of no set-up module: nothing would sync (DDP) or shard (FSDP) them, so each
        rank would silently train its own copy."""
        foreign = foreign_parameters(optimizer, [m.module for m in self._modules] + ([module] if module else []))
        if foreign:
            n = len(foreign)
            what = f"{type(module).__name__} (nor of a model set up before)" if module is not None else (
                "any model set up with this Fabric")
            raise MisconfigurationError(
                f"{type(optimizer).__name__} updates {n} parameter{'s' if n != 1 else ''} that "
                f"{'are' if n != 1 else 'is'} not part of {what}: phalanx would neither average their gradients "
                "across ranks nor shard them, so each rank would train its own copy. Set up every model the "
                "optimizer trains: put them in one nn.Module (e.g. nn.ModuleDict({'a': a, 'b': b})) and set that "
                "up, or `b = fabric.setup_module(b)` first; then create the optimizer from the set-up models' "
                "parameters (`torch.optim.X(model.parameters())`)."
            )

    def _wrap_optimizer(self, optimizer: Optimizer, module: FabricModule | None) -> FabricOptimizer:
        self._check_new_optimizer(optimizer)
        owner = module.module if module is not None else None
        if owner is None:
            found = param_owner(optimizer, self._modules)
            owner = found.module if found is not None else None
        raw = self._strategy.setup_optimizer(optimizer)  # first: a backend may know better why a param is foreign
        self._check_owned(raw)
        return FabricOptimizer(raw, self._strategy, owner)

    def setup_dataloaders(
        self, *dataloaders: DataLoader[Any], use_distributed_sampler: bool = True, move_to_device: bool = True
    ) -> Any:
        """Shard each loader across ranks (DistributedSampler) and move its batches to the device."""
        self._ensure_launched()
        out = []
        for loader in dataloaders:
            if not isinstance(loader, DataLoader):
                raise MisconfigurationError(f"setup_dataloaders expects DataLoaders, got {type(loader).__name__}.")
            sampler_kwargs = self._strategy.distributed_sampler_kwargs()
            if use_distributed_sampler and sampler_kwargs is not None and self.world_size > 1:
                warn_iterable(loader, self.global_rank)
                loader = distribute_dataloader(loader, **sampler_kwargs, seed=shared_seed(self.broadcast))
            checked = self._strategy if self.world_size > 1 else None
            out.append(FabricDataLoader(loader, self.device if move_to_device else None, checked))
        return out[0] if len(out) == 1 else out

    # ------------------------------------------------------------------ training step
    def backward(self, tensor: torch.Tensor, *args: Any, model: FabricModule | None = None, **kwargs: Any) -> None:
        """``loss.backward()`` with loss scaling and gradient sync; after it, gradients of every
        trainable parameter are identical on all ranks (unless inside ``no_backward_sync``).

        A loss from modules none of which was set up (e.g. a meta-learning inner model) is backpropagated
        as ``loss.backward()`` in one process, where there is nothing to sync; on several processes it is
        refused, since nothing would average those gradients across ranks."""
        if not self._modules:
            self._backward_unmanaged(tensor, args, kwargs)
            return
        if restarts.pending():  # a restarted attempt that did not say where it resumed says so now
            self._said_where_started()
        targets = [model] if model is not None else self._modules
        anomaly = self._anomaly
        if anomaly is not None:
            anomaly.before_backward(tensor)
        forward_modules = [model._fwd] if model is not None else [m._fwd for m in targets]
        self._strategy.backward(tensor, forward_modules, *args, **kwargs)
        if anomaly is not None:
            anomaly.after_backward([m.module for m in targets])
        watch = self._loss_watch
        if watch is not None:
            watch.record(tensor)

    def _backward_unmanaged(self, tensor: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``backward`` before any module was set up: fine on one process, refused where it would not sync."""
        if self.world_size > 1:
            raise MisconfigurationError(
                f"fabric.backward(loss): no module was set up with this Fabric, and this job runs {self.world_size} "
                "processes, so nothing would average these gradients across ranks: each rank would silently train its "
                "own copy. Set up the module the loss comes from first (`model = fabric.setup_module(model)`, or "
                "`model, optimizer = fabric.setup(model, optimizer)`); if every rank is meant to train its own copy, "
                "call loss.backward() yourself."
            )
        precision = self._strategy.precision
        if getattr(precision, "scaler", None) is not None:
            raise MisconfigurationError(
                "fabric.backward(loss) with no module set up: precision='16-mixed' scales the loss, and only an "
                "optimizer set up with fabric.setup unscales the gradients again, so the step would use gradients "
                "65536 times too large. Set up the model and optimizer (`model, optimizer = fabric.setup(model, "
                "optimizer)`), or use precision='bf16-mixed' (no loss scaling)."
            )
        anomaly = self._anomaly
        if anomaly is not None:
            anomaly.before_backward(tensor)
        precision.pre_backward(tensor).backward(*args, **kwargs)
        if anomaly is not None:
            anomaly.after_backward([])
        watch = self._loss_watch
        if watch is not None:
            watch.record(tensor)

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
        self._ensure_launched()
        if not empty_init:
            return self._strategy.init_context(empty_init)
        return skipping_init(self._strategy.init_context(empty_init))

    def init_tensor(self) -> contextlib.AbstractContextManager[Any]:
        """Tensors created inside are on the device, in the precision's dtype."""
        self._ensure_launched()
        return self._strategy.init_context(None)

    def to_device(self, obj: Any) -> Any:
        if isinstance(obj, nn.Module):
            return obj.to(self.device)
        return move_to_device(obj, self.device)

    def verify_in_sync(self, module: nn.Module, grads: bool = True, params: bool = True, rtol: float = 1e-5) -> None:
        """Check that parameters and/or gradients agree across ranks; raise naming the first that differs."""
        raw = module.module if isinstance(module, FabricModule) else module
        if params:
            self._strategy.verify_in_sync([(n, p) for n, p in raw.named_parameters()], "parameters", rtol)
        if grads:
            named: list[tuple[str, torch.Tensor]] = [
                (n + ".grad", p.grad) for n, p in raw.named_parameters() if p.grad is not None
            ]
            self._strategy.verify_in_sync(named, "gradients", rtol)

    # ------------------------------------------------------------------ logging and callbacks
    def log(self, name: str, value: Any, step: int | None = None) -> None:
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Send metrics to every logger, on rank 0 only (reduce them first if you need global values)."""
        if not self.is_global_zero or not self._loggers:
            return
        plain = {k: float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
        for logger in self._loggers:
            logger.log_metrics(plain, step=step)

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call ``hook_name(*args, **kwargs)`` on every callback that defines it."""
        for callback in self._callbacks:
            method = getattr(callback, hook_name, None)
            if callable(method):
                method(*args, **kwargs)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = True) -> int:
        return _seed_everything(seed, bool(workers), verbose=verbose)

    def teardown(self) -> None:
        """Flush loggers and leave the process group now (otherwise both happen at interpreter exit)."""
        self._leave_job(None)

    def _leave_job(self, error: BaseException | None) -> None:
        """Finalize loggers and leave the job; ``error`` (or the exception ending the interpreter) is what
        the other ranks are told this rank ended with."""
        failed = error is not None or getattr(sys, "last_value", None) is not None
        watch = self._loss_watch
        if watch is not None:
            with contextlib.suppress(RuntimeError):  # a failed device must not hide the error that ended the run
                watch.flush()
        if self.is_global_zero:
            for logger in self._loggers:
                finalize = getattr(logger, "finalize", None)
                if callable(finalize):
                    finalize("failed" if failed else "success")
        self._preemption.uninstall()
        self._snapshots.end(failed)
        self._strategy.teardown(error)
        atexit.unregister(self.teardown)
