"""What a per-rank snapshot holds, and putting it back (see :mod:`phalanx.checkpoint.snapshot.writer`).

The state is pickled once per write with every tensor taken out: a tensor (a module's, an optimizer's,
an RNG state, a metric accumulator) goes into the slot's data region, copied there by memory copies at a
layout that stays put from step to step, and the pickle keeps only its index. What the pickle holds
besides is builtins (dicts, lists, tuples, numbers, strings, bytes).

This is for cost and for safety. The pickler is C code that calls back into Python only for what is not a
builtin: one call per tensor, none per dict or list (walking the state in Python first cost a quarter of a
snapshot). The reader's unpickler knows three builtin containers and the data region's tensors and no
other name, so opening a snapshot runs no code; anything else in the state is refused when it is written.
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
_CONTAINERS = {"dict": dict, "list": list, "tuple": tuple}
_DTYPE_NAMES: dict[torch.dtype, str] = {}


class LocalShard:
    """A DTensor's local shard read back from a snapshot: :func:`load_optimizer_local` rebuilds the DTensor
    with the live parameter's mesh and placements."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def tensor_at(index: int) -> Any:
    """How the metadata names the data region's tensor ``index`` (the reader resolves the name itself)."""
    raise CheckpointError(f"tensor {index} of a snapshot is read with phalanx.checkpoint.snapshot.writer")


class Capture(pickle.Pickler):
    """Pickles the state's structure and plain values into ``file``; each tensor is appended to :attr:`tensors`
    (a DTensor: its local shard) and :attr:`table` instead, and the pickle keeps its index. One ``Capture``
    may :meth:`dump` several values in a row (one per entry): a :class:`Reader` loads them in the same order."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.table: Table = []

    def reducer_override(self, obj: Any) -> Any:
        # Called only for what is not an exact builtin (dict, list, tuple, str, int, float, bytes, None, bool).
        kind = type(obj)
        if kind is torch.Tensor or isinstance(obj, torch.Tensor):
            to_local = None if kind is torch.Tensor else getattr(obj, "to_local", None)  # a DTensor: its shard
            local = to_local() if to_local is not None else obj
            name = _DTYPE_NAMES.get(local.dtype)
            if name is None:
                name = _DTYPE_NAMES[local.dtype] = str(local.dtype).removeprefix("torch.")
            self.table.append((name, tuple(local.shape), to_local is not None))
            self.tensors.append(local)
            return tensor_at, (len(self.tensors) - 1,)
        if obj is tensor_at or obj is dict or obj is list or obj is tuple:
            return NotImplemented  # a name the reader resolves
        if isinstance(obj, dict):  # state_dict()'s OrderedDict: a dict
            return dict, (dict(obj),)
        if isinstance(obj, tuple):  # torch.Size, a named tuple
            return tuple, (tuple(obj),)
        if isinstance(obj, list):
            return list, (list(obj),)
        raise CheckpointError(
            f"A snapshot holds tensors and plain Python values only (it must open without running code); the state "
            f"holds a {kind.__module__}.{kind.__qualname__}. Convert it in its state_dict()."
        )


class Reader(pickle.Unpickler):
    """Loads what a :class:`Capture` wrote, in the same order, once :attr:`values` holds the data region's
    tensors. Any name but the builtin containers and :func:`tensor_at` is refused: opening runs no code."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.values: list[Any] = []

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _CONTAINERS:
            return _CONTAINERS[name]
        if module == __name__ and name == "tensor_at":
            return self.values.__getitem__
        raise pickle.UnpicklingError(f"a snapshot's metadata names {module}.{name}; only plain values are allowed")


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def data_size(table: Table) -> int:
    """The bytes :func:`extend` lays ``table`` out in, from an aligned start."""
    return sum(-(-_nbytes(getattr(torch, dtype), shape) // _ALIGN) * _ALIGN for dtype, shape, _ in table)


def extend(buffer: torch.Tensor, table: Table, start: int) -> tuple[list[torch.Tensor], list[int]]:
    """Views of ``buffer`` for ``table``'s tensors laid out from byte ``start`` (or the next aligned byte: it
    may be where the previous tensor ended), and where each one ends. The reader lays the whole table out
    from the data offset; a writer extending a kept prefix from its last end gets the same offsets."""
    views: list[torch.Tensor] = []
    ends: list[int] = []
    for dtype, shape, _ in table:
        kind = getattr(torch, dtype)
        start += -start % _ALIGN
        end = start + _nbytes(kind, shape)
        if end > buffer.numel():
            return views, [*ends, end]  # does not fit: the caller maps a larger file
        views.append(buffer[start:end].view(kind).view(shape))
        ends.append(end)
        start = end
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
