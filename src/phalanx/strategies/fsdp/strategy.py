"""Fully sharded data parallelism on torch's FSDP2 (``fully_shard`` over a 1-D DeviceMesh, or a 2-D one
``(replicate, shard)`` for hybrid sharding).

Every rank keeps only its shard of each parameter, gradient and optimizer state; a sharded unit's
parameters are all-gathered just before its forward and backward, and its gradients are
reduce-scattered after backward. What this file adds on top of FSDP2 is the part that makes it
hard to misuse:

* FSDP2 replaces parameters with new DTensor parameters, so an optimizer built before ``setup``
  would update tensors nobody uses. ``setup(model, optimizer)`` re-points the optimizer at the
  sharded parameters by name; ``setup_optimizers`` refuses an optimizer holding pre-sharding ones.
* Calling a child directly (``model.student(x)``) is fine when the child is its own sharded unit:
  FSDP's hooks live on that unit and reduce its gradients. A child whose parameters belong to an
  enclosing unit would run on sharded (or never reduced) parameters, so phalanx raises instead, naming
  the class of the module that was called (the one to make a unit: naming an inner layer instead can
  split tied weights, e.g. GPT-2's embedding and output head, across units).
* A bare container as the model (``nn.ModuleDict({"teacher": ..., "student": ...})``, a distillation
  setup) has no forward, which ``fully_shard`` refuses: phalanx shards each child as its own unit
  and leaves the container itself unsharded (it holds no parameters), so its children are called
  directly, as they must be.
* Gradient accumulation skips the reduce-scatter (``set_requires_gradient_sync(False)``), and an
  optimizer step after such a backward raises, exactly as under DDP.
* Gradient clipping measures the norm over all shards of all ranks, not of the local shard (torch's
  own norm functions on DTensor gradients), and 16-mixed skips a step on every rank when any shard
  overflowed (torch's GradScaler reduces its found-inf flag over the mesh).

This module keeps the :class:`FSDPStrategy` class and its base :class:`ShardedStrategy` (setup, sharding,
the optimizer, forward, backward and the step), which ModelParallelStrategy shares without being an
FSDPStrategy. Its parts live beside it: ``sharding`` (Lightning's ``sharding_strategy`` and
``device_mesh`` mapped onto FSDP2's mesh and ``reshard_after_forward``), ``units`` (the sharding policy,
read from the module tree),
``guards`` (the call-order guards and their hooks), ``gradients`` (norms and averages across shards),
``precision`` (mixed precision on DTensors, shared with ModelParallelStrategy) and ``checkpoint`` (the
base class answering the checkpoint layer: :mod:`phalanx.checkpoint` and :mod:`phalanx.checkpoint.dcp`).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.optim import Optimizer

import phalanx.strategies.fsdp.guards as guards
from phalanx.checkpoint.dcp import class_name
from phalanx.distributed.launch import ClusterEnvironment
from phalanx.precision import PRECISIONS, MixedPrecision, Precision
from phalanx.strategies._transforms import apply_activation_checkpointing, check_compile, check_policy, compile_in_place
from phalanx.strategies.fsdp.checkpoint import FSDPCheckpointing
from phalanx.strategies.fsdp.gradients import (
    all_reduce_averages,
    clip_grad_norm,
    is_sharded,
    local_tensor,
    reduce_scatter_averages,
)
from phalanx.strategies.fsdp.guards import CallOrder, Root
from phalanx.strategies.fsdp.materialize import materialize_sharded
from phalanx.strategies.fsdp.precision import FSDPMixedPrecision, ShardedMixedPrecision
from phalanx.strategies.fsdp.sharding import (
    HYBRID_MESH_DIMS,
    broadcast_replicas,
    check_fsdp1_options,
    check_mesh_object,
    mesh_shape,
    resolve_sharding,
)
from phalanx.strategies.fsdp.units import (
    is_bare_container,
    is_default_unit,
    list_elements,
    outermost_units,
    tied_weights_hint,
)
from phalanx.strategies.parallel import local_gradients_stepped
from phalanx.utils.compat import FSDP_ON_CPU, CPUOffloadPolicy, FSDPModule, fully_shard
from phalanx.utils.diagnostics import info
from phalanx.utils.errors import GradientSyncError, MisconfigurationError
from phalanx.utils.tensors import is_metric


class ShardedStrategy(FSDPCheckpointing):
    """What :class:`FSDPStrategy` and :class:`~phalanx.strategies.model_parallel.ModelParallelStrategy` share:
    setup, sharding, the optimizer, forward, backward, the step and (through :class:`FSDPCheckpointing`)
    checkpoints. Neither strategy is a subclass of the other, as in Lightning: scripts tell them apart with
    ``isinstance`` (LitGPT's ``load_checkpoint`` takes its FSDP branch for ``FSDPStrategy`` only). The
    arguments are :class:`FSDPStrategy`'s.
    """

    syncs_gradients: ClassVar[bool] = True
    supports_inference_mode: ClassVar[bool] = False  # fully_shard reuses its all-gather buffers
    supports_calls_outside_forward: ClassVar[bool] = False  # parameters are gathered by the forward
    supported_precisions: ClassVar[tuple[str, ...]] = PRECISIONS

    def __init__(
        self,
        *,
        auto_wrap_policy: set[type[nn.Module]] | None = None,
        parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module | None] | None = None,
        reshard_after_forward: bool | None = None,
        cpu_offload: bool = False,
        activation_checkpointing_policy: set[type[nn.Module]] | None = None,
        state_dict_type: str = "sharded",
        compile: bool | dict[str, Any] = False,
        async_save: bool = False,
        sharding_strategy: Any = None,
        device_mesh: tuple[int, ...] | DeviceMesh | None = None,
        limit_all_gathers: bool = True,
        use_orig_params: bool = True,
        **kwargs: Any,
    ) -> None:
        note = check_fsdp1_options(limit_all_gathers, use_orig_params, kwargs)
        super().__init__(state_dict_type=state_dict_type, async_save=async_save, **kwargs)
        self._sharding = resolve_sharding(sharding_strategy, reshard_after_forward, device_mesh)
        #: Lightning's FSDP1 arguments, as given: FSDP2 behaves as both set to True (check_fsdp1_options).
        self.limit_all_gathers = limit_all_gathers
        self.use_orig_params = use_orig_params
        if note is not None:
            info(note, rank=int(os.environ.get("RANK", "0")))
        self.compile_options = check_compile(compile)
        hint = " For custom logic pass parallelize_fn=fn(module, mesh) and call fully_shard yourself."
        wrap_classes = check_policy(auto_wrap_policy, "auto_wrap_policy", hint)
        self.activation_checkpointing_policy = check_policy(activation_checkpointing_policy, hint=hint)
        if auto_wrap_policy is not None and parallelize_fn is not None:
            raise MisconfigurationError("Pass auto_wrap_policy or parallelize_fn, not both.")
        self.auto_wrap_policy = wrap_classes if auto_wrap_policy is not None else None
        self.parallelize_fn = parallelize_fn
        self.reshard_after_forward = self._sharding.reshard_after_forward
        #: Lightning's name of the sharding asked for (upper case), or None.
        self.sharding_strategy = self._sharding.strategy
        self.cpu_offload = cpu_offload
        self._mesh_shape: tuple[int, ...] | None = None
        self._mesh: DeviceMesh | None = None
        self._calls = CallOrder()  # the set-up roots and the call-order guards (guards.py)
        self._stale: dict[int, weakref.ref[nn.Parameter]] = {}

    # ------------------------------------------------------------------ configuration
    def configure(self, *, device_type: str, devices: int, num_nodes: int, precision: str) -> None:
        if device_type == "cpu" and not FSDP_ON_CPU:
            raise MisconfigurationError(
                f"strategy='fsdp' on CPU needs torch >= 2.7 (torch {torch.__version__}'s FSDP2 cannot run on CPU). "
                "Upgrade torch, or use strategy='ddp' on CPU."
            )
        # The mesh shape is checked here, before any process starts: a wrong size fails at Fabric(...).
        self._mesh_shape = mesh_shape(self._sharding, devices, num_nodes)
        super().configure(device_type=device_type, devices=devices, num_nodes=num_nodes, precision=precision)

    def setup_environment(self, env: ClusterEnvironment | None) -> None:
        super().setup_environment(env)
        if self.world_size > 1 and dist.get_backend() == "gloo":
            with self.guard.guarded("FSDP gradient-average check (gloo reduce-scatter)"):
                averages = reduce_scatter_averages(self.world_size)
            if not averages:
                raise MisconfigurationError(
                    f"strategy='fsdp' on gloo (CPU) needs a torch whose gloo reduce-scatter averages: torch "
                    f"{torch.__version__}'s sums instead, so FSDP2's gradients would be {self.world_size}x too "
                    "large. Upgrade torch (2.13 is known good), or use strategy='ddp' on CPU."
                )
            if self._sharding.hybrid:  # replicas average their gradients with an all-reduce
                with self.guard.guarded("FSDP gradient-average check (gloo all-reduce)"):
                    averages = all_reduce_averages(self.world_size)
                if not averages:
                    raise MisconfigurationError(
                        f"Hybrid sharding on gloo (CPU) needs a torch whose gloo all-reduce averages (ReduceOp.AVG); "
                        f"torch {torch.__version__}'s does not. Upgrade torch (2.13 is known good), or use "
                        "sharding_strategy='FULL_SHARD' on CPU."
                    )
        if self._sharding.hybrid:
            shape = self._mesh_shape or ()
            with self.guard.guarded(f"setup_environment (hybrid device mesh {' x '.join(map(str, shape))})"):
                self._init_mesh()

    def select_precision(self, precision: str) -> Precision:
        plugin = super().select_precision(precision)
        if isinstance(plugin, MixedPrecision):  # FSDP2 casts itself (MixedPrecisionPolicy), no autocast
            return FSDPMixedPrecision(plugin.dtype, self.device_type, self.guarded)
        return plugin

    # ------------------------------------------------------------------ mesh and modules
    @property
    def mesh(self) -> DeviceMesh:
        """The device mesh parameters are sharded over: 1-D over every rank, or 2-D ``(replicate, shard)``
        for hybrid sharding (created on first use, or at launch for a hybrid one)."""
        if self._mesh is None:
            self._init_mesh()
        assert self._mesh is not None
        return self._mesh

    def _init_mesh(self) -> None:
        given = self._sharding.device_mesh
        if isinstance(given, DeviceMesh):
            check_mesh_object(given, self.root_device.type)
            self._mesh = given
        elif self._mesh_shape is not None and len(self._mesh_shape) == 2:
            self._mesh = init_device_mesh(self.root_device.type, self._mesh_shape, mesh_dim_names=HYBRID_MESH_DIMS)
        else:
            self._mesh = init_device_mesh(self.root_device.type, (self.world_size,))

    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        # Every rank is a data-parallel rank, hybrid meshes too (replicas and shards both see their own
        # samples): split by global rank.
        return super().distributed_sampler_kwargs()

    @contextlib.contextmanager
    def init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``empty_init=True`` creates parameters on the meta device (no memory); ``setup`` shards
        them, allocates this rank's shards and fills them with the values one process would give the
        model (``reset_parameters`` module by module, see :mod:`phalanx.strategies.fsdp.materialize`)."""
        if not empty_init:
            with super().init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision.init_context():
            yield

    def setup_module(self, module: nn.Module) -> nn.Module:
        if id(module) in self._calls.roots:
            raise MisconfigurationError(f"This module was already set up with {type(self).__name__}; set it up once.")
        tensors = [*module.parameters(), *module.buffers()]
        on_meta = [t.is_meta for t in tensors]
        if any(on_meta) and not all(on_meta):
            raise MisconfigurationError(
                f"{type(module).__name__} is partly on the meta device. Create the whole model inside "
                "fabric.init_module(empty_init=True), or none of it."
            )
        originals = {id(p): weakref.ref(p) for p in module.parameters()}
        module = self.precision.convert_module(module)
        apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        tied = tied_weights_hint(module)  # before sharding: fully_shard replaces (and so unties) parameters
        with self.guard.guarded(f"setup_module ({type(self).__name__} sharding)"):
            self._shard(module)
            if any(on_meta):
                self._materialize(module)
            self._after_sharding(module)
            # The model, or a bare container's children (none: tensor parallelism alone, no FSDP root).
            units = outermost_units(module)
            try:
                # Every outermost unit becomes its own root.
                root_ready = all([guards.decide_root_now(unit) for unit in units])
            except (RuntimeError, ValueError) as err:
                raise MisconfigurationError(
                    f"FSDP could not set up {class_name(module)}: {str(err).rstrip('.')}. {tied}"
                ) from err
        # Metric state (torchmetrics) is neither parameter nor buffer, so fully_shard does not move it;
        # it must live where the backend reduces, or its sync across ranks fails.
        for sub in module.modules():
            if is_metric(sub):
                sub.to(self.root_device)
        # Stale: the parameters sharding replaced (an optimizer holding one would update nothing). A module
        # that arrives parallelized already (ModelParallelStrategy without parallelize_fn) keeps its own.
        kept = {id(p) for p in module.parameters()}
        self._stale.update({key: ref for key, ref in originals.items() if key not in kept})
        self._calls.install(module, units, root_ready, self._state_dict_hint)
        compile_in_place(module, self.compile_options)
        return module

    def _shard(self, module: nn.Module) -> None:
        kwargs: dict[str, Any] = {"mesh": self.mesh, "reshard_after_forward": self.reshard_after_forward}
        if isinstance(self.precision, FSDPMixedPrecision):
            kwargs["mp_policy"] = self.precision.policy()
        if self.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
        if self.parallelize_fn is not None:
            out = self.parallelize_fn(module, self.mesh)
            if out is not None and out is not module:
                raise MisconfigurationError(
                    "parallelize_fn must modify the module in place (fully_shard does) and return it or None."
                )
        else:
            classes = self.auto_wrap_policy
            in_lists = list_elements(module)
            # Children before parents: fully_shard must see inner units first.
            for sub in reversed(list(module.modules())):
                if sub is module or isinstance(sub, FSDPModule) or not any(True for _ in sub.parameters()):
                    continue
                chosen = isinstance(sub, classes) if classes is not None else is_default_unit(sub, in_lists)
                if chosen:
                    fully_shard(sub, **kwargs)
        if is_bare_container(module):
            self._shard_children(module, kwargs)
        elif not isinstance(module, FSDPModule):
            fully_shard(module, **kwargs)

    def _shard_children(self, container: nn.Module, kwargs: dict[str, Any]) -> None:
        """A container without forward cannot be a unit: each child with parameters becomes one (nested
        bare containers likewise), so every parameter is sharded and every child can be called."""
        for child in container.children():
            if isinstance(child, FSDPModule) or not any(True for _ in child.parameters()):
                continue
            if is_bare_container(child):
                self._shard_children(child, kwargs)
            else:
                fully_shard(child, **kwargs)

    def _after_sharding(self, module: nn.Module) -> None:
        """The module is sharded (and materialized), FSDP's root not yet decided: a hybrid mesh's replicas
        take the first replica's values. Subclasses replace this step."""
        broadcast_replicas(module, self.mesh)

    def _materialize(self, module: nn.Module) -> None:
        # The values one process would draw, every rank keeping its slice (fsdp/materialize.py).
        materialize_sharded(module, self.root_device)

    # ------------------------------------------------------------------ optimizers
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer]
    ) -> tuple[nn.Module, list[Optimizer]]:
        for opt in optimizers:
            if any(len(s) > 0 for s in opt.state.values()):
                raise MisconfigurationError(
                    f"{type(opt).__name__} already has state (it has stepped or loaded a state dict), so phalanx "
                    "cannot move it to the sharded parameters. Set up the model first and create the optimizer "
                    "from its parameters: `model = fabric.setup_module(model); opt = fabric.setup_optimizers("
                    "torch.optim.AdamW(model.parameters()))`, then load optimizer state with fabric.load."
                )
        # Fabric already refused parameters of no set-up module; these are this module's or sharded ones.
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        forward_module = self.setup_module(module)
        sharded_params = dict(module.named_parameters(remove_duplicate=False))
        for opt in optimizers:
            for group in opt.param_groups:
                group["params"] = [sharded_params[names[id(p)]] if id(p) in names else p for p in group["params"]]
            opt.state.clear()  # keyed by the old parameters; it holds no values (checked above)
        return forward_module, [self.setup_optimizer(opt) for opt in optimizers]

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        for group in optimizer.param_groups:
            for p in group["params"]:
                ref = self._stale.get(id(p))
                if ref is not None and ref() is p:
                    raise MisconfigurationError(
                        f"{type(optimizer).__name__} holds parameters from before FSDP sharded the model; they are "
                        "no longer used. Pass the optimizer together with its model, `fabric.setup(model, "
                        "optimizer)`, or create it from `model.parameters()` after setup_module."
                    )
        return optimizer

    # ------------------------------------------------------------------ forward, backward, step
    def module_forward(self, forward_module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with self.guard.unguarded("forward (FSDP all-gather)"):
            return forward_module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, modules: list[nn.Module], *args: Any, **kwargs: Any) -> None:
        scaled = self.precision.pre_backward(loss)
        with self.guard.unguarded("backward (FSDP reduce-scatter)"):
            scaled.backward(*args, **kwargs)
        for module in modules:
            record = self._calls.roots.get(id(module))
            if record is not None and record.ran_forward:
                record.local_only = not record.sync_enabled
                record.ran_forward = False

    @contextlib.contextmanager
    def _sync_disabled(self, record: Root) -> Iterator[None]:
        for unit in record.units:
            unit.set_requires_gradient_sync(False)
        record.sync_enabled = False
        try:
            yield
        finally:
            for unit in record.units:
                unit.set_requires_gradient_sync(True)
            record.sync_enabled = True

    def no_backward_sync(self, forward_module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        record = self._calls.roots.get(id(forward_module))
        if not enabled or record is None:
            return contextlib.nullcontext()
        return self._sync_disabled(record)

    def check_ready_to_step(self, optimizer: Optimizer) -> None:
        name = local_gradients_stepped(self._calls.roots.values(), optimizer)
        if name is not None:
            raise GradientSyncError(
                f"optimizer.step() was called while the gradients of {name} were never reduce-scattered: "
                "the last backward ran inside fabric.no_backward_sync(...), so the sharded gradients are "
                "missing this window. Run the last backward of each accumulation window with sync enabled, "
                "e.g. `with fabric.no_backward_sync(model, enabled=not is_last_micro_batch):`."
            )

    def clip_gradients(
        self,
        optimizer: Optimizer,
        max_norm: float | None,
        clip_val: float | None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        if max_norm is None:  # by value: each shard clamps its own elements, nothing to communicate
            return super().clip_gradients(optimizer, max_norm, clip_val, norm_type, error_if_nonfinite)
        self.average_across_groups(optimizer)
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # The norm of DTensor gradients is a partial result per rank; full_tensor() all-reduces it.
        with self.guard.guarded("clip_gradients (global gradient norm over all shards)"):
            return clip_grad_norm(params, max_norm, norm_type, error_if_nonfinite)

    def verify_in_sync(
        self, named: list[tuple[str, torch.Tensor]], what: str, rtol: float = 1e-5, atol: float = 0.0
    ) -> None:
        # Shards differ by design; only replicated tensors must agree.
        kept = [(n, local_tensor(t)) for n, t in named if not is_sharded(t)]
        super().verify_in_sync(kept, what, rtol, atol)


class FSDPStrategy(ShardedStrategy):
    """Shard parameters, gradients and optimizer state across ranks with FSDP2.

    Args:
        auto_wrap_policy: set of module classes to shard as their own units (each gets its own
            all-gather/reduce-scatter, so only one unit's full parameters exist at a time). Default
            (None): every element of an ``nn.ModuleList`` (the repeated blocks of a Transformer) and
            torch's ``nn.TransformerEncoderLayer``/``DecoderLayer``. The root is always sharded too.
        parallelize_fn: ``fn(module, mesh)`` that applies ``fully_shard`` (and anything else) itself;
            replaces ``auto_wrap_policy``. phalanx shards the root afterwards if ``fn`` did not.
        reshard_after_forward: free unit parameters after forward (re-gathered for backward). Default
            True (or what ``sharding_strategy`` means; passing both differently is refused).
        sharding_strategy: Lightning's names (strings of any case, or torch's ``ShardingStrategy``):
            ``"FULL_SHARD"`` (the default behaviour), ``"SHARD_GRAD_OP"`` (``reshard_after_forward=False``),
            ``"HYBRID_SHARD"`` (shard within groups, replicate across them: a 2-D mesh ``(replicate,
            shard)``, HSDP), ``"_HYBRID_SHARD_ZERO2"`` (the same without resharding) and ``"NO_SHARD"``
            (whole parameters on every rank: the mesh ``(world_size, 1)``).
        device_mesh: the hybrid mesh, a shape ``(replicate, shard)`` whose product is the world size, or
            a DeviceMesh. Default for hybrid sharding: ``(num_nodes, devices)``. A 2-D mesh without
            ``sharding_strategy`` is hybrid sharding too (FSDP2's meaning).
        cpu_offload: keep parameter/gradient shards and the optimizer step on the CPU.
        activation_checkpointing_policy: set of module classes whose activations are recomputed in
            backward instead of stored (parameter names are unchanged).
        state_dict_type: ``"sharded"`` (a directory, every rank writes its shards) or ``"full"`` (one
            file gathered to rank 0). ``load`` reads either.
        compile: ``True`` or a dict of ``torch.compile`` arguments: the sharded root is compiled in place
            after sharding.
        async_save: ``fabric.save`` copies this rank's shards into memory, writes them in the background
            and returns an :class:`~phalanx.checkpoint.async_sharded.AsyncCheckpoint` at once; the
            checkpoint is published when every rank has written (sharded checkpoints only).
        limit_all_gathers: Lightning's FSDP1 argument. True (the default) is what FSDP2 always does: it
            all-gathers at most one unit ahead of the one computing. False is accepted with a one-line
            note and changes nothing (FSDP2 has no CPU rate limiter to turn off).
        use_orig_params: Lightning's FSDP1 argument. True (the default) is what FSDP2 always does (the
            original parameters, sharded, under their own names); False (flat parameters) is refused.
            Lightning's other FSDP1 arguments (``backward_prefetch``, ``forward_prefetch``,
            ``mixed_precision``, ``sync_module_states``, ``param_init_fn``, ``device_id``,
            ``ignored_modules``, ``ignored_states``, ``process_group``, ``activation_checkpointing``) are
            refused, each with what to use instead.
        Other arguments: see :class:`~phalanx.strategies.parallel.ParallelStrategy`.
    """

    name: ClassVar[str] = "fsdp"


# ShardedMixedPrecision and local_tensor lived here before the split; old imports keep working.
__all__ = ["FSDPMixedPrecision", "FSDPStrategy", "ShardedMixedPrecision", "ShardedStrategy", "local_tensor"]
