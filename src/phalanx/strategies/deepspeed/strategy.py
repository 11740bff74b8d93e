"""ZeRO stages 1, 2 and 3 through DeepSpeed, with the same loop semantics as every other strategy.

``import phalanx`` never imports DeepSpeed: this module only touches it when a model is set up, so a
missing install is reported then (naming the ``phalanx[deepspeed]`` extra), and the string
``strategy="deepspeed"`` costs nothing until used. phalanx creates the process group and the lockstep
guard (ParallelStrategy); ``deepspeed.init_distributed`` finds the group initialized and adopts it.
It runs on CPU with gloo too, which is what makes it testable without GPUs.

Gradient accumulation. Every phalanx backend expresses accumulation the same way:

    with fabric.no_backward_sync(model, enabled=not boundary):
        fabric.backward(model(x).loss / N)
    if boundary:
        optimizer.step(); optimizer.zero_grad()

DeepSpeed's own mechanism is different: its config's ``gradient_accumulation_steps`` (GAS) makes
``engine.backward`` divide the loss by GAS and ``engine.step`` silently skip until GAS micro-steps
have passed. Using it under this loop would divide the loss twice and make ``optimizer.step()``
a no-op on some calls. So the engine always runs with GAS=1 (a config asking for more is refused)
and phalanx drives DeepSpeed's documented manual boundary instead:
``engine.set_gradient_accumulation_boundary(False)`` for backwards inside ``no_backward_sync``,
``True`` otherwise. At a non-boundary DeepSpeed keeps gradients local (stage 1) or reduces and
accumulates them in its partitions (stages 2 and 3 reduce every micro-step by design; the result is
the same sum). ``optimizer.step()`` then is a real step every time it is called: the wrapped torch
optimizer steps once per window, exactly as under DDP, and stepping after a backward that ran inside
``no_backward_sync`` raises, as under DDP.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.checkpoint.dcp import DCPShards
from phalanx.checkpoint.deepspeed_shards import DeepSpeedShards
from phalanx.checkpoint.protocol import MODULE, Shapes, ShardIO
from phalanx.checkpoint.reshard import FullStateReader
from phalanx.precision import Precision
from phalanx.strategies.deepspeed.checkpoint import DeepSpeedCheckpointIO, owned_values
from phalanx.strategies.deepspeed.config import PRECISION_SECTIONS, apply_precision, build_zero_config, conflict
from phalanx.strategies.parallel import ParallelStrategy
from phalanx.utils.errors import CheckpointError, GradientSyncError, MisconfigurationError
from phalanx.utils.tensors import apply_to_tensors

INSTALL_HINT = "pip install 'phalanx[deepspeed]'"
STATE_DICT_TYPES = ("sharded", "full")
_HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def import_deepspeed() -> Any:
    """Import DeepSpeed on first use, or say how to install it."""
    try:
        import deepspeed
    except ImportError as err:
        raise MisconfigurationError(
            f"strategy='deepspeed' needs the DeepSpeed package, which is not installed ({err}). "
            f"Install it with `{INSTALL_HINT}` (on CPU-only machines: "
            "`DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed`)."
        ) from err
    return deepspeed


class DeepSpeedPrecision(Precision):
    """DeepSpeed converts the module and scales the loss itself; phalanx only casts inputs to the
    engine's dtype and hands float32 outputs back, as its other half-precision plugins do."""

    def __init__(self, name: str) -> None:
        self.name = name
        section = PRECISION_SECTIONS[name]
        self.half_dtype = _HALF_DTYPES[section] if section is not None else None

    def convert_input(self, data: Any) -> Any:
        dtype = self.half_dtype
        if dtype is None:
            return data
        return apply_to_tensors(data, lambda t: t.to(dtype) if torch.is_floating_point(t) else t)

    def convert_output(self, data: Any) -> Any:
        if self.half_dtype is None:
            return data
        return apply_to_tensors(data, lambda t: t.to(torch.float32) if torch.is_floating_point(t) else t)


@contextlib.contextmanager
def _without_shm_comm(deepspeed: Any) -> Iterator[None]:
    """Keep DeepSpeed's communication backend from JIT-compiling its CPU shared-memory all-reduce.

    On CPU, DeepSpeed's TorchBackend compiles a C++ extension on first use (minutes on a small box, a
    compiler required, and a killed compile leaves a lock that hangs every later run). That kernel
    only serves DeepSpeed's tensor-parallel *inference* all-reduce and would bypass the process group
    phalanx guards; training never calls it. So it is switched off while the backend is created.
    """
    try:
        # By module path: the attribute deepspeed.comm.torch is the torch package (star-imported).
        module = importlib.import_module("deepspeed.comm.torch")
    except ImportError:
        module = None
    original = getattr(module, "build_shm_op", None)
    if module is None or original is None:
        yield
        return
    setattr(module, "build_shm_op", lambda: None)  # noqa: B010
    try:
        yield
    finally:
        setattr(module, "build_shm_op", original)  # noqa: B010


class DeepSpeedStrategy(ParallelStrategy):
    """ZeRO data parallelism through DeepSpeed (optimizer states, gradients and, with stage 3,
    parameters are partitioned across ranks).

    Args:
        stage: ZeRO stage 1, 2 or 3 (default 2, or the config's ``zero_optimization.stage``).
        offload_optimizer: keep optimizer states on the CPU (``zero_optimization.offload_optimizer``).
        offload_parameters: keep parameters on the CPU (stage 3 only).
        config: a DeepSpeed config dict or the path of a JSON file. A value set both here and by an
            argument (stage, offload, precision) must agree, or the strategy raises.
        state_dict_type: ``"sharded"`` (default) saves a checkpoint directory through DeepSpeed's engine
            (every rank writes its shard; resume needs the same world size). ``"full"`` saves one file
            with consolidated float32 weights and optimizer state, loadable at any world size and by
            other strategies.
        logging_level: level of DeepSpeed's own logger (it is chatty at INFO).
        Other arguments: see :class:`~phalanx.strategies.parallel.ParallelStrategy`.
    """

    name: ClassVar[str] = "deepspeed"
    syncs_gradients: ClassVar[bool] = True
    supports_inference_mode: ClassVar[bool] = False  # ZeRO-3 gathers parameters into reused buffers
    supports_calls_outside_forward: ClassVar[bool] = False  # the engine owns backward and the step
    supports_replica_groups: ClassVar[bool] = False  # the engine steps its own partitions: torchft cannot gate it
    sets_up_optimizers_separately: ClassVar[bool] = False  # one engine from the model and its optimizer
    supported_precisions: ClassVar[tuple[str, ...]] = tuple(PRECISION_SECTIONS)

    def __init__(
        self,
        stage: int | None = None,
        offload_optimizer: bool | None = None,
        offload_parameters: bool | None = None,
        config: dict[str, Any] | str | Path | None = None,
        *,
        state_dict_type: str = "sharded",
        logging_level: int = logging.WARNING,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if state_dict_type not in STATE_DICT_TYPES:
            raise MisconfigurationError(f"state_dict_type={state_dict_type!r}; choose one of {STATE_DICT_TYPES}.")
        self.state_dict_type = state_dict_type
        self.logging_level = logging_level
        self.config = build_zero_config(config, stage, offload_optimizer, offload_parameters)
        self.stage: int = self.config["zero_optimization"]["stage"]
        self._engine: Any = None
        self._client_optimizer: Optimizer | None = None
        self._param_names: dict[int, str] = {}
        self._param_groups: list[list[nn.Parameter]] = []
        self._local_only = False  # last backward ran at a non-boundary: gradients not final yet
        self._pending = False  # a backward ran since the last step
        self._in_no_sync = False
        self._clip_max_norm: float | None = None

    # ------------------------------------------------------------------ configuration
    def select_precision(self, precision: str) -> Precision:
        super().select_precision(precision)  # the "not supported" message for 64-true and friends
        if PRECISION_SECTIONS[precision] == "fp16" and self.device_type == "cpu":
            raise MisconfigurationError(
                f"precision={precision!r} with strategy='deepspeed' needs a GPU: DeepSpeed's CPU backend has "
                "no float16 support. Use precision='bf16-mixed' or '32-true' on CPU."
            )
        apply_precision(self.config, precision)
        return DeepSpeedPrecision(precision)

    @property
    def engine(self) -> Any:
        """The ``deepspeed.DeepSpeedEngine`` built by ``fabric.setup`` (None before)."""
        return self._engine

    # ------------------------------------------------------------------ setup
    def setup_module(self, module: nn.Module) -> nn.Module:
        """A module set up without an optimizer (a frozen teacher, an eval model): not an engine, just
        moved and cast to the engine's dtype so that the inputs phalanx casts match it."""
        dtype = self.precision.half_dtype if isinstance(self.precision, DeepSpeedPrecision) else None
        module = module.to(self.root_device)
        return module.to(dtype) if dtype is not None else module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise MisconfigurationError(
            "DeepSpeed builds one engine from a model and its optimizer together: call "
            "`model, optimizer = fabric.setup(model, optimizer)` instead of setup_module + setup_optimizers."
        )

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer]
    ) -> tuple[nn.Module, list[Optimizer]]:
        if not optimizers:
            return self.setup_module(module), []
        if len(optimizers) > 1:
            raise MisconfigurationError(
                f"DeepSpeed drives exactly one optimizer per model, got {len(optimizers)}. Put all parameter "
                "groups into one optimizer (param_groups can have different hyperparameters)."
            )
        if self._engine is not None:
            raise MisconfigurationError(
                "This DeepSpeedStrategy already holds an engine; DeepSpeed trains one model with an optimizer "
                "per job. Set up further models without an optimizer (frozen), or combine them in one nn.Module."
            )
        if "optimizer" in self.config:
            raise MisconfigurationError(
                "The DeepSpeed config defines an 'optimizer' section and fabric.setup was given an optimizer "
                "too. Remove the section from the config (phalanx passes your torch optimizer to DeepSpeed)."
            )
        deepspeed = import_deepspeed()
        logging.getLogger("DeepSpeed").setLevel(self.logging_level)
        self._adopt_process_group(deepspeed)
        optimizer = optimizers[0]
        self._param_names = {id(p): n for n, p in module.named_parameters()}
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in self._param_names]
        if foreign:
            raise MisconfigurationError(
                f"The optimizer updates {len(foreign)} tensor(s) that are not parameters of "
                f"{type(module).__name__}; DeepSpeed can only optimize the parameters of the model it wraps."
            )
        # DeepSpeed replaces the optimizer's params with flat partitions; remember the original order so
        # a consolidated ("full") optimizer state can use torch's own layout.
        self._param_groups = [list(g["params"]) for g in optimizer.param_groups]
        with self.guard.guarded("setup (deepspeed.initialize)"):
            engine, _, _, _ = deepspeed.initialize(
                model=module, optimizer=optimizer, config=copy.deepcopy(self.config), dist_init_required=False
            )
        engine.set_gradient_accumulation_boundary(True)
        self._engine, self._client_optimizer = engine, optimizer
        return engine, [optimizer]

    def _adopt_process_group(self, deepspeed: Any) -> None:
        """Make DeepSpeed use phalanx's process group rather than create its own."""
        env_rank = os.environ.setdefault("LOCAL_RANK", str(self.local_rank))  # DeepSpeed's engine reads it
        if int(env_rank) != self.local_rank:
            raise MisconfigurationError(
                f"LOCAL_RANK={env_rank} in the environment, but this process is local rank {self.local_rank}. "
                "Unset LOCAL_RANK or fix the launcher's environment."
            )
        self.guard  # noqa: B018 - raises clearly if fabric.launch() has not run
        backend = torch.distributed.get_backend()
        with _without_shm_comm(deepspeed):
            deepspeed.init_distributed(dist_backend=backend, dist_init_required=False)
        if not deepspeed.comm.is_initialized():
            raise MisconfigurationError(
                "deepspeed.init_distributed did not adopt phalanx's process group; this DeepSpeed version is "
                "not supported by phalanx's DeepSpeedStrategy."
            )

    def _is_engine(self, module: nn.Module) -> bool:
        return self._engine is not None and module is self._engine

    def unwrap(self, forward_module: nn.Module) -> nn.Module:
        return self._engine.module if self._is_engine(forward_module) else forward_module

    def module_forward(self, forward_module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self._is_engine(forward_module) and self.stage == 3:
            # ZeRO-3 all-gathers each layer's parameters inside forward: a collective phalanx cannot
            # pre-check cheaply, so it only takes a sequence number (see Lockstep.unguarded).
            with self.guard.unguarded("forward (DeepSpeed ZeRO-3 parameter gather)"):
                return forward_module(*args, **kwargs)
        return forward_module(*args, **kwargs)

    # ------------------------------------------------------------------ accumulation and steps
    @contextlib.contextmanager
    def _non_boundary(self) -> Iterator[None]:
        engine, outer = self._engine, self._in_no_sync
        self._in_no_sync = True
        engine.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            self._in_no_sync = outer
            engine.set_gradient_accumulation_boundary(not outer)

    def no_backward_sync(self, forward_module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        if enabled and self._is_engine(forward_module):
            return self._non_boundary()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, modules: list[nn.Module], *args: Any, **kwargs: Any) -> None:
        if not any(self._is_engine(m) for m in modules):
            super().backward(loss, modules, *args, **kwargs)
            return
        retain_graph = bool(kwargs.pop("retain_graph", False))
        if args or kwargs:
            raise MisconfigurationError(
                "With DeepSpeed, fabric.backward accepts only retain_graph=...; "
                f"got extra arguments {args or ''}{list(kwargs) or ''}."
            )
        # scale_wrt_gas=False: the user's loss is already divided by the window length (GAS is 1 anyway).
        with self.guard.unguarded("backward (DeepSpeed gradient reduction)"):
            self._engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)
        self._pending = True
        self._local_only = self._in_no_sync

    def check_ready_to_step(self, optimizer: Optimizer) -> None:
        if self._local_only and optimizer is self._client_optimizer:
            raise GradientSyncError(
                "optimizer.step() was called while the accumulated gradients are not final: the last backward "
                "ran inside fabric.no_backward_sync(...), so DeepSpeed has not reached its accumulation "
                "boundary. Run the last backward of each accumulation window with sync enabled, e.g. "
                "`with fabric.no_backward_sync(model, enabled=not is_last_micro_batch):`."
            )

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        if optimizer is not self._client_optimizer:
            return super().optimizer_step(optimizer, **kwargs)
        if kwargs:
            raise MisconfigurationError(
                f"DeepSpeed's step takes no arguments (no closures); got {sorted(kwargs)}."
            )
        self.check_ready_to_step(optimizer)
        engine = self._engine
        zero_optimizer = engine.optimizer
        configured = float(zero_optimizer.clip_grad)
        if self._clip_max_norm is not None:
            # clip_gradients asked for this step's threshold; DeepSpeed clips inside step().
            zero_optimizer.clip_grad = self._clip_max_norm
        try:
            with self.guard.unguarded("optimizer step (DeepSpeed)"):
                engine.step()
        finally:
            zero_optimizer.clip_grad = configured
            self._clip_max_norm = None
        self._pending = False
        return None

    def optimizer_zero_grad(self, optimizer: Optimizer, set_to_none: bool = True) -> None:
        if optimizer is not self._client_optimizer:
            super().optimizer_zero_grad(optimizer, set_to_none)
            return
        if self._pending:
            raise MisconfigurationError(
                "optimizer.zero_grad() was called after a backward without an optimizer.step() in between. "
                "Under DeepSpeed the accumulated gradients live in ZeRO's partitioned buffers, which zero_grad "
                "cannot discard, so they would leak into the next step. Step before zeroing; to drop a window, "
                "skip its backward instead."
            )
        # engine.step() already cleared DeepSpeed's gradients; this clears anything else the user holds.
        optimizer.zero_grad(set_to_none=set_to_none)

    def clip_gradients(
        self,
        optimizer: Optimizer,
        max_norm: float | None,
        clip_val: float | None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        """DeepSpeed clips by total 2-norm inside its step (its ``gradient_clipping``). Calling this sets
        that threshold for the coming ``optimizer.step()``. It returns None: the norm is computed inside
        the step; read it afterwards from ``strategy.engine.get_global_grad_norm()``."""
        if optimizer is not self._client_optimizer:
            return super().clip_gradients(optimizer, max_norm, clip_val, norm_type, error_if_nonfinite)
        if clip_val is not None:
            raise MisconfigurationError(
                "DeepSpeed clips gradients by total norm only; clip_val= (clipping by value) cannot be honoured. "
                "Use fabric.clip_gradients(model, optimizer, max_norm=...)."
            )
        if float(norm_type) != 2.0:
            raise MisconfigurationError(
                f"DeepSpeed clips by the 2-norm only; norm_type={norm_type} cannot be honoured. Use norm_type=2."
            )
        assert max_norm is not None
        configured = float(self.config.get("gradient_clipping", 0.0) or 0.0)
        if configured > 0 and configured != float(max_norm):
            raise conflict("gradient_clipping", configured, f"clip_gradients(max_norm={max_norm})")
        if max_norm <= 0:
            raise MisconfigurationError(f"max_norm must be positive, got {max_norm}.")
        self._clip_max_norm = float(max_norm)
        return None

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_io(self) -> DeepSpeedCheckpointIO | None:
        if self._engine is None or self._client_optimizer is None:
            return None
        return DeepSpeedCheckpointIO(
            self._engine, self._client_optimizer, self._param_groups, self.stage, self.world_size,
            guarded=self.guard.guarded, unguarded=self.guard.unguarded,
        )

    def checkpoint_shards(self, layout: str | None = None) -> ShardIO | None:
        if layout == DCPShards.layout:
            # FSDP's shards (another run of this job, before it changed strategy): DeepSpeed cannot re-cut
            # them into its flat partitions, so every rank reads them in full and loads that, as a file.
            return FullStateReader(DCPShards(self.guard.unguarded), self)
        if layout not in (None, DeepSpeedCheckpointIO.layout) or (layout is None and self.state_dict_type == "full"):
            return None
        io = self._checkpoint_io()
        if io is None and layout is not None:
            # A model set up without its optimizer (validate/test/predict(ckpt_path=...), a frozen model) is no
            # engine, so nothing here holds ZeRO partitions to load into: every rank merges the checkpoint's
            # partitions into full tensors and loads them as it would a single file's.
            return FullStateReader(DeepSpeedShards(), self)
        if io is None:
            raise CheckpointError(
                "A sharded DeepSpeed checkpoint is the engine's: set up the model with its optimizer first "
                "(`model, optimizer = fabric.setup(model, optimizer)`), or use state_dict_type='full'."
            )
        return io

    def _io_for(
        self, module: nn.Module | None = None, optimizer: Optimizer | None = None
    ) -> DeepSpeedCheckpointIO | None:
        """The engine's checkpoint helper if ``module``/``optimizer`` is the engine's (else None)."""
        io = self._checkpoint_io()
        if io is not None and ((module is not None and module is io.engine.module) or
                               (optimizer is not None and optimizer is io.optimizer)):
            return io
        return None

    def _io_of(self, kind: str, obj: Any) -> DeepSpeedCheckpointIO | None:
        """``_io_for`` of a state entry: ``obj`` is a module (``kind`` MODULE) or an optimizer."""
        return self._io_for(module=obj) if kind == MODULE else self._io_for(optimizer=obj)

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        io = self._io_for(module=module)
        return io.full_module_state() if io is not None else module.state_dict()

    def load_module_state_dict(self, module: nn.Module, state: dict[str, Any], strict: bool) -> None:
        io = self._io_for(module=module)
        if io is not None:
            io.load_full_module_state(state)
        else:
            super().load_module_state_dict(module, state, strict)

    def optimizer_state_dict(self, module: nn.Module | None, optimizer: Optimizer) -> dict[str, Any]:
        io = self._io_for(optimizer=optimizer)
        return io.full_optimizer_state() if io is not None else optimizer.state_dict()

    def load_optimizer_state_dict(self, module: nn.Module | None, optimizer: Optimizer, state: dict[str, Any]) -> None:
        io = self._io_for(optimizer=optimizer)
        if io is not None:
            io.load_full_optimizer_state(state)
        else:
            optimizer.load_state_dict(state)

    def local_state(self, kind: str, obj: Any, module: nn.Module | None) -> dict[str, Any]:
        """The engine's module and optimizer as this rank holds them (ZeRO partitions, live); anything else
        as under any strategy."""
        io = self._io_of(kind, obj)
        if io is None:
            return super().local_state(kind, obj, module)
        return io.local_module_state() if kind == MODULE else io.local_optimizer_state()

    def load_local_state(self, kind: str, obj: Any, saved: dict[str, Any], strict: bool) -> None:
        io = self._io_of(kind, obj)
        if io is None:
            super().load_local_state(kind, obj, saved, strict)
        elif kind == MODULE:
            io.load_local_module_state(saved, strict)
        else:
            io.load_local_optimizer_state(saved)

    def module_layout(self, module: nn.Module) -> tuple[str, Shapes]:
        io = self._io_for(module=module)
        return (type(module).__name__, io.module_layout()) if io is not None else super().module_layout(module)

    def _local_tensors(self, module: nn.Module) -> list[torch.Tensor]:
        # ZeRO-3 parameters are empty placeholders; this rank's values are in their ds_tensor partition.
        return [owned_values(t) if hasattr(t, "ds_tensor") else t for t in super()._local_tensors(module)]

    def release_module(self, forward_module: nn.Module) -> None:
        if self._is_engine(forward_module):
            self._destroy_engine()

    def _destroy_engine(self) -> None:
        destroy: Callable[[], None] | None = getattr(self._engine, "destroy", None)
        # Its destroy asks the process group for this rank. A Fabric whose group a later one took over is
        # torn down at exit after that one destroyed the group: the engine's hooks then go with the process.
        if destroy is not None and torch.distributed.is_initialized():
            destroy()
        self._engine, self._client_optimizer = None, None

    def teardown(self, error: BaseException | None = None) -> None:
        if self._engine is not None:
            self._destroy_engine()
        super().teardown(error)
