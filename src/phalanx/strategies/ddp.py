"""Data-parallel training with torch's DistributedDataParallel, made safe on every call path.

The failure this file exists to prevent: DDP averages gradients only when its own ``forward`` armed
the reducer. A user who calls a submodule directly (``model.student(x)`` in distillation, a custom
method, a reference kept from before ``setup``) gets per-rank gradients and silently diverging
replicas. phalanx records whether each DDP module's forward ran with gradient sync since the last
backward. If it did not, but trainable parameters received gradients, phalanx averages those
gradients itself right after ``backward`` (one coalesced all-reduce) and says so once. Either way,
after ``fabric.backward`` every trainable gradient is identical on all ranks.

A second way to diverge: calling ``optimizer.step()`` after a backward that ran inside
``no_backward_sync``. phalanx raises before such a step instead of letting ranks drift apart.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from phalanx.strategies._transforms import apply_activation_checkpointing, check_compile, check_policy, compile_in_place
from phalanx.strategies.parallel import ParallelStrategy, local_gradients_stepped
from phalanx.utils.diagnostics import warn
from phalanx.utils.errors import GradientSyncError


@dataclass
class _SyncState:
    """Per-module bookkeeping of whether gradients are (or will be) averaged."""

    name: str
    params: list[tuple[str, nn.Parameter]]
    param_ids: frozenset[int]
    armed: bool = False  # DDP's forward ran with grad sync since the last backward
    local_only: bool = False  # grads accumulated under no_backward_sync, not yet averaged
    warned: bool = False
    optimizers: dict[int, bool] = field(default_factory=dict)


class DDPStrategy(ParallelStrategy):
    """One process per device; parameters replicated; gradients averaged by DDP.

    Args:
        find_unused_parameters, broadcast_buffers, gradient_as_bucket_view, static_graph,
            bucket_cap_mb: passed to ``DistributedDataParallel``.
        verify_sync: after every synchronized backward, check that gradients agree across ranks and
            raise naming the first parameter that differs (costs one small all-gather per step).
        activation_checkpointing_policy: set of module classes whose activations are recomputed in
            backward instead of stored (applied before DDP wraps the module).
        compile: ``True`` or a dict of ``torch.compile`` arguments: the DDP-wrapped module is compiled in
            place, so torch's DDP-aware compiler splits the graph at gradient buckets.
        Other arguments: see :class:`~phalanx.strategies.parallel.ParallelStrategy`.
    """

    name: ClassVar[str] = "ddp"
    syncs_gradients: ClassVar[bool] = True

    def __init__(
        self,
        *,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        bucket_cap_mb: float | None = None,
        verify_sync: bool = False,
        activation_checkpointing_policy: set[type[nn.Module]] | None = None,
        compile: bool | dict[str, Any] = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.activation_checkpointing_policy = check_policy(activation_checkpointing_policy)
        self.compile_options = check_compile(compile)
        self.ddp_kwargs: dict[str, Any] = {
            "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
        }
        if not broadcast_buffers:  # passing the default warns on newer torch (renamed argument)
            self.ddp_kwargs["broadcast_buffers"] = False
        if bucket_cap_mb is not None:
            self.ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        self.verify_sync = verify_sync
        self._sync: dict[int, _SyncState] = {}

    # ------------------------------------------------------------------ modules
    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self.precision.convert_module(module).to(self.root_device)
        apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not trainable:
            # Nothing to average (a frozen teacher): DDP would refuse to wrap it anyway.
            compile_in_place(module, self.compile_options)
            return module
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        with self.guard.guarded("setup_module (DDP broadcasts rank 0's parameters)"):
            ddp = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        compile_in_place(ddp, self.compile_options)
        self._sync[id(ddp)] = _SyncState(
            name=type(module).__name__, params=trainable, param_ids=frozenset(id(p) for _, p in trainable)
        )
        return ddp

    def unwrap(self, forward_module: nn.Module) -> nn.Module:
        return forward_module.module if isinstance(forward_module, DistributedDataParallel) else forward_module

    def module_forward(self, forward_module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self._sync.get(id(forward_module))
        if state is None:
            return forward_module(*args, **kwargs)
        ddp: DistributedDataParallel = forward_module  # type: ignore[assignment]
        arming = torch.is_grad_enabled() and ddp.require_backward_grad_sync
        # DDP's forward may itself communicate (bucket rebuild on the second iteration, buffer
        # broadcast): take a sequence number so peers waiting elsewhere see where this rank went.
        if arming or ddp.will_sync_module_buffers():
            state.armed = state.armed or arming
            with self.guard.unguarded("forward (DDP)"):
                return ddp(*args, **kwargs)
        return ddp(*args, **kwargs)

    def no_backward_sync(self, forward_module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        if enabled and isinstance(forward_module, DistributedDataParallel):
            return forward_module.no_sync()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor, modules: list[nn.Module], *args: Any, **kwargs: Any) -> None:
        states = [(m, self._sync[id(m)]) for m in modules if id(m) in self._sync]
        scaled = self.precision.pre_backward(loss)
        if any(s.armed for _, s in states):
            with self.guard.unguarded("backward (DDP gradient all-reduce)"):
                scaled.backward(*args, **kwargs)
        else:
            scaled.backward(*args, **kwargs)
        for ddp, state in states:
            assert isinstance(ddp, DistributedDataParallel)
            if state.armed:
                pass  # DDP's reducer averaged every gradient this backward produced
            elif ddp.require_backward_grad_sync:
                self._average_bypassed_grads(state)
            elif any(p.grad is not None for _, p in state.params):
                state.local_only = True
                continue
            state.armed = False
            state.local_only = False
        if self.verify_sync and states and not any(s.local_only for _, s in states):
            named = [(f"{s.name}.{n}.grad", p.grad) for _, s in states for n, p in s.params if p.grad is not None]
            self.verify_in_sync(named, "gradients")

    def _average_bypassed_grads(self, state: _SyncState) -> None:
        """Average the grads that DDP's reducer never saw (its forward was bypassed)."""
        params = [p for _, p in state.params]
        # Which parameters got a gradient can differ per rank (data-dependent paths): agree first.
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=self.root_device)
        has_grad = self.collectives.all_reduce(has_grad, "max", name="gradient presence (bypassed DDP forward)")
        if not bool(has_grad.any()):
            return
        grads = []
        for p, present in zip(params, has_grad.tolist()):
            if present:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        self.collectives.all_reduce_grads(grads, name="gradient all-reduce (bypassed DDP forward)")
        if not state.warned:
            state.warned = True
            warn(
                f"Gradients of {state.name} were computed without going through its DDP forward "
                "(a submodule or method was called directly, e.g. model.student(x)). phalanx averaged them "
                "across ranks after backward, so training stays correct, but communication no longer overlaps "
                "with backward. For overlap, call the set-up model itself or set up the submodule separately.",
                rank=self.global_rank,
            )

    def check_ready_to_step(self, optimizer: Optimizer) -> None:
        name = local_gradients_stepped(self._sync.values(), optimizer)
        if name is not None:
            raise GradientSyncError(
                f"optimizer.step() was called while the gradients of {name} are local to each rank: "
                "the last backward ran inside fabric.no_backward_sync(...), so stepping now would make the "
                "replicas diverge. Run the last backward of each accumulation window with sync enabled, "
                "e.g. `with fabric.no_backward_sync(model, enabled=not is_last_micro_batch):`."
            )

    # ------------------------------------------------------------------ state
    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return self.unwrap(module).state_dict()
