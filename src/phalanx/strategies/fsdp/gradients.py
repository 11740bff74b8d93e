"""Numbers across shards: this rank's part of a DTensor, the gradient norm over every shard of every
rank, and whether the backend's reduce-scatter really averages.

Apart from the strategy because the arithmetic is where sharding silently gives wrong answers (a local
shard's norm, a summed instead of averaged gradient) and each piece is tested on its own;
:mod:`phalanx.strategies.model_parallel` uses the same helpers on its 2-D mesh.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from phalanx.utils.errors import MisconfigurationError


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (the tensor itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor split (not only replicated) along some mesh dimension of more than one
    rank (NO_SHARD's mesh ``(world_size, 1)`` "shards" over a single rank: every rank holds it whole)."""
    return isinstance(t, DTensor) and any(
        p.is_shard() and t.device_mesh.size(dim) > 1 for dim, p in enumerate(t.placements)
    )


def reduce_scatter_averages(world_size: int) -> bool:
    """Whether the default process group's reduce-scatter with ``ReduceOp.AVG`` averages. FSDP2 reduces
    float32/bfloat16 gradients with it; older torch's gloo silently summed instead (pytorch issue
    162338), which makes every gradient ``world_size`` times too large."""
    out = torch.zeros(1)
    try:
        dist.reduce_scatter_tensor(out, torch.ones(world_size), op=dist.ReduceOp.AVG)
    except RuntimeError:  # a backend that refuses AVG outright
        return False
    return bool(out.item() == 1.0)


def all_reduce_averages(world_size: int) -> bool:
    """Whether the default process group's all-reduce with ``ReduceOp.AVG`` averages. Hybrid sharding
    (HSDP) averages gradients across its replicas with it; a backend that refuses or sums is caught here,
    at launch, instead of in the first backward (or never)."""
    out = torch.full((1,), float(dist.get_rank() + 1))
    try:
        dist.all_reduce(out, op=dist.ReduceOp.AVG)
    except RuntimeError:
        return False
    return bool(out.item() == (world_size + 1) / 2)


def clip_grad_norm(
    params: list[torch.Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> torch.Tensor:
    """Scale the gradients so that their norm over every shard of every rank is at most ``max_norm``;
    returns that norm (a plain tensor, the same on every rank).

    Any mesh works, 1-D (FSDP) or 2-D (hybrid sharding, whose norm torch reduces over the shard dimension
    and leaves replicated over the replicate one). Gradients may live on different meshes (tensor parallel
    x FSDP: a parameter sharded by FSDP alone is on the 1-D data-parallel mesh, a tensor-parallel one on
    the 2-D mesh), and torch cannot stack
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


__all__ = ["all_reduce_averages", "clip_grad_norm", "is_sharded", "local_tensor", "reduce_scatter_averages"]
