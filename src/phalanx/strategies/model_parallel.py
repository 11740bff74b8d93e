"""Tensor parallelism combined with FSDP2 on a 2-D device mesh ``("data_parallel", "tensor_parallel")``.

The user's ``parallelize_fn(model, device_mesh)`` applies torch's own sharding (``parallelize_module``
on ``device_mesh["tensor_parallel"]``, ``fully_shard`` on ``device_mesh["data_parallel"]``,
activation checkpointing, ``module.compile()``) in the order it chooses; everything else is the
FSDP strategy's (setup, optimizer re-pointing, accumulation semantics, clipping over every mesh the
gradients live on, the lockstep guard, DCP checkpoints, asynchronous saves). What this file adds is
what goes wrong silently once a second mesh dimension exists:

* Data split by world rank. The ranks of one tensor-parallel group must see the *same* batch; split
  by global rank, each computes a different slice of a different batch and the result is garbage
  that still trains. ``distributed_sampler_kwargs`` is the data-parallel size and rank, and every
  sampler phalanx builds (Fabric and Trainer) asks for it.
* Replicas that drift. A parameter replicated along a mesh dimension (a ``RowwiseParallel`` bias, a
  LayerNorm sharded only by FSDP) must hold the same values on all its replicas. Meta-device
  materialization gives every rank the same full values (:mod:`phalanx.strategies.fsdp.materialize`),
  but ranks seeded differently would not agree, so after initialization the replicated shards are
  broadcast from the first rank of that dimension.
* Gradients never averaged across data-parallel ranks. Parameters not sharded over
  ``"data_parallel"`` would be trained per rank; phalanx shards the root with ``fully_shard`` when
  ``parallelize_fn`` did not, and refuses a parameter that is still not covered.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from phalanx.distributed.launch import ClusterEnvironment
from phalanx.precision import MixedPrecision, Precision
from phalanx.strategies.base import Strategy
from phalanx.strategies.fsdp.gradients import local_tensor
from phalanx.strategies.fsdp.precision import ShardedMixedPrecision
from phalanx.strategies.fsdp.strategy import ShardedStrategy
from phalanx.strategies.parallel import ParallelStrategy
from phalanx.utils.compat import FSDPModule, fully_shard
from phalanx.utils.errors import MisconfigurationError

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


class ModelParallelStrategy(ShardedStrategy):
    """2-D parallelism: tensor parallelism inside each data-parallel replica, FSDP across replicas.

    It shares FSDPStrategy's code (:class:`~phalanx.strategies.fsdp.strategy.ShardedStrategy`) but is not an
    FSDPStrategy, as in Lightning: ``isinstance(strategy, FSDPStrategy)`` is False.

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
        async_save: ``fabric.save`` copies the shards into memory, writes them in the background and
            returns an :class:`~phalanx.checkpoint.async_sharded.AsyncCheckpoint` (FSDPStrategy's option).
        Other arguments: see :class:`~phalanx.strategies.parallel.ParallelStrategy`.
    """

    name: ClassVar[str] = "model_parallel"
    #: Not offered yet: a tensor-parallel group's ranks hold different shards of one replica (untested with torchft).
    supports_replica_groups: ClassVar[bool] = False

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
        fsdp1 = sorted({"limit_all_gathers", "use_orig_params"} & kwargs.keys())
        if fsdp1:  # FSDPStrategy's Lightning FSDP1 arguments; Lightning's ModelParallelStrategy takes none either
            raise MisconfigurationError(
                f"ModelParallelStrategy takes no {' or '.join(fsdp1)} (FSDPStrategy's FSDP1 arguments): FSDP2, which "
                "parallelize_fn applies, always keeps the original parameters and bounds its all-gathers itself."
            )
        given = sorted({"sharding_strategy", "device_mesh"} & kwargs.keys())
        if given:  # FSDPStrategy's options: this strategy's mesh is data_parallel_size x tensor_parallel_size
            raise MisconfigurationError(
                f"ModelParallelStrategy takes no {' or '.join(given)}: its mesh is (data_parallel_size, "
                "tensor_parallel_size), and parallelize_fn decides how each dimension shards. For hybrid sharding "
                "without tensor parallelism use FSDPStrategy(sharding_strategy='HYBRID_SHARD', device_mesh=...)."
            )
        if async_save and not save_distributed_checkpoint:
            raise MisconfigurationError(
                "async_save=True writes sharded checkpoints; it cannot be combined with "
                "save_distributed_checkpoint=False."
            )
        super().__init__(
            activation_checkpointing_policy=activation_checkpointing_policy,
            state_dict_type="sharded" if save_distributed_checkpoint else "full",
            compile=compile,
            async_save=async_save,
            timeout=timeout,
            backend=process_group_backend,
            **kwargs,
        )
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise MisconfigurationError(
                f"parallelize_fn must be a function fn(module, device_mesh), got {parallelize_fn!r}."
            )
        _check_size("data_parallel_size", data_parallel_size)
        _check_size("tensor_parallel_size", tensor_parallel_size)
        self.parallelize_fn = parallelize_fn
        self.data_parallel_size_arg, self.tensor_parallel_size_arg = data_parallel_size, tensor_parallel_size
        self._shape: tuple[int, int] | None = None
        self._device_mesh: DeviceMesh | None = None

    # ------------------------------------------------------------------ configuration and mesh
    def configure(self, *, device_type: str, devices: int, num_nodes: int, precision: str) -> None:
        # The shape is checked here, before any process starts, so a wrong size fails at Fabric(...).
        self._shape = resolve_mesh_shape(self.data_parallel_size_arg, self.tensor_parallel_size_arg, devices, num_nodes)
        super().configure(device_type=device_type, devices=devices, num_nodes=num_nodes, precision=precision)

    def select_precision(self, precision: str) -> Precision:
        # parallelize_fn calls fully_shard itself, so FSDP's own mixed-precision policy cannot be injected:
        # mixed precision is autocast (bf16) or autocast + GradScaler (16; it reduces its overflow flag
        # over the DTensor gradients' meshes). A MixedPrecisionPolicy passed to fully_shard still works.
        plugin = Strategy.select_precision(self, precision)
        if isinstance(plugin, MixedPrecision):
            return ShardedMixedPrecision(plugin.dtype, self.device_type, self.guarded)
        return plugin

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

    def teardown(self, error: BaseException | None = None) -> None:
        try:
            super().teardown(error)
        finally:
            self._device_mesh = None

    # ------------------------------------------------------------------ modules
    # ShardedStrategy.setup_module does the rest (meta check, precision, activation checkpointing, FSDP's
    # root, the direct-call guards, compile); these are the steps that differ.
    def _materialize(self, module: nn.Module) -> None:
        with warnings.catch_warnings():
            # torch warns that DTensor random ops are not coordinated on CPU meshes: phalanx draws full
            # tensors instead (fsdp/materialize.py); a reset_parameters that draws into a child's DTensor
            # still would, and replicated shards are made to agree after.
            warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
            super()._materialize(module)

    def _after_sharding(self, module: nn.Module) -> None:
        if self.root_device.type != "cpu":
            module.to(self.root_device)  # what parallelize_fn left unsharded (buffers, frozen parts)
        self._sync_replicas(module)

    def _shard(self, module: nn.Module) -> None:
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
    def verify_in_sync(
        self, named: list[tuple[str, torch.Tensor]], what: str, rtol: float = 1e-5, atol: float = 0.0
    ) -> None:
        # Only tensors sharded over no mesh dimension hold the same values on every rank.
        kept = [(n, local_tensor(t)) for n, t in named if not self._layout(n, t)[0]]
        ParallelStrategy.verify_in_sync(self, kept, what, rtol, atol)


__all__ = ["MESH_DIMS", "ModelParallelStrategy", "resolve_mesh_shape"]
