"""Lightning's ``sharding_strategy`` and ``device_mesh`` arguments, mapped onto FSDP2.

Lightning's FSDPStrategy (on torch's FSDP1) names its sharding modes with FSDP1's ``ShardingStrategy``;
FSDP2 (``fully_shard``) expresses the same choices with two knobs, ``reshard_after_forward`` and the
shape of the mesh it is given (torch's own migration table):

* ``FULL_SHARD``: a 1-D mesh over every rank, ``reshard_after_forward=True``;
* ``SHARD_GRAD_OP``: the same mesh, ``reshard_after_forward=False`` (ZeRO-2: full parameters kept from
  forward to backward);
* ``HYBRID_SHARD``: a 2-D mesh ``(replicate, shard)``: parameters sharded within each group of
  ``shard`` ranks and replicated across the ``replicate`` groups (HSDP), ``reshard_after_forward=True``;
  ``_HYBRID_SHARD_ZERO2`` the same with ``reshard_after_forward=False``;
* ``NO_SHARD``: the 2-D mesh ``(world_size, 1)``: every rank holds whole parameters and gradients are
  all-reduced (DDP's arithmetic, on DTensors, so checkpoints and clipping work as for every FSDP mode).

The arguments are checked when the strategy is created (names, conflicts with ``reshard_after_forward``),
the mesh shape when Fabric knows the number of processes, and a ``DeviceMesh`` object when the processes
run. Lightning's other FSDP1 arguments (passed on to torch's FSDP1 constructor) are checked by
:func:`check_fsdp1_options`: ``limit_all_gathers=True`` and ``use_orig_params=True`` are what FSDP2 always
does, the rest are refused with what to use instead. Nothing here touches a process group, except
:func:`broadcast_replicas`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from phalanx.strategies.fsdp.gradients import local_tensor
from phalanx.utils.errors import MisconfigurationError

#: Lightning's names (FSDP1's ``ShardingStrategy`` members), in Lightning's order.
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
HYBRID_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
#: The names of the two dimensions of a hybrid mesh, in torch's order (``fully_shard`` shards the last).
HYBRID_MESH_DIMS = ("replicate", "shard")

# What each name means for reshard_after_forward, and its twin with the other value (same mesh).
_RESHARDS = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "NO_SHARD": False, "HYBRID_SHARD": True,
             "_HYBRID_SHARD_ZERO2": False}
_TWINS = {"FULL_SHARD": "SHARD_GRAD_OP", "SHARD_GRAD_OP": "FULL_SHARD", "HYBRID_SHARD": "_HYBRID_SHARD_ZERO2",
          "_HYBRID_SHARD_ZERO2": "HYBRID_SHARD"}


@dataclass(frozen=True)
class Sharding:
    """The sharding a strategy was asked for, checked: what ``fully_shard`` gets, except the mesh sizes."""

    strategy: str | None  # Lightning's name, upper case; None when not given
    reshard_after_forward: bool
    device_mesh: tuple[int, ...] | DeviceMesh | None  # as given (a list becomes a tuple)

    @property
    def hybrid(self) -> bool:
        """Whether parameters live on a 2-D ``(replicate, shard)`` mesh (HSDP, or NO_SHARD's replicas)."""
        if self.strategy in (*HYBRID_STRATEGIES, "NO_SHARD"):
            return True
        mesh = self.device_mesh
        return (mesh.ndim if isinstance(mesh, DeviceMesh) else len(mesh or ())) == 2


def _strategy_name(value: Any) -> str:
    # Strings any case (Lightning upper-cases them), or torch's ShardingStrategy (any enum: its member name).
    name = value.name if isinstance(value, enum.Enum) else value.upper() if isinstance(value, str) else None
    if name not in SHARDING_STRATEGIES:
        raise MisconfigurationError(
            f"sharding_strategy={value!r} is not a sharding strategy; choose one of "
            f"{', '.join(map(repr, SHARDING_STRATEGIES))} (or torch's ShardingStrategy member of that name)."
        )
    return str(name)


def _mesh_argument(device_mesh: Any) -> tuple[int, ...] | DeviceMesh | None:
    if device_mesh is None:
        return None
    if isinstance(device_mesh, DeviceMesh):
        if device_mesh.ndim not in (1, 2):
            raise MisconfigurationError(
                f"device_mesh has {device_mesh.ndim} dimensions; FSDP takes a 1-D mesh (sharding) or a 2-D mesh "
                f"{HYBRID_MESH_DIMS} (hybrid sharding)."
            )
        if device_mesh.ndim == 2 and device_mesh.mesh_dim_names is None:  # fully_shard asserts it, deep inside
            raise MisconfigurationError(
                "A 2-D device_mesh for hybrid sharding needs dimension names: init_device_mesh(device_type, "
                f"(replicate, shard), mesh_dim_names={HYBRID_MESH_DIMS}) (or pass the shape (replicate, shard))."
            )
        return device_mesh
    sizes = tuple(device_mesh) if isinstance(device_mesh, (tuple, list)) else ()
    if not sizes or len(sizes) > 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise MisconfigurationError(
            f"device_mesh={device_mesh!r}: pass a shape (replicate, shard) of positive ints, e.g. "
            "device_mesh=(num_nodes, devices_per_node), or a DeviceMesh."
        )
    return sizes


def resolve_sharding(sharding_strategy: Any, reshard_after_forward: bool | None, device_mesh: Any) -> Sharding:
    """Check the arguments against each other; ``reshard_after_forward=None`` means not given."""
    mesh = _mesh_argument(device_mesh)
    ndim = mesh.ndim if isinstance(mesh, DeviceMesh) else len(mesh or ())
    if sharding_strategy is None:
        return Sharding(None, True if reshard_after_forward is None else reshard_after_forward, mesh)
    name = _strategy_name(sharding_strategy)
    implied = _RESHARDS[name]
    if reshard_after_forward is not None and reshard_after_forward != implied:
        twin = _TWINS.get(name)
        alternative = (f" sharding_strategy={twin!r} is the same sharding with reshard_after_forward="
                       f"{reshard_after_forward}." if twin else " NO_SHARD never shards, so nothing is resharded.")
        raise MisconfigurationError(
            f"sharding_strategy={name!r} means reshard_after_forward={implied}, but reshard_after_forward="
            f"{reshard_after_forward} was passed too: pass only one of them.{alternative}"
        )
    if name == "NO_SHARD" and mesh is not None:
        raise MisconfigurationError(
            "sharding_strategy='NO_SHARD' replicates the whole model on every rank and takes no device_mesh. "
            "To shard within groups of ranks and replicate across them, pass sharding_strategy='HYBRID_SHARD' "
            "with device_mesh=(replicate, shard)."
        )
    if name in HYBRID_STRATEGIES and ndim == 1:
        raise MisconfigurationError(
            f"sharding_strategy={name!r} needs a 2-D device_mesh (replicate, shard), got a 1-D one. Pass "
            "device_mesh=(num_nodes, devices_per_node), or leave it out for that default."
        )
    if name in ("FULL_SHARD", "SHARD_GRAD_OP") and ndim == 2:
        hybrid = "HYBRID_SHARD" if name == "FULL_SHARD" else "_HYBRID_SHARD_ZERO2"
        raise MisconfigurationError(
            f"sharding_strategy={name!r} shards over every rank, but device_mesh has two dimensions (replicate, "
            f"shard): that is hybrid sharding, sharding_strategy={hybrid!r}."
        )
    return Sharding(name, implied, mesh)


# Lightning's FSDPStrategy hands its extra keyword arguments to FSDP1's constructor. FSDP2 has no such
# arguments; these are refused with what to do instead (limit_all_gathers and use_orig_params are named
# parameters of FSDPStrategy: FSDP2 always does what their default asks for).
_FSDP1_ONLY = {
    "backward_prefetch": "FSDP2 prefetches the next unit's all-gather in backward on its own",
    "forward_prefetch": "FSDP2 issues each unit's all-gather ahead of its forward on its own stream; explicit "
                        "prefetching is fully_shard's set_modules_to_forward_prefetch, in a parallelize_fn",
    "mixed_precision": "pass Fabric(precision=...), e.g. precision='bf16-mixed'",
    "sync_module_states": "seed every rank alike (fabric.seed_everything) or create the model with "
                          "fabric.init_module(empty_init=True), which initialises each shard once",
    "param_init_fn": "create the model inside fabric.init_module(empty_init=True): setup calls each module's "
                     "reset_parameters() on its shards",
    "device_id": "Fabric places each rank on its own device",
    "ignored_modules": "shard only some modules with parallelize_fn=fn(module, mesh)",
    "ignored_states": "shard only some modules with parallelize_fn=fn(module, mesh)",
    "process_group": "pass device_mesh= (a shape or a DeviceMesh)",
    "activation_checkpointing": "pass activation_checkpointing_policy={Block} (a set of module classes)",
}


def check_fsdp1_options(limit_all_gathers: bool, use_orig_params: bool, extra: dict[str, Any]) -> str | None:
    """Check Lightning's FSDP1-only arguments; refuse those FSDP2 cannot honour. Returns a one-line
    note for the user when an argument is accepted but has nothing to change (else None)."""
    given = sorted(extra.keys() & _FSDP1_ONLY.keys())
    if given:
        reasons = "; ".join(f"{name}: {_FSDP1_ONLY[name]}" for name in given)
        raise MisconfigurationError(
            f"FSDPStrategy runs on FSDP2 (fully_shard), which has no {', '.join(given)} argument (an FSDP1 option "
            f"Lightning passes on to torch): {reasons}. Drop the argument."
        )
    for name, value in (("limit_all_gathers", limit_all_gathers), ("use_orig_params", use_orig_params)):
        if not isinstance(value, bool):
            raise MisconfigurationError(f"{name} must be True or False, got {value!r}.")
    if not use_orig_params:
        raise MisconfigurationError(
            "use_orig_params=False asks FSDP1 to flatten each unit's parameters into one; FSDP2 always keeps the "
            "original parameters (as DTensor shards, under their own names), which is use_orig_params=True. "
            "Drop the argument: optimizers built from model.parameters() work unchanged."
        )
    if not limit_all_gathers:
        return (
            "FSDPStrategy(limit_all_gathers=False) has no effect: FSDP2 has no CPU rate limiter to turn off (its "
            "all-gathers are bounded by design, one unit ahead, without blocking the CPU); training is unchanged."
        )
    return None


def mesh_shape(sharding: Sharding, devices: int, num_nodes: int) -> tuple[int, ...]:
    """The mesh shape for ``devices * num_nodes`` processes (a DeviceMesh argument: its own shape). Hybrid
    sharding defaults to Lightning's ``(num_nodes, devices)``: shard within a node, replicate across nodes."""
    world = devices * num_nodes
    given = sharding.device_mesh
    if sharding.strategy == "NO_SHARD":
        return (world, 1)
    if isinstance(given, DeviceMesh):
        shape: tuple[int, ...] = tuple(given.shape)
    else:
        shape = given if given is not None else (num_nodes, devices) if sharding.hybrid else (world,)
    if math.prod(shape) != world:
        raise MisconfigurationError(
            f"device_mesh={shape} holds {math.prod(shape)} ranks, but the job has {world} processes (devices="
            f"{devices} x num_nodes={num_nodes}): the product of device_mesh must equal the world size, e.g. "
            f"device_mesh=({num_nodes}, {devices})."
        )
    return shape


def check_mesh_object(mesh: DeviceMesh, device_type: str) -> None:
    """A DeviceMesh passed as ``device_mesh`` must be on the strategy's devices (its size is checked by
    :func:`mesh_shape`)."""
    if mesh.device_type != device_type:
        raise MisconfigurationError(
            f"device_mesh is a {mesh.device_type!r} mesh, but the strategy runs on {device_type!r} devices."
        )


@torch.no_grad()
def broadcast_replicas(module: nn.Module, mesh: DeviceMesh) -> None:
    """Make the replicas of a hybrid mesh identical: every parameter shard and buffer takes the values of
    the first rank of its replicate group. ``fully_shard`` does not broadcast, so replicas created from
    different random streams (no seed, or ranks seeded differently, ``empty_init`` too) would train apart."""
    if mesh.ndim != 2 or mesh.size(0) == 1:
        return
    group = mesh.get_group(0)
    src = dist.get_global_rank(group, 0)
    for t in [*module.parameters(), *module.buffers()]:
        local = local_tensor(t).detach()
        buf = local if local.is_contiguous() else local.contiguous()
        dist.broadcast(buf, src=src, group=group)
        if buf is not local:
            local.copy_(buf)


__all__ = [
    "HYBRID_MESH_DIMS",
    "HYBRID_STRATEGIES",
    "SHARDING_STRATEGIES",
    "Sharding",
    "broadcast_replicas",
    "check_fsdp1_options",
    "check_mesh_object",
    "mesh_shape",
    "resolve_sharding",
]
