"""Tensor parallelism combined with FSDP2 on a 2-D device mesh ``("data_parallel", "tensor_parallel")``.

The user's ``parallelize_fn(model, device_mesh)`` applies torch's own sharding (``parallelize_module``
on ``device_mesh["tensor_parallel"]``, ``fully_shard`` on ``device_mesh["data_parallel"]``,
activation checkpointing, ``module.compile()``) in the order it chooses; everything else is the
FSDP strategy's (optimizer re-pointing, accumulation semantics, the lockstep guard, DCP
checkpoints). What this file adds is what goes wrong silently once a second mesh dimension exists:

* Data split by world rank. The ranks of one tensor-parallel group must see the *same* batch; split
  by global rank, each computes a different slice of a different batch and the result is garbage
  that still trains. ``distributed_sampler_kwargs`` is the data-parallel size and rank, and every
  sampler phalanx builds (Fabric and Trainer) asks for it.
* Replicas that drift. A parameter replicated along a mesh dimension (a ``RowwiseParallel`` bias, a
  LayerNorm sharded only by FSDP) must hold the same values on all its replicas. Meta-device
  materialization draws each rank's shards from its own random stream, so after initialization
  the replicated shards are broadcast from the first rank of that dimension.
* A gradient norm that counts replicas twice. Clipping sums the p-th powers of the local shards
  over the world, counting each shard once: only on the rank whose coordinate along every
  dimension the tensor is replicated over is zero.
* Gradients never averaged across data-parallel ranks. Parameters not sharded over
  ``"data_parallel"`` would be trained per rank; phalanx shards the root with ``fully_shard`` when
  ``parallelize_fn`` did not, and refuses a parameter that is still not covered.
"""

from __future__ import annotations

import datetime
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.optim import Optimizer

from phalanx.checkpoint.async_sharded import AsyncSaver
from phalanx.errors import MisconfigurationError
from phalanx.launch import ClusterEnvironment
from phalanx.precision import Precision
from phalanx.strategies._transforms import apply_activation_checkpointing, compile_in_place
from phalanx.strategies.base import Strategy
from phalanx.strategies.fsdp import FSDPStrategy, local_tensor
from phalanx.strategies.parallel import ParallelStrategy

MESH_DIMS = ("data_parallel", "tensor_parallel")


def _check_size(name: str, value: Any) -> None:
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise MisconfigurationError(f"{name} must be a positive int or 'auto', got {value!r}.")


def resolve_mesh_shape(data_parallel_size: int | str, tensor_parallel_size: int | str, devices: int,
                       num_nodes: int) -> tuple[int, int]:
    """``(dp, tp)`` for ``devices * num_nodes`` processes. Both "auto": tensor parallel within a node,
    data parallel across nodes (tensor parallelism communicates every layer; keep it on the fast link)."""
    world = devices * num_nodes
    _check_size("data_parallel_size", data_parallel_size)
    _check_size("tensor_parallel_size", tensor_parallel_size)
    if data_parallel_size == "auto" and tensor_parallel_size == "auto":
        dp, tp = num_nodes, devices
    elif data_parallel_size == "auto":
        assert isinstance(tensor_parallel_size, int)
        dp, tp = world // tensor_parallel_size, tensor_parallel_size
    elif tensor_parallel_size == "auto":
        assert isinstance(data_parallel_size, int)
        dp, tp = data_parallel_size, world // data_parallel_size
    else:
        assert isinstance(data_parallel_size, int) and isinstance(tensor_parallel_size, int)
        dp, tp = data_parallel_size, tensor_parallel_size
    if dp * tp != world:
        raise MisconfigurationError(
            f"data_parallel_size={data_parallel_size!r} x tensor_parallel_size={tensor_parallel_size!r} does not "
            f"match the {world} processes (devices={devices} x num_nodes={num_nodes}): their product must be "
            f"{world}, e.g. data_parallel_size={max(1, world // max(1, tp))}, tensor_parallel_size={tp}."
        )
    return dp, tp


class ModelParallelStrategy(FSDPStrategy):
    """2-D parallelism: tensor parallelism inside each data-parallel replica, FSDP across replicas.

    Args:
        parallelize_fn: ``fn(module, device_mesh)`` applying ``parallelize_module`` /
            ``fully_shard`` / activation checkpointing / ``module.compile()`` in place; returns the
            module or None. None: the module must already be parallelized (e.g. by your own code
            using ``fabric.strategy.device_mesh`` after ``launch``).
        data_parallel_size, tensor_parallel_size: the mesh shape; ``"auto"`` fills in the other
            (both ``"auto"``: tensor parallel over the devices of a node, data parallel over nodes).
        save_distributed_checkpoint: True: a sharded DCP directory (every rank writes its shards;
            loads at any mesh shape); False: one full file gathered on rank 0.
        process_group_backend: ``"gloo"`` / ``"nccl"`` (default: by device).
        timeout: seconds (or a ``timedelta``) a collective may wait for ranks that are on their way.
        activation_checkpointing_policy: set of module classes to recompute in backward, applied
            before ``parallelize_fn``.
        compile: ``True`` or a dict of ``torch.compile`` arguments: compile the root in place after
            ``parallelize_fn``.
        async_save: ``fabric.save`` stages the shards in memory, writes them in the background and
            returns an :class:`~phalanx.checkpoint.async_sharded.AsyncCheckpoint` (see that module).
        Other arguments: see :class:`~phalanx.strategies.parallel.ParallelStrategy`.
    """

    name: ClassVar[str] = "model_parallel"

    def __init__(
        self,
        parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module | None] | None = None,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: float | datetime.timedelta = 1800.0,
        *,
        activation_checkpointing_policy: set[type[nn.Module]] | None = None,
        compile: bool | dict[str, Any] = False,
        async_save: bool = False,
        **kwargs: Any,
    ) -> None:
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        super().__init__(
            activation_checkpointing_policy=activation_checkpointing_policy,
            state_dict_type="sharded" if save_distributed_checkpoint else "full",
            compile=compile,
            timeout=timeout,
            backend=process_group_backend,
            **kwargs,
        )
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise MisconfigurationError(
                f"parallelize_fn must be a function fn(module, device_mesh), got {parallelize_fn!r}."
            )
        if async_save and not save_distributed_checkpoint:
            raise MisconfigurationError(
                "async_save=True writes sharded checkpoints; it cannot be combined with "
                "save_distributed_checkpoint=False."
            )
        _check_size("data_parallel_size", data_parallel_size)
        _check_size("tensor_parallel_size", tensor_parallel_size)
        self.parallelize_fn = parallelize_fn
        self.data_parallel_size_arg, self.tensor_parallel_size_arg = data_parallel_size, tensor_parallel_size
        self.async_save = async_save
        self._shape: tuple[int, int] | None = None
        self._device_mesh: DeviceMesh | None = None
        self._saver = AsyncSaver()

    # ------------------------------------------------------------------ configuration and mesh
    def configure(self, *, device_type: str, devices: int, num_nodes: int, precision: str) -> None:
        # The shape is checked here, before any process starts, so a wrong size fails at Fabric(...).
        self._shape = resolve_mesh_shape(self.data_parallel_size_arg, self.tensor_parallel_size_arg, devices, num_nodes)
        super().configure(device_type=device_type, devices=devices, num_nodes=num_nodes, precision=precision)

    def select_precision(self, precision: str) -> Precision:
        # parallelize_fn calls fully_shard itself, so FSDP's own mixed-precision policy cannot be injected:
        # mixed precision is autocast (bf16) or autocast + GradScaler (16; it reduces its overflow flag
        # over the DTensor gradients' meshes). A MixedPrecisionPolicy passed to fully_shard still works.
        return Strategy.select_precision(self, precision)

    @property
    def data_parallel_size(self) -> int:
        return self._require_shape()[0]

    @property
    def tensor_parallel_size(self) -> int:
        return self._require_shape()[1]

    def _require_shape(self) -> tuple[int, int]:
        if self._shape is None:
            raise MisconfigurationError("The mesh shape is known once the strategy is passed to Fabric(strategy=...).")
        return self._shape

    def setup_environment(self, env: ClusterEnvironment | None) -> None:
        super().setup_environment(env)
        dp, tp = self._require_shape()
        with self.guard.guarded(f"setup_environment (device mesh {dp} x {tp})"):
            self._device_mesh = init_device_mesh(self.root_device.type, (dp, tp), mesh_dim_names=MESH_DIMS)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 2-D mesh ``("data_parallel", "tensor_parallel")`` (after ``fabric.launch()``)."""
        if self._device_mesh is None:
            raise MisconfigurationError(
                "The device mesh exists once the processes are launched: call fabric.launch() first."
            )
        return self._device_mesh

    @property
    def mesh(self) -> DeviceMesh:
        return self.device_mesh

    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        # Tensor-parallel peers must read the same samples: split by data-parallel rank only. The mesh is
        # row-major over the ranks (init_device_mesh), so rank r sits at (r // tp, r % tp).
        dp, tp = self._require_shape()
        return {"num_replicas": dp, "rank": self.global_rank // tp}

    def teardown(self) -> None:
        try:
            if self._guard is not None:
                self._saver.finish(self)
        finally:
            self._saver.close()
            self._device_mesh = None
            super().teardown()

    # ------------------------------------------------------------------ modules
    def setup_module(self, module: nn.Module) -> nn.Module:
        if id(module) in self._roots:
            raise MisconfigurationError("This module was already set up with ModelParallelStrategy; set it up once.")
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
        with self.guard.guarded("setup_module (model parallel: parallelize_fn and sharding)"):
            self._parallelize(module)
            if any(on_meta):
                with warnings.catch_warnings():
                    # torch warns that DTensor random ops are not coordinated on CPU meshes: phalanx gives
                    # each rank its own stream and makes replicated shards agree below (_sync_replicas).
                    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
                    self._materialize(module)  # FSDP's: to_empty + reset_parameters, a random stream per rank
            elif self.root_device.type != "cpu":
                module.to(self.root_device)  # what parallelize_fn left unsharded (buffers, frozen parts)
            self._sync_replicas(module)
            if isinstance(module, FSDPModule):
                try:
                    module._get_fsdp_state()._lazy_init()
                except (RuntimeError, ValueError) as err:
                    raise MisconfigurationError(
                        f"FSDP could not set up {type(module).__name__}: {err}. Parameters shared between modules "
                        "(tied weights) must live in one fully_shard unit."
                    ) from err
        self._stale.update(originals)
        self._install_hooks(module)
        compile_in_place(module, self.compile_options)
        return module

    def _parallelize(self, module: nn.Module) -> None:
        if self.parallelize_fn is not None:
            out = self.parallelize_fn(module, self.device_mesh)
            if out is not None and out is not module:
                raise MisconfigurationError(
                    "parallelize_fn must modify the module in place (parallelize_module, fully_shard and "
                    "module.compile() do) and return it or None; it returned a different object"
                    f" ({type(out).__name__}). torch.compile(module) returns a wrapper: use module.compile()."
                )
        elif not any(isinstance(p, DTensor) for p in module.parameters()):
            raise MisconfigurationError(
                f"ModelParallelStrategy has no parallelize_fn and {type(module).__name__} is not parallelized. Pass "
                "ModelParallelStrategy(parallelize_fn=fn), where fn(module, device_mesh) applies parallelize_module "
                "with device_mesh['tensor_parallel'] and fully_shard with device_mesh['data_parallel']."
            )
        dp_mesh = self.device_mesh["data_parallel"]
        if dp_mesh.size() > 1 and not isinstance(module, FSDPModule):
            # Parameters outside every fully_shard unit would never be averaged across replicas.
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=self.reshard_after_forward)
        uncovered = [n for n, p in module.named_parameters()
                     if p.requires_grad and dp_mesh.size() > 1 and "data_parallel" not in self._layout(n, p)[0]]
        if uncovered:
            raise MisconfigurationError(
                f"Parameters {uncovered[:8]} are not sharded over the 'data_parallel' mesh dimension, so their "
                "gradients would never be averaged across data-parallel ranks. Apply fully_shard(..., "
                "mesh=device_mesh['data_parallel']) to the modules that hold them in parallelize_fn."
            )

    def _layout(self, name: str, t: torch.Tensor) -> tuple[frozenset[str], frozenset[str]]:
        """``(sharded, replicated)`` mesh dimensions of ``t`` (a plain tensor is replicated over both)."""
        if not isinstance(t, DTensor):
            return frozenset(), frozenset(MESH_DIMS)
        names = t.device_mesh.mesh_dim_names
        if not names or not set(names) <= set(MESH_DIMS):
            raise MisconfigurationError(
                f"{name} is distributed over a device mesh with dimensions {names}, not one derived from the "
                f"strategy's {MESH_DIMS}. Use the device_mesh passed to parallelize_fn: "
                "device_mesh['tensor_parallel'] for parallelize_module, device_mesh['data_parallel'] for fully_shard."
            )
        # Not `is_shard()`: FSDP over a tensor-parallel shard is a `_StridedShard`, which answers False.
        sharded = frozenset(n for n, pl in zip(names, t.placements) if not (pl.is_replicate() or pl.is_partial()))
        return sharded, frozenset(MESH_DIMS) - sharded

    @torch.no_grad()
    def _sync_replicas(self, module: nn.Module) -> None:
        """Make every replicated shard equal to the one on the first rank of its mesh dimension."""
        mesh = self.device_mesh
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            _, replicated = self._layout(name, t)
            local = local_tensor(t).detach()
            for dim in MESH_DIMS:
                if dim not in replicated or mesh[dim].size() == 1:
                    continue
                group = mesh.get_group(dim)
                buf = local if local.is_contiguous() else local.contiguous()
                dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
                if buf is not local:
                    local.copy_(buf)

    # ------------------------------------------------------------------ steps
    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        self.check_ready_to_step(optimizer)
        if getattr(self.precision, "scaler", None) is None:
            return self.precision.optimizer_step(optimizer, **kwargs)
        # The GradScaler reduces its overflow flag over the gradients' meshes: collectives torch issues.
        with self.guard.unguarded("optimizer step (loss-scaler overflow check across ranks)"):
            return self.precision.optimizer_step(optimizer, **kwargs)

    def clip_gradients(
        self,
        optimizer: Optimizer,
        max_norm: float | None,
        clip_val: float | None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        with self.guard.unguarded("clip_gradients (loss-scaler unscale)"):
            self.precision.unscale_gradients(optimizer)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if clip_val is not None:
            for grad in grads:
                local_tensor(grad).clamp_(-clip_val, clip_val)
            return None
        assert max_norm is not None
        p = float(norm_type)
        coordinate = dict(zip(MESH_DIMS, self.device_mesh.get_coordinate() or (0, 0)))
        norms = []
        for grad in grads:
            if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
                with self.guard.unguarded("clip_gradients (reduce a partial gradient)"):
                    grad = grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl
                                                                for pl in grad.placements])
            _, replicated = self._layout("a gradient", grad)
            if any(coordinate[dim] for dim in replicated):
                continue  # a copy of a shard that the first rank along `dim` counts
            norms.append(torch.linalg.vector_norm(local_tensor(grad).detach(), p, dtype=torch.float32)
                         .to(self.root_device))
        stacked = torch.stack(norms) if norms else torch.zeros(1, device=self.root_device)
        name = "clip_gradients (global gradient norm over both mesh dimensions)"
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
        # Only tensors sharded over no mesh dimension hold the same values on every rank.
        kept = [(n, local_tensor(t)) for n, t in named if not self._layout(n, t)[0]]
        ParallelStrategy.verify_in_sync(self, kept, what, rtol, atol)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path, state: dict[str, Any]) -> Any:
        """Sharded or full save; with ``async_save`` the sharded write runs in the background and the
        handle is returned (the next save, load or teardown waits for it)."""
        if self.async_save and self.state_dict_type == "sharded":
            with self.internal_state_dict():
                return self._saver.save(self, Path(path), state)
        self._saver.finish(self)
        super().save_checkpoint(path, state)
        return None

    def load_checkpoint(self, path: str | Path, state: dict[str, Any] | None, strict: bool) -> dict[str, Any]:
        self._saver.finish(self)
        return super().load_checkpoint(path, state, strict)


__all__ = ["MESH_DIMS", "ModelParallelStrategy", "resolve_mesh_shape"]
