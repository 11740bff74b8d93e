"""What a per-rank snapshot holds, and putting it back (see :mod:`phalanx.checkpoint.rank_snapshot`).

The state is split once per write: every tensor of a module or optimizer becomes a :class:`TensorRef`
into the slot's data region (copied there by memory copies, at a fixed layout step after step), every
other tensor (RNG states, metric accumulators: small, and their shapes change) an :class:`InlineTensor`
holding its bytes, and what remains is plain values, pickled as the slot's metadata. The metadata is read
by an unpickler that knows those two placeholders and nothing else, so opening a snapshot runs no code.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.utils.errors import CheckpointError

_ALIGN = 64  # every tensor starts on a cache line: a dtype view of the byte buffer needs its alignment
Table = list[tuple[str, tuple[int, ...], bool]]  # per data-region tensor: dtype, shape, was a DTensor shard


class TensorRef:
    """Where a tensor was in the state: the index of its entry in the slot's table."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[type[TensorRef], tuple[int]]:
        return TensorRef, (self.index,)


class InlineTensor:
    """A small tensor outside the model and optimizer (an RNG state, a metric accumulator), kept in the metadata
    as bytes: copied when captured, and its size may change from step to step without moving the slot's layout."""

    __slots__ = ("data", "dtype", "shape", "sharded")

    def __init__(self, dtype: str, shape: tuple[int, ...], data: bytes, sharded: bool) -> None:
        self.dtype, self.shape, self.data, self.sharded = dtype, shape, data, sharded

    def __reduce__(self) -> tuple[type[InlineTensor], tuple[str, tuple[int, ...], bytes, bool]]:
        return InlineTensor, (self.dtype, self.shape, self.data, self.sharded)

    def tensor(self) -> torch.Tensor:
        empty = not self.data
        raw = torch.empty(0, dtype=torch.uint8) if empty else torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return raw.view(getattr(torch, self.dtype)).reshape(self.shape)


class LocalShard:
    """A DTensor's local shard read back from a snapshot: :func:`load_optimizer_local` rebuilds the DTensor
    with the live parameter's mesh and placements."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        # Called for everything but the exact builtin types (dict, list, tuple, str, int, float, ...).
        if obj in _PICKLED or type(obj) in _PICKLED:  # a class is pickled by reference too
            return NotImplemented
        raise CheckpointError(
            f"A snapshot holds tensors and plain Python values only (it must open without running code); the state "
            f"holds a {type(obj).__module__}.{type(obj).__qualname__}. Convert it in its state_dict()."
        )


def dump_metadata(payload: dict[str, Any]) -> bytes:
    body = io.BytesIO()
    _Pickler(body, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    return body.getvalue()


def load_metadata(raw: bytes) -> Any:
    """The metadata ``raw`` holds; refuses any class but the two placeholders."""
    return _Unpickler(io.BytesIO(raw)).load()


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name in ("TensorRef", "InlineTensor"):
            return TensorRef if name == "TensorRef" else InlineTensor
        raise pickle.UnpicklingError(f"a snapshot's metadata names {module}.{name}; only plain values are allowed")


_PICKLED: frozenset[type] = frozenset({TensorRef, InlineTensor})
_ATOMS = frozenset({int, float, str, bool, bytes, type(None)})
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def flatten(value: Any, tensors: list[torch.Tensor] | None, table: Table) -> Any:
    """``value`` with every tensor replaced by a :class:`TensorRef` (appended to ``tensors`` and ``table``), or
    with ``tensors=None`` by an :class:`InlineTensor`. Runs every step over the whole state: the common cases
    are tested first, by exact type."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is dict or isinstance(value, dict):
        if _ATOMS.issuperset(map(type, value.values())):  # counters, hyperparameters: copied in C
            return dict(value)
        return {k: flatten(v, tensors, table) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        to_local = getattr(value, "to_local", None)
        local = to_local() if to_local is not None else value
        name = _DTYPE_NAMES.get(local.dtype)
        if name is None:
            name = _DTYPE_NAMES[local.dtype] = str(local.dtype).removeprefix("torch.")
        if tensors is None:
            raw = local.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
            return InlineTensor(name, tuple(local.shape), raw, to_local is not None)
        table.append((name, tuple(local.shape), to_local is not None))
        tensors.append(local)
        return TensorRef(len(tensors) - 1)
    if kind is list or kind is tuple:
        if _ATOMS.issuperset(map(type, value)):  # checked in C; copied, as the owner may change a list later
            return value if kind is tuple else list(value)
        out = [flatten(v, tensors, table) for v in value]
        return out if kind is list else tuple(out)
    return value


def unflatten(value: Any, tensors: list[Any]) -> Any:
    if isinstance(value, TensorRef):
        return tensors[value.index]
    if isinstance(value, InlineTensor):
        return LocalShard(value.tensor()) if value.sharded else value.tensor()
    if type(value) is dict:
        return {k: unflatten(v, tensors) for k, v in value.items()}
    if type(value) is list or type(value) is tuple:
        out = [unflatten(v, tensors) for v in value]
        return out if type(value) is list else tuple(out)
    return value


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def data_size(table: Table) -> int:
    """The bytes :func:`extend` lays ``table`` out in, from an aligned start."""
    return sum(-(-_nbytes(getattr(torch, dtype), shape) // _ALIGN) * _ALIGN for dtype, shape, _ in table)


def extend(buffer: torch.Tensor, table: Table, start: int) -> tuple[list[torch.Tensor], list[int]]:
    """Views of ``buffer`` for ``table``'s tensors laid out from byte ``start``, and where each one ends."""
    views: list[torch.Tensor] = []
    ends: list[int] = []
    for dtype, shape, _ in table:
        kind = getattr(torch, dtype)
        end = start + _nbytes(kind, shape)
        if end > buffer.numel():
            return views, [*ends, end]  # does not fit: the caller maps a larger file
        views.append(buffer[start:end].view(kind).view(shape))
        ends.append(end)
        start = end + (-end % _ALIGN)
    return views, ends


def load_module_local(module: nn.Module, live: dict[str, Any], saved: dict[str, Any], strict: bool) -> None:
    """Copy ``saved`` (this rank's part of every entry) into ``live`` (the module's local state dict, whose
    tensors are its parameters and buffers or their shards) in place: no collective, nothing reallocated."""
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if strict and (missing or unexpected):
        raise CheckpointError(f"The snapshot does not fit {type(module).__name__}: missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}.")
    with torch.no_grad():
        for key, target in live.items():
            if key not in saved:
                continue
            to_local = getattr(target, "to_local", None)
            local = to_local() if callable(to_local) else target
            value = plain_values(saved[key])
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(local.shape):
                raise CheckpointError(f"The snapshot's {key!r} has shape {getattr(value, 'shape', None)}; this rank's "
                                      f"part of the model has {tuple(local.shape)}.")
            local.copy_(value)


def load_optimizer_local(optimizer: Optimizer, saved: dict[str, Any]) -> None:
    """Load ``saved`` (this rank's optimizer state) with ``optimizer.load_state_dict``; a shard becomes a
    DTensor again with the placements of the parameter it belongs to."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[Any, Any] = {}
    for index, per_param in saved.get("state", {}).items():
        param = params[index] if isinstance(index, int) and index < len(params) else None
        rebuilt = {}
        for name, value in per_param.items():
            if isinstance(value, LocalShard):
                if param is None or not callable(getattr(param, "to_local", None)):
                    raise CheckpointError(f"The snapshot's optimizer state {index}/{name} was sharded; the parameter "
                                          "it belongs to is not.")
                from torch.distributed.tensor import DTensor

                value = DTensor.from_local(value.tensor, param.device_mesh, param.placements, run_check=False,
                                           shape=param.shape, stride=param.stride())
            rebuilt[name] = value
        state[index] = rebuilt
    optimizer.load_state_dict({**saved, "state": state})


def plain_values(value: Any) -> Any:
    """``value`` with every :class:`LocalShard` replaced by its tensor (for states that are not sharded)."""
    if isinstance(value, LocalShard):
        return value.tensor
    if type(value) is dict:
        return {k: plain_values(v) for k, v in value.items()}
    if type(value) is list or type(value) is tuple:
        out = [plain_values(v) for v in value]
        return out if type(value) is list else tuple(out)
    return value
