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
  enclosing unit would run on sharded (or never reduced) parameters, so phalanx raises instead.
* Gradient accumulation skips the reduce-scatter (``set_requires_gradient_sync(False)``), and an
  optimizer step after such a backward raises, exactly as under DDP.
* Gradient clipping measures the norm over all shards of all ranks, not of the local shard.

Checkpoint I/O lives in :mod:`phalanx.checkpoint.sharded`.
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
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from phalanx.checkpoint import sharded
from phalanx.checkpoint.sharded import class_name
from phalanx.errors import GradientSyncError, MisconfigurationError
from phalanx.precision import PRECISIONS, Precision
from phalanx.strategies._transforms import check_compile, compile_in_place
from phalanx.strategies.parallel import ParallelStrategy

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


class ShardedLossScaler:
    """Dynamic loss scaling for sharded gradients (``16-mixed``).

    Each rank sees only its shards, so an overflow on one rank must skip the step on all of them:
    the found-inf flag is combined with a guarded all-reduce before anyone steps."""

    def __init__(
        self,
        all_reduce_max: Callable[[torch.Tensor], torch.Tensor],
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self._all_reduce_max = all_reduce_max
        self.scale_value = init_scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0
        self._found: dict[int, bool] = {}  # per optimizer, between unscale_ and step
        self._skipped = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, optimizer: Optimizer) -> None:
        if id(optimizer) in self._found:
            return  # already unscaled for this step (clip_gradients does it early)
        grads = [local_tensor(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        found = torch.zeros(1)
        by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            by_key.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), group in by_key.items():
            flag = torch.zeros(1, device=device)
            inv = torch.full((1,), 1.0 / self.scale_value, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
            found = torch.maximum(found, flag.cpu())
        self._found[id(optimizer)] = bool(self._all_reduce_max(found).item() > 0)

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        self.unscale_(optimizer)
        if self._found.pop(id(optimizer)):
            self._skipped = True
            return None
        return optimizer.step(**kwargs)

    def update(self) -> None:
        if self._skipped:
            self.scale_value *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker >= self.growth_interval:
                self.scale_value *= self.growth_factor
                self.growth_tracker = 0
        self._skipped = False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale_value = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])


class FSDPMixedPrecision(Precision):
    """``bf16-mixed``/``16-mixed`` done by FSDP2 itself: parameters are all-gathered and used in
    ``dtype``, gradients are reduced and kept in float32, and the optimizer updates float32 shards.
    There is no autocast: FSDP casts parameters and floating-point inputs."""

    def __init__(self, dtype: torch.dtype, scaler: ShardedLossScaler | None) -> None:
        self.compute_dtype = dtype
        self.scaler = scaler
        self.name = "bf16-mixed" if dtype == torch.bfloat16 else "16-mixed"

    def policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)

    def convert_output(self, data: Any) -> Any:
        from phalanx.utils import apply_to_tensors

        return apply_to_tensors(data, lambda t: t.float() if torch.is_floating_point(t) else t)

    def pre_backward(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


@dataclass
class _Root:
    """Bookkeeping for one set-up (root) FSDP module."""

    name: str
    param_ids: frozenset[int]
    sync_enabled: bool = True
    ran_forward: bool = False  # some unit of this root ran forward since the last backward
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
        Other arguments: see :class:`~phalanx.strategies.parallel.ParallelStrategy`.
    """

    name: ClassVar[str] = "fsdp"
    syncs_gradients: ClassVar[bool] = True
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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.compile_options = check_compile(compile)
        for arg, value in (("auto_wrap_policy", auto_wrap_policy), ("activation_checkpointing_policy",
                                                                    activation_checkpointing_policy)):
            if value is not None and not (
                isinstance(value, (set, frozenset, list, tuple))
                and all(isinstance(c, type) and issubclass(c, nn.Module) for c in value)
            ):
                raise MisconfigurationError(
                    f"{arg} must be a set of nn.Module classes, got {value!r}. For custom logic pass "
                    "parallelize_fn=fn(module, mesh) and call fully_shard yourself."
                )
        if auto_wrap_policy is not None and parallelize_fn is not None:
            raise MisconfigurationError("Pass auto_wrap_policy or parallelize_fn, not both.")
        if state_dict_type not in STATE_DICT_TYPES:
            raise MisconfigurationError(f"state_dict_type={state_dict_type!r}; choose one of {STATE_DICT_TYPES}.")
        self.auto_wrap_policy = tuple(auto_wrap_policy) if auto_wrap_policy is not None else None
        self.parallelize_fn = parallelize_fn
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.activation_checkpointing_policy = tuple(activation_checkpointing_policy or ())
        self.state_dict_type = state_dict_type
        self._mesh: DeviceMesh | None = None
        self._roots: dict[int, _Root] = {}
        self._active: dict[int, int] = {}  # unit id -> forward depth
        self._stale: dict[int, weakref.ref[nn.Parameter]] = {}
        self._internal_state_dict = 0
        self._warned_state_dict = False

    # ------------------------------------------------------------------ precision
    def select_precision(self, precision: str) -> Precision:
        if precision not in ("bf16-mixed", "16-mixed"):
            return super().select_precision(precision)
        if precision == "bf16-mixed":
            if self.device_type == "cuda" and not torch.cuda.is_bf16_supported():
                raise MisconfigurationError(
                    "precision='bf16-mixed' needs a GPU with bfloat16 support (Ampere or newer). "
                    "Use precision='16-mixed' on this GPU."
                )
            return FSDPMixedPrecision(torch.bfloat16, None)
        scaler = ShardedLossScaler(
            lambda t: self.collectives.all_reduce(t, "max", name="loss scaler (inf/nan in any gradient shard)")
        )
        return FSDPMixedPrecision(torch.float16, scaler)

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
        if isinstance(module, FSDPModule) and id(module) in self._roots:
            raise MisconfigurationError("This module was already set up with FSDP; set it up once.")
        tensors = [*module.parameters(), *module.buffers()]
        on_meta = [t.is_meta for t in tensors]
        if any(on_meta) and not all(on_meta):
            raise MisconfigurationError(
                f"{type(module).__name__} is partly on the meta device. Create the whole model inside "
                "fabric.init_module(empty_init=True), or none of it."
            )
        originals = {id(p): weakref.ref(p) for p in module.parameters()}
        module = self.precision.convert_module(module)
        if self.activation_checkpointing_policy:
            from torch.distributed._composable.checkpoint_activation import checkpoint

            for sub in list(module.modules()):
                if isinstance(sub, self.activation_checkpointing_policy):
                    checkpoint(sub)
        with self.guard.guarded("setup_module (FSDP sharding)"):
            self._shard(module)
            if any(on_meta):
                self._materialize(module)
            try:
                # Decide the root now: otherwise the first unit to run forward becomes the root, and
                # calling model.student(x) before model(x) would break the real root for good.
                module._get_fsdp_state()._lazy_init()  # type: ignore[operator]
            except (RuntimeError, ValueError) as err:
                raise MisconfigurationError(
                    f"FSDP could not set up {type(module).__name__}: {err}. Parameters shared between modules "
                    "(tied weights) must live in one sharded unit: leave those modules out of auto_wrap_policy."
                ) from err
        self._stale.update(originals)
        self._install_hooks(module)
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
        if not isinstance(module, FSDPModule):
            fully_shard(module, **kwargs)

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

    def _install_hooks(self, root: nn.Module) -> None:
        record = _Root(class_name(root), frozenset(id(p) for p in root.parameters()))
        self._roots[id(root)] = record

        def visit(mod: nn.Module, path: str, unit: nn.Module) -> None:
            if isinstance(mod, FSDPModule):
                unit = mod
                self._track_unit(mod, record)
            elif any(True for _ in mod.parameters(recurse=False)):
                self._guard_direct_call(mod, path, unit)
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
            self._active[id(unit)] -= 1

        unit.register_forward_pre_hook(enter)
        unit.register_forward_hook(leave, always_call=True)

    def _guard_direct_call(self, mod: nn.Module, path: str, unit: nn.Module) -> None:
        unit_id = id(unit)

        def check(*_: Any) -> None:
            # Backward recomputation (activation checkpointing) re-runs forwards outside the unit's.
            if self._active.get(unit_id, 1) == 0 and torch._C._current_graph_task_id() == -1:
                raise MisconfigurationError(
                    f"{path or type(mod).__name__} ({type(mod).__name__}) was called directly, but its "
                    f"parameters are sharded as part of the enclosing unit {class_name(unit)}, whose forward "
                    "is not running: it would compute on sharded parameters and its gradients would never be "
                    "reduced. Call the set-up model instead, or make this module its own sharded unit "
                    "(add its class to FSDPStrategy(auto_wrap_policy={...}) or shard it in parallelize_fn)."
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
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        for opt in optimizers:
            foreign = [p for g in opt.param_groups for p in g["params"] if id(p) not in names and not is_sharded(p)]
            if foreign:
                raise MisconfigurationError(
                    f"{type(opt).__name__} updates {len(foreign)} parameters that are not part of "
                    f"{type(module).__name__} (nor of a model set up before), so they would never be trained. "
                    "Create the optimizer from this model's parameters: `torch.optim.X(model.parameters())`."
                )
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
    def _sync_disabled(self, module: FSDPModule, record: _Root) -> Iterator[None]:
        module.set_requires_gradient_sync(False)
        record.sync_enabled = False
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
            record.sync_enabled = True

    def no_backward_sync(self, forward_module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        record = self._roots.get(id(forward_module))
        if not enabled or record is None or not isinstance(forward_module, FSDPModule):
            return contextlib.nullcontext()
        return self._sync_disabled(forward_module, record)

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
        self.precision.unscale_gradients(optimizer)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if clip_val is not None:
            for grad in grads:
                local_tensor(grad).clamp_(-clip_val, clip_val)
            return None
        assert max_norm is not None
        p = float(norm_type)
        norms = [
            torch.linalg.vector_norm(local_tensor(g).detach(), p, dtype=torch.float32).to(self.root_device)
            for g in grads
            # A replicated gradient is identical everywhere: count it once (on rank 0).
            if is_sharded(g) or self.global_rank == 0
        ]
        stacked = torch.stack(norms) if norms else torch.zeros(1, device=self.root_device)
        name = "clip_gradients (global gradient norm over all shards)"
        if p == float("inf"):
            total = self.collectives.all_reduce(stacked.max().reshape(1), "max", name=name)[0]
        else:
            total = self.collectives.all_reduce(stacked.pow(p).sum().reshape(1), "sum", name=name)[0].pow(1.0 / p)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total gradient norm (order {p}) is {float(total)}: some gradient holds inf or nan. Lower the "
                "learning rate, check the loss, or pass error_if_nonfinite=False to clip_gradients."
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            local = local_tensor(grad)
            local.mul_(coef.to(local.device, local.dtype))
        return total

    def verify_in_sync(
        self, named: list[tuple[str, torch.Tensor]], what: str, rtol: float = 1e-5, atol: float = 0.0
    ) -> None:
        # Shards differ by design; only replicated tensors must agree.
        kept = [(n, local_tensor(t)) for n, t in named if not is_sharded(t)]
        super().verify_in_sync(kept, what, rtol, atol)

    # ------------------------------------------------------------------ state and checkpoints
    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full (unsharded) state dict, on every rank. A collective: call it on every rank."""
        with self.internal_state_dict():
            return sharded.full_model_state(module, rank0_only=False)

    def load_module_state_dict(self, module: nn.Module, state: dict[str, Any], strict: bool) -> None:
        with self.internal_state_dict():
            sharded.load_full_model_state(module, state, strict, broadcast=False)

    def optimizer_state_dict(self, module: nn.Module | None, optimizer: Optimizer) -> dict[str, Any]:
        with self.internal_state_dict():
            return sharded.full_optimizer_state(module, optimizer, rank0_only=False)

    def load_optimizer_state_dict(self, module: nn.Module | None, optimizer: Optimizer, state: dict[str, Any]) -> None:
        with self.internal_state_dict():
            sharded.load_full_optimizer_state(module, optimizer, state, broadcast=False)

    def save_checkpoint(self, path: str | Path, state: dict[str, Any]) -> None:
        with self.internal_state_dict():
            if self.state_dict_type == "sharded":
                sharded.save_sharded(self, Path(path), state)
            else:
                sharded.save_full(self, Path(path), state)

    def load_checkpoint(self, path: str | Path, state: dict[str, Any] | None, strict: bool) -> dict[str, Any]:
        with self.internal_state_dict():
            return sharded.load(self, Path(path), state, strict)


__all__ = ["FSDPMixedPrecision", "FSDPStrategy", "ShardedLossScaler"]
