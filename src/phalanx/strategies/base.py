"""The strategy interface: everything that differs between backends lives behind it.

Fabric (the front end) never asks *which* strategy it has; it calls these methods and reads the
capability attributes. Each backend owns its precision choice, its sync control and its checkpoint
I/O.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.checkpoint import io as ckpt_io
from phalanx.errors import MisconfigurationError
from phalanx.launch import ClusterEnvironment, check_environment
from phalanx.precision import PRECISIONS, Precision, make_precision
from phalanx.strategies._transforms import apply_activation_checkpointing, compile_in_place

#: How the lockstep guard cross-checks collectives: names and tensor signatures, or also call sites.
LOCKSTEP_MODES = ("default", "strict")


class Strategy:
    """Base class. Subclasses override what their backend does differently."""

    name: ClassVar[str] = "base"
    #: Precision names this backend can run, on CPU and on CUDA.
    supported_precisions: ClassVar[tuple[str, ...]] = PRECISIONS
    #: Whether gradients of set-up modules are averaged across ranks in ``backward``.
    syncs_gradients: ClassVar[bool] = False
    #: Module classes whose activations are recomputed in backward (see ``strategies._transforms``).
    activation_checkpointing_policy: tuple[type[nn.Module], ...] = ()
    #: ``torch.compile`` keyword arguments, applied in place after wrapping; None: no compile.
    compile_options: dict[str, Any] | None = None

    def __init__(self) -> None:
        self.device_type = "cpu"
        self.devices = 1
        self.num_nodes = 1
        self.precision: Precision = Precision()
        self._root_device = torch.device("cpu")

    # ------------------------------------------------------------------ configuration
    def configure(self, *, device_type: str, devices: int, num_nodes: int, precision: str) -> None:
        """Called once by Fabric before anything else; validates the combination."""
        self.device_type, self.devices, self.num_nodes = device_type, devices, num_nodes
        self.precision = self.select_precision(precision)

    def select_precision(self, precision: str) -> Precision:
        if precision not in self.supported_precisions:
            raise MisconfigurationError(
                f"precision={precision!r} is not supported by strategy={self.name!r}. "
                f"It supports {', '.join(map(repr, self.supported_precisions))}."
            )
        return make_precision(precision, self.device_type)

    def set_lockstep(self, mode: str) -> None:
        """``Fabric(lockstep=...)``: how collectives are cross-checked across ranks. One process has no
        peers to compare with, so this base only validates the value (the same script must run with
        devices=1 and devices=N unchanged)."""
        if mode not in LOCKSTEP_MODES:
            raise MisconfigurationError(f"lockstep={mode!r} is not a mode; choose one of {LOCKSTEP_MODES}.")

    @property
    def num_processes(self) -> int:
        """The world size the configuration asks for."""
        return self.devices * self.num_nodes

    # ------------------------------------------------------------------ environment
    def setup_environment(self, env: ClusterEnvironment | None) -> None:
        if env is not None:
            # A job launched with N processes around a one-process strategy would train N independent
            # copies (each writing the same checkpoints), silently.
            check_environment(env, self.devices, self.num_nodes)
        if self.device_type == "cuda":
            self._root_device = torch.device("cuda", 0)
            torch.cuda.set_device(self._root_device)

    def teardown(self) -> None:
        pass

    @property
    def root_device(self) -> torch.device:
        return self._root_device

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """``num_replicas``/``rank`` for a DistributedSampler, or None when data needs no sharding."""
        return None

    # ------------------------------------------------------------------ modules
    @contextlib.contextmanager
    def init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        device_ctx = self.root_device if self.root_device.type != "cpu" else contextlib.nullcontext()
        with device_ctx, self.precision.init_context():
            yield

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move/convert/wrap ``module``; returns the module that forward runs through."""
        module = self.precision.convert_module(module)
        apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        module = module.to(self.root_device)
        compile_in_place(module, self.compile_options)
        return module

    def unwrap(self, forward_module: nn.Module) -> nn.Module:
        return forward_module

    def module_forward(self, forward_module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return forward_module(*args, **kwargs)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return optimizer

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer]
    ) -> tuple[nn.Module, list[Optimizer]]:
        """Set up a module together with its optimizers. Backends that must see both at once (FSDP
        replaces parameters, so optimizers must be re-pointed; DeepSpeed builds one engine from both)
        override this; the default sets them up independently."""
        return self.setup_module(module), [self.setup_optimizer(opt) for opt in optimizers]

    # ------------------------------------------------------------------ backward and steps
    def backward(self, loss: torch.Tensor, modules: list[nn.Module], *args: Any, **kwargs: Any) -> None:
        self.precision.pre_backward(loss).backward(*args, **kwargs)

    def no_backward_sync(self, forward_module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def check_ready_to_step(self, optimizer: Optimizer) -> None:
        """Raise before an optimizer step that would make ranks diverge."""

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        self.check_ready_to_step(optimizer)
        return self.precision.optimizer_step(optimizer, **kwargs)

    def optimizer_zero_grad(self, optimizer: Optimizer, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()``; backends that keep gradients outside ``p.grad`` (DeepSpeed) override it."""
        optimizer.zero_grad(set_to_none=set_to_none)

    def clip_gradients(
        self,
        optimizer: Optimizer,
        max_norm: float | None,
        clip_val: float | None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if clip_val is not None:
            torch.nn.utils.clip_grad_value_(params, clip_val)
            return None
        assert max_norm is not None
        return torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    # ------------------------------------------------------------------ collectives (single process)
    def barrier(self, name: str = "barrier") -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(0)

    def all_gather_object(self, obj: Any, name: str = "all_gather_object") -> list[Any]:
        return [obj]

    def collectives_issued(self) -> int:
        """How many collectives this process has issued so far (always 0 on one process). Lets callers
        tell whether a stretch of user code communicated with the other ranks."""
        return 0

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return tensor.clone()

    def verify_in_sync(
        self, named: list[tuple[str, torch.Tensor]], what: str, rtol: float = 1e-5, atol: float = 0.0
    ) -> None:
        """Raise naming the first tensor that differs across ranks (a no-op on one process)."""

    # ------------------------------------------------------------------ state and checkpoints
    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return module.state_dict()

    def load_module_state_dict(self, module: nn.Module, state: dict[str, Any], strict: bool) -> None:
        ckpt_io.load_module_state(module, state, strict)

    def optimizer_state_dict(self, module: nn.Module | None, optimizer: Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, module: nn.Module | None, optimizer: Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def save_checkpoint(self, path: str | Path, state: dict[str, Any]) -> Any:
        """Write ``state``; returns None, or a handle where the write continues in the background."""
        with self._checkpoint_op("save"):
            full = ckpt_io.collect_state(state, self)
            if self.is_global_zero:
                ckpt_io.atomic_save(full, Path(path))

    def load_checkpoint(self, path: str | Path, state: dict[str, Any] | None, strict: bool) -> dict[str, Any]:
        with self._checkpoint_op("load"):
            ckpt = ckpt_io.read_checkpoint(Path(path))
            if state is None:
                return ckpt_io.strip_meta(ckpt)
            return ckpt_io.apply_state(state, ckpt, self, strict)

    @contextlib.contextmanager
    def _checkpoint_op(self, name: str) -> Iterator[None]:
        """Brackets a save/load so every rank enters and leaves it together (parallel strategies)."""
        yield
