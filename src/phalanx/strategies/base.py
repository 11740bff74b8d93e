"""The strategy interface: everything that differs between backends lives behind it.

Fabric (the front end) never asks *which* strategy it has; it calls these methods and reads the
capability attributes. Each backend owns its precision choice, its sync control and its checkpoint
I/O.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx import checkpoint
from phalanx.checkpoint.protocol import MODULE, Shapes, ShardIO, plain_shapes
from phalanx.checkpoint.snapshot import load_module_local, load_optimizer_local
from phalanx.distributed.launch import ClusterEnvironment, check_environment
from phalanx.distributed.replica_groups import FaultTolerance, GroupEnvironment, ReplicaGroups, environment
from phalanx.precision import PRECISIONS, Precision, make_precision
from phalanx.strategies._transforms import apply_activation_checkpointing, compile_in_place
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.late_reads import LateRead

if TYPE_CHECKING:
    from phalanx.checkpoint.async_sharded import AsyncCheckpoint

T = TypeVar("T")

#: How the lockstep guard cross-checks collectives: names and tensor signatures, or also call sites.
LOCKSTEP_MODES = ("default", "strict")


class Strategy:
    """Base class. Subclasses override what their backend does differently."""

    name: ClassVar[str] = "base"
    #: Precision names this backend can run, on CPU and on CUDA.
    supported_precisions: ClassVar[tuple[str, ...]] = PRECISIONS
    #: Whether gradients of set-up modules are averaged across ranks in ``backward``.
    syncs_gradients: ClassVar[bool] = False
    #: Whether evaluation may run under ``torch.inference_mode``. Backends that gather parameters into
    #: buffers they reuse in training must say False: a buffer first filled in inference mode cannot be
    #: updated in place afterwards (the Trainer then evaluates under ``torch.no_grad``).
    supports_inference_mode: ClassVar[bool] = True
    #: Whether a set-up module's own methods may run outside the strategy's forward, with the gradients
    #: they produce still synchronized by ``backward`` (manual optimization relies on it). Sharding
    #: backends need their forward to gather parameters, so they say False.
    supports_calls_outside_forward: ClassVar[bool] = True
    #: Whether optimizers can be set up after (and apart from) their module. The tuners need it: they
    #: build a throwaway optimizer for their search, then the fit builds the real one.
    sets_up_optimizers_separately: ClassVar[bool] = True
    #: Module classes whose activations are recomputed in backward (see ``strategies._transforms``).
    activation_checkpointing_policy: tuple[type[nn.Module], ...] = ()
    #: ``torch.compile`` keyword arguments, applied in place after wrapping; None: no compile.
    compile_options: dict[str, Any] | None = None
    #: Whether this backend can be one replica group of a fault-tolerant job (``fault_tolerance=``): its
    #: gradients after backward are this rank's part of the group's average (whole, or a shard's local part) and
    #: its ``local_state`` is what the rank with its number in another group holds.
    supports_replica_groups: ClassVar[bool] = True

    def __init__(self) -> None:
        self.device_type = "cpu"
        self.devices = 1
        self.num_nodes = 1
        self.precision: Precision = Precision()
        self._root_device = torch.device("cpu")
        self.fault_tolerance: FaultTolerance | None = None
        self._group_env: GroupEnvironment | None = None
        #: This process's part of the fault-tolerant job, once launched (None without ``fault_tolerance``).
        self.replica_groups: ReplicaGroups | None = None
        self._averaged: set[int] = set()  # optimizers whose gradients were averaged across groups this step

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

    def set_fault_tolerance(self, config: FaultTolerance) -> None:
        """``fault_tolerance=``: this job is one of several replica groups (torchft), checked before any process
        starts: the backend, torchft and the environment naming the lighthouse and this group."""
        if not self.supports_replica_groups:
            raise MisconfigurationError(
                f"fault_tolerance is not supported with strategy={self.name!r}: a replica group runs one device, "
                "'ddp' or 'fsdp' inside (FSDP inside with torchft across groups is HSDP)."
            )
        from phalanx.distributed.replica_groups import require_torchft

        require_torchft()
        self._group_env = environment(config)
        self.fault_tolerance = config

    def start_replica_groups(self, log_folder: Path | None) -> None:
        """Join the fault-tolerant job (after ``setup_environment``): torchft's manager for this process. A no-op
        without ``fault_tolerance``."""
        if self.fault_tolerance is None or self._group_env is None or self.replica_groups is not None:
            return
        self.replica_groups = ReplicaGroups(self.fault_tolerance, self._group_env, self.global_rank, self.world_size,
                                            self.root_device, self.broadcast, log_folder)

    def share_state_with_groups(self, state: dict[str, Any] | Callable[[], dict[str, Any]],
                                on_heal: Callable[[dict[str, Any]], None] | None = None) -> None:
        """``state`` (or the dict a function builds) is what this group sends a group that (re)joins, and what it
        receives in place when it is the one behind (checked first: :mod:`phalanx.checkpoint.peer`), after which
        ``on_heal(state)`` runs. A no-op without replica groups."""
        groups = self.replica_groups
        if groups is None:
            return
        from phalanx.checkpoint import peer

        def build() -> dict[str, Any]:
            return state() if callable(state) else state

        def receive(payload: dict[str, Any]) -> None:
            target = build()
            peer.apply(self, target, payload, f"replica group {payload.get('replica_group', '?')}")
            if on_heal is not None:
                on_heal(target)

        groups.sent = lambda: peer.build(self, build(), self.local_state)
        groups.received = receive

    def stop_replica_groups(self, failed: bool) -> None:
        """Leave the fault-tolerant job: torchft's manager stops; the count of what was trained is said once."""
        groups, self.replica_groups = self.replica_groups, None
        if groups is not None:
            groups.close(failed)

    def train_sampler_kwargs(self) -> dict[str, int] | None:
        """:meth:`distributed_sampler_kwargs` for training data: with replica groups, each group reads its own
        shard (split as ``torchft.DistributedSampler`` does: shard ``rank + ranks_per_group * group``)."""
        kwargs = self.distributed_sampler_kwargs()
        env = self._group_env
        if env is None:
            return kwargs
        within = kwargs or {"num_replicas": 1, "rank": 0}
        n = int(within["num_replicas"])
        return {"num_replicas": n * env.groups, "rank": int(within["rank"]) + n * env.group}

    def average_across_groups(self, optimizer: Optimizer) -> None:
        """Average the gradients ``optimizer`` steps with across the replica groups taking part in this step (once
        per step: the first of ``clip_gradients`` and ``optimizer_step`` does it). A no-op without replica groups."""
        if self.replica_groups is None or id(optimizer) in self._averaged:
            return
        grads = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    to_local = getattr(p.grad, "to_local", None)
                    grads.append(to_local() if callable(to_local) else p.grad)
        self.replica_groups.average(grads)
        self._averaged.add(id(optimizer))

    @property
    def num_processes(self) -> int:
        """The world size the configuration asks for."""
        return self.devices * self.num_nodes

    # ------------------------------------------------------------------ environment
    def job_environment(self, env: ClusterEnvironment | None) -> ClusterEnvironment | None:
        """The launched job this strategy belongs to, given the one detected (``env``): None when it runs on
        its own. Fabric asks before reporting ranks and before ``setup_environment``."""
        return env

    def setup_environment(self, env: ClusterEnvironment | None) -> None:
        if env is not None:
            # A job launched with N processes around a one-process strategy would train N independent
            # copies (each writing the same checkpoints), silently.
            check_environment(env, self.devices, self.num_nodes)
        if self.device_type == "cuda":
            self._root_device = torch.device("cuda", 0)
            torch.cuda.set_device(self._root_device)

    def teardown(self, error: BaseException | None = None) -> None:
        """Leave the job; ``error`` is what ended this rank's work, if anything."""

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

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> float | None:
        self.check_ready_to_step(optimizer)
        if self.replica_groups is not None:
            self.average_across_groups(optimizer)
            self._averaged.discard(id(optimizer))
            if not self.replica_groups.commit():  # torchft's should_commit: the groups did not agree on this step
                return None
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
        self.average_across_groups(optimizer)  # clipping must see the gradients every group steps with
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

    def broadcast(self, obj: T, src: int = 0) -> T:
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

    def max_across_ranks(self, values: list[int], name: str) -> list[int]:
        """Element-wise maximum of a few integers over every rank of the job: a per-step agreement (e.g. on
        a preemption stop), cheap enough to run each step. The values themselves on one process."""
        return list(values)

    def max_across_ranks_late(self, values: list[int], name: str) -> LateRead:
        """:meth:`max_across_ranks`, started now and read later (:class:`phalanx.utils.late_reads.LateRead`): a
        collective every rank starts at the same point, whose value is read a step or more later without
        making the device wait. The values themselves on one process."""
        return LateRead(torch.tensor(values, dtype=torch.int64))

    def verify_in_sync(
        self, named: list[tuple[str, torch.Tensor]], what: str, rtol: float = 1e-5, atol: float = 0.0
    ) -> None:
        """Raise naming the first tensor that differs across ranks (a no-op on one process)."""

    # ------------------------------------------------------------------ state and checkpoints
    #: phalanx.checkpoint.protocol.StateOwner: single-file loads read the file on every rank.
    loads_full_state_on_rank0: ClassVar[bool] = False

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The module's full (unsharded) state dict, on every rank."""
        return module.state_dict()

    def load_module_state_dict(self, module: nn.Module, state: dict[str, Any], strict: bool) -> None:
        module.load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, module: nn.Module | None, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's full state in torch's index-keyed layout, on every rank."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, module: nn.Module | None, optimizer: Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    # The checkpoint layer's view (phalanx.checkpoint.protocol.StateOwner); backends override what differs.
    def checkpoint_shards(self, layout: str | None = None) -> ShardIO | None:
        return None

    def gather_module_state(self, module: nn.Module) -> dict[str, Any]:
        return self.module_state_dict(module)

    def gather_optimizer_state(self, module: nn.Module | None, optimizer: Optimizer) -> dict[str, Any]:
        return self.optimizer_state_dict(module, optimizer)

    def scatter_module_state(self, module: nn.Module, state: dict[str, Any], strict: bool, from_rank0: bool) -> None:
        self.load_module_state_dict(module, state, strict)

    def scatter_optimizer_state(
        self, module: nn.Module | None, optimizer: Optimizer, state: dict[str, Any], from_rank0: bool
    ) -> None:
        self.load_optimizer_state_dict(module, optimizer, state)

    def module_layout(self, module: nn.Module) -> tuple[str, Shapes]:
        return type(module).__name__, plain_shapes(module)

    def local_state(self, kind: str, obj: Any, module: nn.Module | None) -> dict[str, Any]:
        return obj.state_dict()  # type: ignore[no-any-return]

    def load_local_state(self, kind: str, obj: Any, saved: dict[str, Any], strict: bool) -> None:
        if kind == MODULE:
            load_module_local(obj, self.local_state(MODULE, obj, None), saved, strict)
        else:
            load_optimizer_local(obj, saved)

    def release_module(self, forward_module: nn.Module) -> None:
        """Free what setup built for a module the caller no longer uses (see ``Fabric.release``)."""

    def save_checkpoint(self, path: str | Path, state: dict[str, Any]) -> AsyncCheckpoint | None:
        """Write ``state``; returns None, or the handle of a write that continues in the background."""
        checkpoint.save(self, path, state)
        return None

    def load_checkpoint(
        self, path: str | Path, state: dict[str, Any] | None, strict: bool, weights_only: bool = True
    ) -> dict[str, Any]:
        return checkpoint.load(self, path, state, strict, weights_only)

    def load_raw_checkpoint(self, path: str | Path, obj: Any, strict: bool, weights_only: bool = True) -> None:
        checkpoint.load_raw(self, path, obj, strict, weights_only)

    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete a checkpoint (file or directory). Call it on every rank; rank 0 deletes."""
        checkpoint.remove(self, path)

    def _local_tensors(self, module: nn.Module) -> list[torch.Tensor]:
        """This rank's part of every parameter and buffer (a DTensor's local shard)."""
        out = []
        for t in (*module.parameters(), *module.buffers()):
            to_local = getattr(t, "to_local", None)
            out.append(to_local() if callable(to_local) else t)
        return out

    def weights_finite(self, module: nn.Module) -> bool:
        """Whether every floating-point parameter and buffer of ``module`` is finite on every rank (one
        collective; every rank gets the same answer)."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in self._local_tensors(module):
            if t.is_floating_point() and t.numel() > 0:
                by_device.setdefault(t.device, []).append(torch.isfinite(t.detach()).all())
        local = all(bool(torch.stack(checks).all()) for checks in by_device.values())  # one sync per device
        flag = torch.tensor([1.0 if local else 0.0], device=self.root_device)
        return bool(self.all_reduce(flag, "min").item() > 0)
