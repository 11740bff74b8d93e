"""Opening a checkpoint without reading it: each tensor is read from disk when it is first used.

``lazy_load(path)`` opens a file written by ``torch.save`` (or ``fabric.save``) the way
``torch.load(path, mmap=True, weights_only=True, map_location="cpu")`` does: only tensors and plain
Python values are accepted (nothing in the file can run code), and tensor data stays in the file,
memory-mapped copy-on-write, until it is touched. Each tensor comes back as a
:class:`NotYetLoadedTensor`, which knows its shape and dtype without reading anything and becomes a
real tensor when a torch function receives it (``model.load_state_dict(lazy_load(path))`` copies one
parameter at a time) or when ``materialize()`` (Lightning: ``_load_tensor()``) is called. Converting a
checkpoint larger than memory therefore needs only as much memory as the tensors being worked on.

A phalanx checkpoint's checksums (:mod:`phalanx.checkpoint.checksums`) are verified lazily too: the
non-tensor values when the file is opened, each tensor when it is first loaded, which raises
``CheckpointError`` naming the tensor if its bytes changed since the save.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import phalanx.checkpoint.checksums as checksums
from phalanx.checkpoint.format import META_KEY, check_format, corrupt
from phalanx.utils.errors import CheckpointError

#: How a tensor is verified when first loaded: (file, entry, key, recorded crc).
Expected = tuple[Path, str, str, int]


class NotYetLoadedTensor:
    """A checkpoint tensor whose data has not been read yet (see the module docstring)."""

    def __init__(self, source: torch.Tensor, name: str = "", expected: Expected | None = None) -> None:
        self._source = source
        self._name = name
        self._expected = expected  # cleared once verified: each tensor is hashed once

    # What is known without touching the data.
    @property
    def shape(self) -> torch.Size:
        return self._source.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._source.dtype

    @property
    def device(self) -> torch.device:
        return self._source.device

    def size(self, dim: int | None = None) -> Any:
        return self._source.shape if dim is None else self._source.shape[dim]

    def dim(self) -> int:
        return self._source.dim()

    def numel(self) -> int:
        return self._source.numel()

    def _load_tensor(self) -> torch.Tensor:
        """Lightning's name of :meth:`materialize`."""
        return self.materialize()

    def materialize(self) -> torch.Tensor:
        """The tensor itself. Its pages are read from the file as they are used (copy-on-write: writing to
        it never changes the file)."""
        if self._expected is not None:
            file, entry, key, saved = self._expected
            now = checksums.tensor_crc(self._source)
            if now is not None and now != saved:
                raise corrupt([checksums.Mismatch(file, entry, key, saved, now)], file)
            self._expected = None
        return self._source

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        return func(*_loaded(tuple(args)), **_loaded(dict(kwargs or {})))

    def __getattr__(self, name: str) -> Any:
        # Anything else a tensor has (``.T``, ``.to(dtype)``, ``.float()``...) works on the loaded tensor.
        if name.startswith("__") or name in ("_source", "_name", "_expected"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        where = f"{self._name!r}, " if self._name else ""
        return f"NotYetLoadedTensor({where}shape={tuple(self.shape)}, dtype={self.dtype})"


def _loaded(value: Any) -> Any:
    if isinstance(value, NotYetLoadedTensor):
        return value.materialize()
    if isinstance(value, tuple):
        return tuple(_loaded(v) for v in value)
    if isinstance(value, list):
        return [_loaded(v) for v in value]
    if isinstance(value, dict):
        return {k: _loaded(v) for k, v in value.items()}
    return value


def _wrap(value: Any, name: str, expected: dict[int, Expected]) -> Any:
    if isinstance(value, torch.Tensor):
        return NotYetLoadedTensor(value, name, expected.get(id(value)))
    if isinstance(value, OrderedDict):
        return OrderedDict((k, _wrap(v, f"{name}.{k}" if name else str(k), expected)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: _wrap(v, f"{name}.{k}" if name else str(k), expected) for k, v in value.items()}
    if isinstance(value, list):
        return [_wrap(v, f"{name}[{i}]", expected) for i, v in enumerate(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_wrap(v, f"{name}[{i}]", expected) for i, v in enumerate(value))
    return value


def _expected(obj: Any, path: Path) -> dict[int, Expected]:
    """Each tensor's recorded checksum (by the tensor's id), after checking everything but tensor data
    now: the non-tensor values and the structure cost nothing to verify."""
    if not isinstance(obj, dict) or META_KEY not in obj:
        return {}  # not written by phalanx: no checksums
    record = check_format(obj[META_KEY], path)
    if record.get("within") or not isinstance(record.get("entries"), dict):
        return {}  # a marker's record: its entries sit under "extras"
    out: dict[int, Expected] = {}
    problems: list[checksums.Mismatch] = []
    for entry, rec in record["entries"].items():
        if entry not in obj:
            problems.append(checksums.Mismatch(path, entry, None, None, None, "the entry is missing"))
            continue
        now = checksums.plain_of(obj[entry])
        if now != rec.get("plain"):
            problems.append(checksums.Mismatch(path, entry, None, rec.get("plain"), now,
                                               "its non-tensor values or its structure changed"))
            continue
        try:
            for key, tensor, crc in checksums.expected_tensors(obj[entry], rec):
                if crc is not None:
                    out[id(tensor)] = (path, entry, key, crc)
        except ValueError as err:
            problems.append(checksums.Mismatch(path, entry, None, None, None, str(err)))
    if problems:
        raise corrupt(problems, path)
    return out


def lazy_load(path: str | Path) -> Any:
    """Open ``path`` with every tensor as a :class:`NotYetLoadedTensor` (see the module docstring)."""
    path = Path(path)
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except FileNotFoundError:
        raise
    except RuntimeError as err:
        if "mmap" in str(err) or "zip" in str(err).lower():
            raise CheckpointError(
                f"{path} is in torch's legacy (pre-1.6, non-zip) format, which cannot be opened lazily. Load it "
                "with torch.load(path, weights_only=True) and save it again with torch.save."
            ) from err
        raise
    return _wrap(obj, "", _expected(obj, path))
