"""Fully sharded data parallelism on torch's FSDP2 (``fully_shard`` over a 1-D DeviceMesh).

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
* A bare container as the model (``nn.ModuleDict({"teacher": ..., "student": ...})``, seed 000's
  structure) has no forward, which ``fully_shard`` refuses: phalanx shards each child as its own unit
  and leaves the container itself unsharded (it holds no parameters), so its children are called
  directly, as they must be.
* Gradient accumulation skips the reduce-scatter (``set_requires_gradient_sync(False)``), and an
  optimizer step after such a backward raises, exactly as under DDP.
* Gradient clipping measures the norm over all shards of all ranks, not of the local shard (torch's
  own norm functions on DTensor gradients), and 16-mixed skips a step on every rank when any shard
  overflowed (torch's GradScaler reduces its found-inf flag over the mesh).

Checkpoint I/O: :mod:`phalanx.checkpoint` (the layer) and :mod:`phalanx.checkpoint.dcp` (FSDP's shards).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from phalanx.checkpoint import dcp
from phalanx.checkpoint.async_sharded import AsyncCheckpoint, AsyncSaves
from phalanx.checkpoint.dcp import class_name
from phalanx.checkpoint.protocol import Shapes, ShardIO
from phalanx.distributed.launch import ClusterEnvironment
from phalanx.distributed.lockstep import to_timedelta
from phalanx.precision import PRECISIONS, MixedPrecision, Precision
from phalanx.strategies._transforms import apply_activation_checkpointing, check_compile, check_policy, compile_in_place
from phalanx.strategies.parallel import ParallelStrategy
from phalanx.utils.compat import FSDP_ON_CPU, CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from phalanx.utils.errors import GradientSyncError, MisconfigurationError
from phalanx.utils.tensors import is_metric

STATE_DICT_TYPES = ("sharded", "full")
_DCP_DIR = os.path.join("torch", "distributed", "checkpoint")
# Layers torch ships that are natural sharding units, besides the elements of any nn.ModuleList.
_DEFAULT_UNIT_CLASSES: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (the tensor itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _called_from_dcp() -> bool:
    """Whether torch.distributed.checkpoint's helpers asked for the state dict (they handle shards)."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if _DCP_DIR in frame.f_code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and any(p.is_shard() for p in t.placements)


class ShardedMixedPrecision(MixedPrecision):
    """:class:`~phalanx.precision.MixedPrecision` (autocast) on sharded (DTensor) gradients. Loss scaling
    is its ``torch.amp.GradScaler``: on DTensor gradients torch all-reduces the found-inf flag over the
    mesh, so an overflow in one rank's shard skips the step on every rank (shards would diverge
    otherwise). That all-reduce is a collective: the ranks meet first, so a rank that never steps
    makes the others raise (naming this op) instead of waiting for the process-group timeout."""

    def __init__(
        self, dtype: torch.dtype, device_type: str, guarded: Callable[[str], contextlib.AbstractContextManager[None]]
    ) -> None:
        super().__init__(dtype, device_type)
        self._guarded = guarded

    def _unscale(self, optimizer: Optimizer) -> None:
        with self._guarded("loss scaler (inf/nan in any gradient shard)"):
            super()._unscale(optimizer)


class FSDPMixedPrecision(ShardedMixedPrecision):
    """``bf16-mixed``/``16-mixed`` done by FSDP2 itself: parameters are all-gathered and used in
    ``dtype``, gradients are reduced and kept in float32, and the optimizer updates float32 shards.
    There is no autocast: FSDP casts parameters and floating-point inputs."""

    def policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


def _decide_root_now(module: FSDPModule) -> bool:
    """Make ``module`` FSDP's root before any forward: otherwise the first unit to run forward becomes
    the root, and calling ``model.student(x)`` before ``model(x)`` would break the real root for good.
    The hook is private to torch; without it (False) phalanx guards the call order instead."""
    try:
        lazy_init = module._get_fsdp_state()._lazy_init
    except AttributeError:
        return False
    lazy_init()
    return True


def _reduce_scatter_averages(world_size: int) -> bool:
    """Whether the default process group's reduce-scatter with ``ReduceOp.AVG`` averages. FSDP2 reduces
    float32/bfloat16 gradients with it; older torch's gloo silently summed instead (pytorch issue
    162338), which makes every gradient ``world_size`` times too large."""
    out = torch.zeros(1)
    try:
        dist.reduce_scatter_tensor(out, torch.ones(world_size), op=dist.ReduceOp.AVG)
    except RuntimeError:  # a backend that refuses AVG outright
        return False
    return bool(out.item() == 1.0)


def _clip_grad_norm(
    params: list[torch.Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> torch.Tensor:
    """Scale the gradients so that their norm over every shard of every rank is at most ``max_norm``;
    returns that norm (a plain tensor, the same on every rank).

    Gradients may live on different meshes (tensor parallel x FSDP: a parameter sharded by FSDP alone
    is on the 1-D data-parallel mesh, a tensor-parallel one on the 2-D mesh), and torch cannot stack
    DTensors of different meshes into one norm. So each mesh's gradients get torch's norm (reduced
    over that mesh), and the total is the norm of those norms, which is the same number."""
    utils = torch.nn.utils
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    if hasattr(utils, "get_total_norm"):  # torch >= 2.6
        norms = []
        for group in by_mesh.values() or [[]]:
            norm = utils.get_total_norm([p.grad for p in group if p.grad is not None], norm_type, error_if_nonfinite)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = norms[0] if len(norms) == 1 else utils.get_total_norm(norms, norm_type, error_if_nonfinite)
        for group in by_mesh.values():
            utils.clip_grads_with_norm_(group, max_norm, total)
    else:  # clip_grad_norm_ reduces the DTensor norms itself
        if len(by_mesh) > 1:
            raise MisconfigurationError(
                f"Clipping gradients that live on {len(by_mesh)} different device meshes (tensor parallel with FSDP) "
                f"needs torch >= 2.6 (torch.nn.utils.get_total_norm); torch {torch.__version__} has not got it. "
                "Upgrade torch."
            )
        total = utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        total = total.full_tensor() if isinstance(total, DTensor) else total
    return total


@dataclass
class _Root:
    """Bookkeeping for one set-up (root) FSDP module."""

    name: str
    param_ids: frozenset[int]
    units: list[FSDPModule]  # the outermost sharded units: the root itself, or a bare container's children
    sync_enabled: bool = True
    ran_forward: bool = False  # some unit of this root ran forward since the last backward
    root_ready: bool = True  # FSDP knows this module is its root (see _decide_root_now)
    local_only: bool = False  # last backward ran without reduce-scatter
    optimizers: dict[int, bool] = field(default_factory=dict)


class FSDPStrategy(ParallelStrategy):
    """Shard parameters, gradients and optimizer state across ranks with FSDP2.

    Args:
        auto_wrap_policy: set of module classes to shard as their own units (each gets its own
            all-gather/reduce-scatter, so only one unit's full parameters exist at a time). Default
            (None): every element of an ``nn.ModuleList`` (the repeated blocks of a Transformer) and
            torch's ``nn.TransformerEncoderLayer``/``DecoderLayer``. The root is always sharded too.
        parallelize_fn: ``fn(module, mesh)`` that applies ``fully_shard`` (and anything else) itself;
            replaces ``auto_wrap_policy``. phalanx shards the root afterwards if ``fn`` did not.
        reshard_after_forward: free unit parameters after forward (re-gathered for backward).
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
        Other arguments: see :class:`~phalanx.strategies.parallel.ParallelStrategy`.
    """

    name: ClassVar[str] = "fsdp"
    syncs_gradients: ClassVar[bool] = True
    supports_inference_mode: ClassVar[bool] = False  # fully_shard reuses its all-gather buffers
    supports_calls_outside_forward: ClassVar[bool] = False  # parameters are gathered by the forward
    supported_precisions: ClassVar[tuple[str, ...]] = PRECISIONS

    def __init__(
        self,
        *,
        auto_wrap_policy: set[type[nn.Module]] | None = None,
        parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module | None] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing_policy: set[type[nn.Module]] | None = None,
        state_dict_type: str = "sharded",
        compile: bool | dict[str, Any] = False,
        async_save: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.compile_options = check_compile(compile)
        hint = " For custom logic pass parallelize_fn=fn(module, mesh) and call fully_shard yourself."
        wrap_classes = check_policy(auto_wrap_policy, "auto_wrap_policy", hint)
        self.activation_checkpointing_policy = check_policy(activation_checkpointing_policy, hint=hint)
        if auto_wrap_policy is not None and parallelize_fn is not None:
            raise MisconfigurationError("Pass auto_wrap_policy or parallelize_fn, not both.")
        if state_dict_type not in STATE_DICT_TYPES:
            raise MisconfigurationError(f"state_dict_type={state_dict_type!r}; choose one of {STATE_DICT_TYPES}.")
        if async_save and state_dict_type != "sharded":
            raise MisconfigurationError(
                f"async_save=True writes sharded checkpoints; it cannot be combined with state_dict_type="
                f"{state_dict_type!r}. Drop one of the two (`phalanx consolidate` turns a sharded checkpoint into "
                "one file)."
            )
        self.auto_wrap_policy = wrap_classes if auto_wrap_policy is not None else None
        self.parallelize_fn = parallelize_fn
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.state_dict_type = state_dict_type
        self.async_save = async_save
        self._saves = AsyncSaves(self.unguarded, self._new_checkpoint_group)
        self._mesh: DeviceMesh | None = None
        self._roots: dict[int, _Root] = {}
        self._active: dict[int, int] = {}  # unit id -> forward depth
        self._stale: dict[int, weakref.ref[nn.Parameter]] = {}
        self._internal_state_dict = 0
        self._warned_state_dict = False

    # ------------------------------------------------------------------ precision
    def configure(self, *, device_type: str, devices: int, num_nodes: int, precision: str) -> None:
        if device_type == "cpu" and not FSDP_ON_CPU:
            raise MisconfigurationError(
                f"strategy='fsdp' on CPU needs torch >= 2.7 (torch {torch.__version__}'s FSDP2 cannot run on CPU). "
                "Upgrade torch, or use strategy='ddp' on CPU."
            )
        super().configure(device_type=device_type, devices=devices, num_nodes=num_nodes, precision=precision)

    def setup_environment(self, env: ClusterEnvironment | None) -> None:
        super().setup_environment(env)
        if self.world_size > 1 and dist.get_backend() == "gloo":
            with self.guard.guarded("FSDP gradient-average check (gloo reduce-scatter)"):
                averages = _reduce_scatter_averages(self.world_size)
            if not averages:
                raise MisconfigurationError(
                    f"strategy='fsdp' on gloo (CPU) needs a torch whose gloo reduce-scatter averages: torch "
                    f"{torch.__version__}'s sums instead, so FSDP2's gradients would be {self.world_size}x too "
                    "large. Upgrade torch (2.13 is known good), or use strategy='ddp' on CPU."
                )

    def select_precision(self, precision: str) -> Precision:
        plugin = super().select_precision(precision)
        if isinstance(plugin, MixedPrecision):  # FSDP2 casts itself (MixedPrecisionPolicy), no autocast
            return FSDPMixedPrecision(plugin.dtype, self.device_type, self.guarded)
        return plugin

    # ------------------------------------------------------------------ mesh and modules
    @property
    def mesh(self) -> DeviceMesh:
        """The 1-D device mesh parameters are sharded over (created on first use)."""
        if self._mesh is None:
            self._mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        return self._mesh

    @contextlib.contextmanager
    def init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``empty_init=True`` creates parameters on the meta device (no memory); ``setup`` shards
        them and then allocates and initializes only this rank's shards (``reset_parameters``)."""
        if not empty_init:
            with super().init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision.init_context():
            yield

    def setup_module(self, module: nn.Module) -> nn.Module:
        if id(module) in self._roots:
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
        tied = _tied_weights_hint(module)  # before sharding: fully_shard replaces (and so unties) parameters
        with self.guard.guarded(f"setup_module ({type(self).__name__} sharding)"):
            self._shard(module)
            if any(on_meta):
                self._materialize(module)
            self._after_sharding(module)
            # The model, or a bare container's children (none: tensor parallelism alone, no FSDP root).
            units = _outermost_units(module)
            try:
                # Every outermost unit becomes its own root.
                root_ready = all([_decide_root_now(unit) for unit in units])
            except (RuntimeError, ValueError) as err:
                raise MisconfigurationError(
                    f"FSDP could not set up {class_name(module)}: {str(err).rstrip('.')}. {tied}"
                ) from err
        # Metric state (torchmetrics) is neither parameter nor buffer, so fully_shard does not move it;
        # it must live where the backend reduces (seed 002).
        for sub in module.modules():
            if is_metric(sub):
                sub.to(self.root_device)
        self._stale.update(originals)
        self._install_hooks(module, units, root_ready)
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
            in_lists = {id(m) for lst in module.modules() if isinstance(lst, nn.ModuleList) for m in lst}
            # Children before parents: fully_shard must see inner units first.
            for sub in reversed(list(module.modules())):
                if sub is module or isinstance(sub, FSDPModule) or not any(True for _ in sub.parameters()):
                    continue
                chosen = isinstance(sub, classes) if classes is not None else (
                    id(sub) in in_lists or isinstance(sub, _DEFAULT_UNIT_CLASSES)
                )
                if chosen:
                    fully_shard(sub, **kwargs)
        if _is_bare_container(module):
            self._shard_children(module, kwargs)
        elif not isinstance(module, FSDPModule):
            fully_shard(module, **kwargs)

    def _shard_children(self, container: nn.Module, kwargs: dict[str, Any]) -> None:
        """A container without forward cannot be a unit: each child with parameters becomes one (nested
        bare containers likewise), so every parameter is sharded and every child can be called."""
        for child in container.children():
            if isinstance(child, FSDPModule) or not any(True for _ in child.parameters()):
                continue
            if _is_bare_container(child):
                self._shard_children(child, kwargs)
            else:
                fully_shard(child, **kwargs)

    def _after_sharding(self, module: nn.Module) -> None:
        """Hook for subclasses: the module is sharded (and materialized), FSDP's root not yet decided."""

    def _materialize(self, module: nn.Module) -> None:
        owners = [
            (name or type(m).__name__, m) for name, m in module.named_modules()
            if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False))
        ]
        missing = [name for name, m in owners if not callable(getattr(m, "reset_parameters", None))]
        if missing:
            raise MisconfigurationError(
                f"Modules {missing} were created with empty_init=True but define no reset_parameters(), so "
                "phalanx cannot initialize their shards. Add a reset_parameters() that fills their parameters "
                "and buffers, or create the model with empty_init=False."
            )
        module.to_empty(device=self.root_device)
        devices = [self.root_device] if self.root_device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            if self.root_device.type == "cpu":
                # DTensor has no RNG tracker on CPU meshes: without this every rank would fill its
                # shard with the same numbers (repeated rows). Streams derive from the global seed.
                base = int(torch.randint(0, 2**31 - 1, (1,)).item())
                torch.manual_seed(base + 1_000_003 * self.global_rank)
            for _, m in owners:
                m.reset_parameters()

    def _install_hooks(self, root: nn.Module, units: list[FSDPModule], root_ready: bool) -> None:
        record = _Root(class_name(root), frozenset(id(p) for p in root.parameters()), units, root_ready=root_ready)
        self._roots[id(root)] = record
        unit_classes = sorted({class_name(m) for m in root.modules() if isinstance(m, FSDPModule) and m is not root})
        if not root_ready:
            for outer in units:
                cast(nn.Module, outer).register_forward_pre_hook(lambda *_: setattr(record, "root_ready", True))

        def visit(mod: nn.Module, path: str, unit: nn.Module) -> None:
            if isinstance(mod, FSDPModule):
                unit = mod
                self._track_unit(mod, record)
                if not root_ready and not any(mod is outer for outer in units):
                    self._require_root_first(mod, path, record)
            elif _owns_unit_parameters(mod):
                # Every module holding parameters of the enclosing unit, outermost first: the check of the
                # module the user actually called fires before those of the layers inside it.
                self._guard_direct_call(mod, path, unit, unit_classes)
            for name, child in mod.named_children():
                visit(child, f"{path}.{name}" if path else name, unit)

        visit(root, "", root)

        def hint(*_: Any) -> None:  # a plain function: torch tags state-dict hooks with attributes
            self._state_dict_hint()

        root.register_state_dict_post_hook(hint)

    def _track_unit(self, unit: nn.Module, record: _Root) -> None:
        self._active[id(unit)] = 0

        def enter(*_: Any) -> None:
            self._active[id(unit)] += 1
            if torch.is_grad_enabled():
                record.ran_forward = True

        def leave(*_: Any) -> None:
            # Also called when a pre-forward hook raised before enter() ran: never count below zero.
            self._active[id(unit)] = max(0, self._active[id(unit)] - 1)

        unit.register_forward_pre_hook(enter)
        unit.register_forward_hook(leave, always_call=True)

    def _require_root_first(self, unit: nn.Module, path: str, record: _Root) -> None:
        def check(*_: Any) -> None:
            if not record.root_ready:
                raise MisconfigurationError(
                    f"{path} ({class_name(unit)}) was called directly before {record.name} ever ran forward. "
                    f"This torch offers phalanx no way to make {record.name} FSDP's root at setup, so FSDP would "
                    f"make {path} the root and {record.name} unusable. Call the set-up model once first (e.g. on "
                    "one batch under torch.no_grad()), then call its submodules directly."
                )

        # In front of FSDP's own pre-forward hook, which would pick the root.
        unit.register_forward_pre_hook(check, prepend=True)

    def _guard_direct_call(self, mod: nn.Module, path: str, unit: nn.Module, unit_classes: list[str]) -> None:
        unit_id = id(unit)
        cls = type(mod).__name__
        policy = ", ".join(sorted({cls, *unit_classes}))

        def check(*_: Any) -> None:
            # Backward recomputation (activation checkpointing) re-runs forwards outside the unit's.
            if self._active.get(unit_id, 1) == 0 and torch._C._current_graph_task_id() == -1:
                raise MisconfigurationError(
                    f"{path or cls} ({cls}) was called directly, but its parameters are sharded as part of the "
                    f"enclosing unit {class_name(unit)}, whose forward is not running: it would compute on "
                    "sharded parameters and its gradients would never be reduced. Call the set-up model instead, "
                    f"or make {path or cls} its own sharded unit: FSDPStrategy(auto_wrap_policy={{{policy}}}) "
                    f"(the units sharded now, plus {cls}), or fully_shard(module.{path or '<it>'}, mesh=mesh) in "
                    "parallelize_fn."
                )

        mod.register_forward_pre_hook(check)

    def _state_dict_hint(self) -> None:
        if self._internal_state_dict or self._warned_state_dict or _called_from_dcp():
            return
        self._warned_state_dict = True
        warnings.warn(
            "Under FSDP, model.state_dict() holds only this rank's shards (DTensors): torch.save of it on "
            "rank 0 alone stores rank 0's shards only. Use fabric.save(path, {'model': model, ...}) on every "
            "rank (state_dict_type='full' gives one plain file).",
            UserWarning,
            stacklevel=4,
        )

    @contextlib.contextmanager
    def internal_state_dict(self) -> Iterator[None]:
        """phalanx's own state-dict calls: no hint about torch.save."""
        self._internal_state_dict += 1
        try:
            yield
        finally:
            self._internal_state_dict -= 1

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
            record = self._roots.get(id(module))
            if record is not None and record.ran_forward:
                record.local_only = not record.sync_enabled
                record.ran_forward = False

    @contextlib.contextmanager
    def _sync_disabled(self, record: _Root) -> Iterator[None]:
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
        record = self._roots.get(id(forward_module))
        if not enabled or record is None:
            return contextlib.nullcontext()
        return self._sync_disabled(record)

    def check_ready_to_step(self, optimizer: Optimizer) -> None:
        for record in self._roots.values():
            if not record.local_only:
                continue
            touches = record.optimizers.get(id(optimizer))
            if touches is None:
                ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
                touches = record.optimizers[id(optimizer)] = bool(ids & record.param_ids)
            if touches:
                raise GradientSyncError(
                    f"optimizer.step() was called while the gradients of {record.name} were never reduce-scattered: "
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
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # The norm of DTensor gradients is a partial result per rank; full_tensor() all-reduces it.
        with self.guard.guarded("clip_gradients (global gradient norm over all shards)"):
            return _clip_grad_norm(params, max_norm, norm_type, error_if_nonfinite)

    def verify_in_sync(
        self, named: list[tuple[str, torch.Tensor]], what: str, rtol: float = 1e-5, atol: float = 0.0
    ) -> None:
        # Shards differ by design; only replicated tensors must agree.
        kept = [(n, local_tensor(t)) for n, t in named if not is_sharded(t)]
        super().verify_in_sync(kept, what, rtol, atol)

    # ------------------------------------------------------------------ state and checkpoints
    #: A single-file load is read by rank 0 alone; each tensor is broadcast and every rank keeps its shard.
    loads_full_state_on_rank0: ClassVar[bool] = True

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full (unsharded) state dict, on every rank. A collective: call it on every rank."""
        with self.internal_state_dict(), self.guard.unguarded("module_state_dict (FSDP all-gather)"):
            return dcp.full_model_state(module, rank0_only=False)

    def load_module_state_dict(self, module: nn.Module, state: dict[str, Any], strict: bool) -> None:
        self.scatter_module_state(module, state, strict, from_rank0=False)

    def optimizer_state_dict(self, module: nn.Module | None, optimizer: Optimizer) -> dict[str, Any]:
        with self.internal_state_dict(), self.guard.unguarded("optimizer_state_dict (FSDP all-gather)"):
            return dcp.full_optimizer_state(module, optimizer, rank0_only=False)

    def load_optimizer_state_dict(self, module: nn.Module | None, optimizer: Optimizer, state: dict[str, Any]) -> None:
        self.scatter_optimizer_state(module, optimizer, state, from_rank0=False)

    def checkpoint_shards(self, layout: str | None = None) -> ShardIO | None:
        if layout is None and self.state_dict_type == "full":
            return None
        if layout not in (None, dcp.DCPShards.layout):
            return None
        return dcp.DCPShards(self.guard.unguarded)

    def gather_module_state(self, module: nn.Module) -> dict[str, Any]:
        with self.internal_state_dict(), self.guard.unguarded("save: gathering the full model on rank 0"):
            return dcp.full_model_state(module, rank0_only=True)

    def gather_optimizer_state(self, module: nn.Module | None, optimizer: Optimizer) -> dict[str, Any]:
        with self.internal_state_dict(), self.guard.unguarded("save: gathering the full optimizer state on rank 0"):
            return dcp.full_optimizer_state(module, optimizer, rank0_only=True)

    def scatter_module_state(self, module: nn.Module, state: dict[str, Any], strict: bool, from_rank0: bool) -> None:
        with self.internal_state_dict(), self.guard.unguarded("load: sharding the full model"):
            dcp.load_full_model_state(module, state, strict, broadcast=from_rank0)

    def scatter_optimizer_state(
        self, module: nn.Module | None, optimizer: Optimizer, state: dict[str, Any], from_rank0: bool
    ) -> None:
        with self.internal_state_dict(), self.guard.unguarded("load: sharding the full optimizer state"):
            dcp.load_full_optimizer_state(module, optimizer, state, broadcast=from_rank0)

    def module_layout(self, module: nn.Module) -> tuple[str, Shapes]:
        with self.internal_state_dict():  # DTensor shapes are the full shapes: no gather needed
            return class_name(module), super().module_layout(module)[1]

    def save_checkpoint(self, path: str | Path, state: dict[str, Any]) -> AsyncCheckpoint | None:
        with self.internal_state_dict():
            if self.async_save:
                return self._saves.save(self, path, state)
            self._saves.finish(self)  # async_save was switched off while a write ran
            super().save_checkpoint(path, state)
        return None

    # A save still being written must be published (or have failed, on every rank) before anything
    # reads or removes checkpoints: the next save waits for it too (AsyncSaves.save).
    def load_checkpoint(
        self, path: str | Path, state: dict[str, Any] | None, strict: bool, weights_only: bool = True
    ) -> dict[str, Any]:
        self._saves.finish(self)
        with self.internal_state_dict():
            return super().load_checkpoint(path, state, strict, weights_only)

    def load_raw_checkpoint(self, path: str | Path, obj: Any, strict: bool, weights_only: bool = True) -> None:
        self._saves.finish(self)
        super().load_raw_checkpoint(path, obj, strict, weights_only)

    def remove_checkpoint(self, path: str | Path) -> None:
        self._saves.finish(self)
        super().remove_checkpoint(path)

    def _new_checkpoint_group(self) -> Any:
        # The background write's collectives must not interleave with training's on the default group
        # (they would, in a different order on each rank); gloo, because the staged shards are on the CPU.
        with self.guard.guarded("save: create the process group of asynchronous checkpoints"):
            return dist.new_group(backend="gloo", timeout=to_timedelta(self.timeout))

    def teardown(self, error: BaseException | None = None) -> None:
        ending = error
        try:
            if error is None and self._guard is not None:
                self._saves.finish(self)  # a failed background write is raised here, on every rank
        except BaseException as err:
            ending = err
            raise
        finally:
            self._saves.close()  # never destroy the process groups under a write still running
            super().teardown(ending)


def _is_bare_container(module: nn.Module) -> bool:
    """A ModuleDict/ModuleList (or subclass) without its own forward, which fully_shard refuses."""
    if not isinstance(module, (nn.ModuleDict, nn.ModuleList)) or type(module).forward is not nn.Module.forward:
        return False
    own = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    if own:
        raise MisconfigurationError(
            f"{type(module).__name__} has no forward, so FSDP cannot make it a sharded unit, and it holds tensors of "
            f"its own ({own}) that no child unit would shard. Move them into a child module, or give the model "
            "a forward (subclass nn.Module)."
        )
    return True


def _outermost_units(module: nn.Module) -> list[FSDPModule]:
    if isinstance(module, FSDPModule):
        return [module]
    return [u for child in module.children() for u in _outermost_units(child)]


def _owns_unit_parameters(module: nn.Module) -> bool:
    """Whether some parameter under ``module`` is not inside a nested sharded unit."""
    if any(True for _ in module.parameters(recurse=False)):
        return True
    return any(not isinstance(c, FSDPModule) and _owns_unit_parameters(c) for c in module.children())


def _tied_weights_hint(module: nn.Module) -> str:
    """Name the smallest module that holds every user of each shared (tied) parameter: the class to
    make a unit, instead of one of the modules that share it."""
    users: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        users.setdefault(id(p), []).append(name.rsplit(".", 1)[0] if "." in name else "")
    hints = []
    modules = dict(module.named_modules())
    for paths in users.values():
        if len(set(paths)) < 2:
            continue
        common = paths[0].split(".")
        for path in paths[1:]:
            parts = path.split(".")
            n = 0
            while n < min(len(common), len(parts)) and common[n] == parts[n]:
                n += 1
            common = common[:n]
        holder = ".".join(common)
        cls = type(modules[holder]).__name__ if holder in modules else type(module).__name__
        hints.append(f"{' and '.join(sorted(set(paths)))} share a parameter (tied weights), so they must be in one "
                     f"unit: make {holder or 'the root'} ({cls}) the unit (auto_wrap_policy={{{cls}, ...}}) and "
                     "leave the modules that share it out of auto_wrap_policy")
    if not hints:
        return "Parameters shared between modules (tied weights) must live in one sharded unit."
    return "; ".join(hints[:3]) + "."


__all__ = ["FSDPMixedPrecision", "FSDPStrategy", "ShardedMixedPrecision"]
