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
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from phalanx import launch as launcher
from phalanx.accelerator import resolve_accelerator, resolve_devices
from phalanx.anomaly import AnomalyDetector
from phalanx.data import FabricDataLoader, distribute_dataloader, shared_seed, warn_iterable
from phalanx.diagnostics import warn
from phalanx.errors import MisconfigurationError
from phalanx.precision import canonical_precision
from phalanx.seed import seed_everything as _seed_everything
from phalanx.strategies import Strategy, resolve_strategy
from phalanx.strategies._transforms import refuse_compiled
from phalanx.utils import apply_to_tensors, move_to_device
from phalanx.wrappers import FabricModule, FabricOptimizer, param_owner

if TYPE_CHECKING:
    from phalanx.checkpoint.async_sharded import AsyncCheckpoint

# `phalanx run --strategy ...` passes its flags to the script's Fabric through these variables.
_CLI_ENV = {
    "accelerator": "PHALANX_ACCELERATOR",
    "devices": "PHALANX_DEVICES",
    "num_nodes": "PHALANX_NUM_NODES",
    "strategy": "PHALANX_STRATEGY",
    "precision": "PHALANX_PRECISION",
}
_DEFAULTS: dict[str, Any] = {
    "accelerator": "auto", "devices": "auto", "num_nodes": 1, "strategy": "auto", "precision": "32-true",
}


def _apply_cli_overrides(args: dict[str, Any]) -> dict[str, Any]:
    out = dict(args)
    for key, var in _CLI_ENV.items():
        value = os.environ.get(var)
        if value is None:
            continue
        given = args[key]
        if given != _DEFAULTS[key] and str(given) != value and not isinstance(given, Strategy):
            env = launcher.detect_environment()
            warn(
                f"The code sets {key}={given!r} but the job was launched with --{key.replace('_', '-')} {value}; "
                f"using {value}. Remove one of the two so the script says what runs.",
                rank=env.rank if env is not None else None,
            )
        if isinstance(given, Strategy) and key == "strategy":
            continue
        out[key] = int(value) if key == "num_nodes" else value
    return out


class Fabric:
    """Scale a hand-written PyTorch loop from one CPU to many devices without changing it.

    Args:
        accelerator: ``"auto"``, ``"cpu"`` or ``"cuda"`` (``"gpu"`` is an alias).
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
            the backward call and the parameter (see :mod:`phalanx.anomaly` for the cost).
    """

    def __init__(
        self,
        accelerator: str = "auto",
        devices: int | str = "auto",
        num_nodes: int = 1,
        strategy: str | Strategy = "auto",
        precision: str | int = "32-true",
        loggers: Any = None,
        callbacks: Any = None,
        lockstep: str | None = None,
        detect_anomaly: bool = False,
    ) -> None:
        self._init_kwargs: dict[str, Any] = {
            "accelerator": accelerator, "devices": devices, "num_nodes": num_nodes, "strategy": strategy,
            "precision": precision, "loggers": loggers, "callbacks": callbacks, "lockstep": lockstep,
            "detect_anomaly": detect_anomaly,
        }
        args = _apply_cli_overrides(self._init_kwargs)
        device_type = resolve_accelerator(args["accelerator"])
        n_devices = resolve_devices(args["devices"], device_type)
        n_nodes = int(args["num_nodes"])
        if n_nodes < 1:
            raise MisconfigurationError(f"num_nodes must be >= 1, got {n_nodes}.")
        self._strategy = resolve_strategy(args["strategy"], n_devices * n_nodes)
        self._strategy.configure(
            device_type=device_type, devices=n_devices, num_nodes=n_nodes,
            precision=canonical_precision(args["precision"]),
        )
        if lockstep is not None:
            self._strategy.set_lockstep(lockstep)
        self._anomaly = AnomalyDetector(self._strategy) if detect_anomaly else None
        self._loggers: list[Any] = _as_list(loggers)
        self._callbacks: list[Any] = _as_list(callbacks)
        self._launched = False
        self._modules: list[FabricModule] = []

    # ------------------------------------------------------------------ launching
    def launch(self, function: Callable[..., Any] | None = None, *args: Any) -> Any:
        """Start or join the processes of this job.

        Under torchrun, SLURM or ``phalanx run`` this joins the existing job. Under plain
        ``python script.py`` with more than one process, ``launch()`` re-runs the script in N processes
        (this process only supervises them and exits with the job's code), and ``launch(fn, *args)``
        runs ``fn(fabric, *args)`` in N processes and returns rank 0's result.
        """
        env = launcher.detect_environment()
        if env is None and self._strategy.num_processes > 1:
            if self._launched:
                raise MisconfigurationError("fabric.launch() was already called.")
            launcher.check_cpu_processes(self._strategy.devices, self._strategy.device_type)
            if function is None:
                sys.exit(launcher.launch_script(self._strategy.num_processes))
            factory = functools.partial(Fabric, **self._init_kwargs)
            return launcher.launch_function(self._strategy.num_processes, factory, function, args)
        self._join(env)
        return function(self, *args) if function is not None else None

    def _join(self, env: launcher.ClusterEnvironment | None) -> None:
        if self._launched:
            return
        self._strategy.setup_environment(env)
        self._launched = True
        # Leave the process group in order at exit, so peers see a clean "exited" instead of a hang.
        atexit.register(self.teardown)

    def _ensure_launched(self) -> None:
        if self._launched:
            return
        env = launcher.detect_environment()
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
    def global_rank(self) -> int:
        return self._strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self._strategy.local_rank

    @property
    def node_rank(self) -> int:
        return self._strategy.node_rank

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self._strategy.is_global_zero

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
        """Set up a module with its optimizers; returns ``model`` or ``(model, *optimizers[, scheduler])``."""
        self._ensure_launched()
        self._check_new_module(module)
        for opt in optimizers:
            self._check_new_optimizer(opt)
        forward_module, raw_opts = self._strategy.setup_module_and_optimizers(module, list(optimizers))
        wrapped = FabricModule(forward_module, module, self._strategy)
        self._modules.append(wrapped)
        opts = [FabricOptimizer(opt, self._strategy, module) for opt in raw_opts]
        if scheduler is not None:
            return (wrapped, *opts, scheduler)
        return (wrapped, *opts) if opts else wrapped

    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> FabricModule:
        self._ensure_launched()
        self._check_new_module(module)
        forward_module = self._strategy.setup_module(module)
        wrapped = FabricModule(forward_module, module, self._strategy)
        self._modules.append(wrapped)
        return wrapped

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
        refuse_compiled(module)

    @staticmethod
    def _check_new_optimizer(optimizer: Any) -> None:
        if isinstance(optimizer, FabricOptimizer):
            raise MisconfigurationError("This optimizer was already set up; set it up once.")
        if not isinstance(optimizer, Optimizer):
            raise MisconfigurationError(f"Expected a torch.optim.Optimizer, got {type(optimizer).__name__}.")

    def _wrap_optimizer(self, optimizer: Optimizer, module: FabricModule | None) -> FabricOptimizer:
        self._check_new_optimizer(optimizer)
        owner = module.module if module is not None else None
        if owner is None:
            found = param_owner(optimizer, self._modules)
            owner = found.module if found is not None else None
        return FabricOptimizer(self._strategy.setup_optimizer(optimizer), self._strategy, owner)

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
        trainable parameter are identical on all ranks (unless inside ``no_backward_sync``)."""
        if not self._modules:
            raise MisconfigurationError(
                "fabric.backward() was called before any module was set up. Call "
                "`model, optimizer = fabric.setup(model, optimizer)` first."
            )
        targets = [model] if model is not None else self._modules
        if self._anomaly is not None:
            self._anomaly.before_backward(tensor)
        self._strategy.backward(tensor, [m._forward_module for m in targets], *args, **kwargs)
        if self._anomaly is not None:
            self._anomaly.after_backward([m.module for m in targets])

    def clip_gradients(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | None = None,
        clip_val: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        """Clip by total norm (``max_norm``, returns the norm) or by value (``clip_val``)."""
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
        return self._strategy.no_backward_sync(module._forward_module, enabled)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision's forward context, for code that runs outside the set-up model's forward."""
        return self._strategy.precision.forward_context()

    def init_module(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager[Any]:
        """Create a module directly on the device and in the precision's dtype."""
        self._ensure_launched()
        return self._strategy.init_context(empty_init)

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

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        self._ensure_launched()
        self._strategy.barrier(name or "barrier")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._ensure_launched()
        return self._strategy.broadcast(obj, src)

    def all_gather(self, data: Any, sync_grads: bool = False) -> Any:
        """Gather tensors (or a collection of them) from every rank; each gains a leading world dim."""
        self._ensure_launched()
        return apply_to_tensors(data, lambda t: self._strategy.all_gather(self._as_device_tensor(t)))

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object from every rank (index = rank), e.g. per-rank RNG states."""
        self._ensure_launched()
        return self._strategy.all_gather_object(obj)

    def all_reduce(self, data: Any, reduce_op: str = "mean") -> Any:
        """Reduce tensors or numbers (or a collection of them) across ranks: mean, sum, max, min, product."""
        self._ensure_launched()
        if isinstance(data, (int, float)):
            return self._strategy.all_reduce(self._as_device_tensor(torch.tensor(data)), reduce_op)
        return apply_to_tensors(data, lambda t: self._strategy.all_reduce(self._as_device_tensor(t), reduce_op))

    def _as_device_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if t.device != self.device else t

    @contextlib.contextmanager
    def rank_zero_first(self, local: bool = False) -> Iterator[None]:
        """Rank 0 (of the node with ``local=True``) runs the block first, e.g. to download data once."""
        self._ensure_launched()
        first = (self.local_rank if local else self.global_rank) == 0
        if not first:
            self.barrier("rank_zero_first")
        yield
        if first:
            self.barrier("rank_zero_first")

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_global_zero:
            print(*args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path, state: dict[str, Any]) -> AsyncCheckpoint | None:
        """Save ``state`` (modules, optimizers, stateful objects and plain values). Call it on every rank:
        the strategy decides who writes. The write is atomic. Returns None, or the handle of a save that
        continues in the background (``FSDPStrategy(async_save=True)``, ``ModelParallelStrategy`` too)."""
        self._ensure_launched()
        if not isinstance(state, Mapping):
            raise MisconfigurationError(f"fabric.save expects a dict of state, got {type(state).__name__}.")
        return self._strategy.save_checkpoint(path, dict(state))

    def load(
        self, path: str | Path, state: dict[str, Any] | None = None, strict: bool = True, *,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from ``path``; returns the checkpoint entries ``state`` did not ask
        for (or the whole checkpoint when ``state`` is None). Call it on every rank. ``strict=False``
        loads what matches and warns what it skipped. ``weights_only`` (None means True): open only
        tensors and plain values; pass False for a trusted file holding other objects (unpickling
        those can run code)."""
        self._ensure_launched()
        return self._strategy.load_checkpoint(path, state, strict, weights_only is not False)

    def load_raw(
        self, path: str | Path, obj: nn.Module | Optimizer, strict: bool = True, *, weights_only: bool | None = None
    ) -> None:
        """Load a plain state dict (e.g. from ``torch.save(model.state_dict())``) into one module/optimizer."""
        self._ensure_launched()
        self._strategy.load_raw_checkpoint(path, obj, strict, weights_only is not False)

    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete a checkpoint written by ``save`` (a file or a sharded directory). Call it on every rank."""
        self._ensure_launched()
        self._strategy.remove_checkpoint(path)

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
    def seed_everything(seed: int | None = None, workers: bool = False) -> int:
        return _seed_everything(seed, workers)

    def teardown(self) -> None:
        """Flush loggers and leave the process group now (otherwise both happen at interpreter exit)."""
        self._leave_job(None)

    def _leave_job(self, error: BaseException | None) -> None:
        """Finalize loggers and leave the job; ``error`` (or the exception ending the interpreter) is what
        the other ranks are told this rank ended with."""
        failed = error is not None or getattr(sys, "last_value", None) is not None
        if self.is_global_zero:
            for logger in self._loggers:
                finalize = getattr(logger, "finalize", None)
                if callable(finalize):
                    finalize("failed" if failed else "success")
        self._strategy.teardown(error)
        atexit.unregister(self.teardown)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return list(value)
    return [value]
