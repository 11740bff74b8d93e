"""The meaning of ``fabric.all_gather`` / ``fabric.all_reduce`` for every kind of input.

The failures this prevents: a ported ``fabric.all_gather(flag)`` that returns a Python bool on every
rank instead of every rank's values; code that works on N ranks and breaks on one because a leading
dimension appears or not depending on the world size; ``all_gather(x, sync_grads=True)`` whose
result has no gradient path back to the ranks that produced it; and the mean of an integer tensor
silently truncated.

The collectives themselves are the strategy's (guarded, lockstep-checked); this module only shapes
inputs and outputs (:class:`Collectives`, owned by :class:`phalanx.Fabric`), next to the meaning they implement.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.tensors import apply_to_tensors

if TYPE_CHECKING:
    from phalanx.strategies import Strategy

_OP_NAMES = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min", "product": "product",
             "prod": "product"}


def to_tensors(data: Any, device: torch.device, float_ints: bool = False) -> Any:
    """Python numbers and bools become tensors on ``device`` (anywhere in a collection); tensors
    elsewhere are moved there (a moved tensor is a new tensor: in-place results land on the copy).
    ``float_ints``: Python ints become float tensors (their mean is then exact)."""
    if isinstance(data, int) and not isinstance(data, bool) and float_ints:
        return torch.tensor(float(data), device=device)
    if isinstance(data, (bool, int, float)):
        return torch.tensor(data, device=device)
    if isinstance(data, dict):
        return type(data)({k: to_tensors(v, device, float_ints) for k, v in data.items()})
    if isinstance(data, (list, tuple)) and not hasattr(data, "_fields"):
        return type(data)(to_tensors(v, device, float_ints) for v in data)
    return apply_to_tensors(data, lambda t: t if t.device == device else t.to(device))


class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward sums every rank's gradient for this rank's slice (the gradient of a
    loss each rank computed on the gathered tensor), with the strategy's guarded collectives."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, strategy: Any) -> torch.Tensor:
        ctx.strategy = strategy
        gathered: torch.Tensor = strategy.all_gather(tensor.detach())
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        strategy = ctx.strategy
        summed: torch.Tensor = strategy.all_reduce(grad.contiguous(), "sum")
        return summed[strategy.global_rank], None


def gather(strategy: Any, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
    if tensor.dtype is torch.bool:  # not every backend gathers bools; the values survive a round trip
        return gather(strategy, tensor.to(torch.uint8)).to(torch.bool)
    if strategy.world_size == 1:
        return tensor.unsqueeze(0)  # differentiable already
    if sync_grads and tensor.requires_grad:
        out: torch.Tensor = _GatherWithGrad.apply(tensor, strategy)  # type: ignore[no-untyped-call]
        return out
    gathered: torch.Tensor = strategy.all_gather(tensor)
    return gathered


def reduce_op_name(reduce_op: Any) -> str:
    if isinstance(reduce_op, str) and reduce_op.lower() in _OP_NAMES:
        return _OP_NAMES[reduce_op.lower()]
    by_enum = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min",
               dist.ReduceOp.PRODUCT: "product"}
    avg = getattr(dist.ReduceOp, "AVG", None)
    if avg is not None:
        by_enum[avg] = "mean"
    for enum, name in by_enum.items():
        if reduce_op == enum:
            return name
    raise MisconfigurationError(
        f"reduce_op={reduce_op!r}; use 'mean', 'sum', 'max', 'min', 'product' or a torch.distributed.ReduceOp."
    )


def reduce(strategy: Any, tensor: torch.Tensor, op: str) -> torch.Tensor:
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise MisconfigurationError(
            f"all_reduce(reduce_op='mean') of a {tensor.dtype} tensor would be truncated to an integer; convert it "
            "with .float() first, or reduce with 'sum' and divide."
        )
    out: torch.Tensor = tensor if strategy.world_size == 1 else strategy.all_reduce(tensor, op)
    if out is tensor or tensor.requires_grad:
        return out
    tensor.copy_(out)  # Lightning's meaning: the input tensor holds the result
    return tensor


class Collectives:
    """The collectives of one Fabric over its strategy's guarded, lockstep-checked ones: what each kind of
    input becomes on the way in and out. The caller has joined the job."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy

    def barrier(self, name: str | None) -> None:
        self._strategy.barrier(name or "barrier")

    def broadcast(self, obj: Any, src: int) -> Any:
        return self._strategy.broadcast(obj, src)

    def all_gather(self, data: Any, group: Any, sync_grads: bool) -> Any:
        _no_group(group, "all_gather")
        each = functools.partial(gather, self._strategy, sync_grads=sync_grads)
        return apply_to_tensors(to_tensors(data, self._strategy.root_device), each)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._strategy.all_gather_object(obj)

    @contextlib.contextmanager
    def rank_zero_first(self, local: bool) -> Iterator[None]:
        strategy = self._strategy
        first = (strategy.local_rank if local else strategy.global_rank) == 0
        if not first:
            strategy.barrier("rank_zero_first")
        yield
        if first:
            strategy.barrier("rank_zero_first")

    def all_reduce(self, data: Any, group: Any, reduce_op: Any) -> Any:
        _no_group(group, "all_reduce")
        op = reduce_op_name(reduce_op)
        each = functools.partial(reduce, self._strategy, op=op)
        return apply_to_tensors(to_tensors(data, self._strategy.root_device, float_ints=op == "mean"), each)


def _no_group(group: Any, what: str) -> None:
    if group is not None:
        raise MisconfigurationError(
            f"{what}(group=...) is not supported: phalanx's collectives span all ranks (and are checked for lockstep "
            "across them). Gather over all ranks and select the ranks you need."
        )
