"""Any checkpoint, opened for reading tensor by tensor in one plain process (no process group): the one
reader of the checkpoint layer's format.

``open_source(path)`` recognises the three layouts phalanx writes (one file; a directory of
``torch.distributed.checkpoint`` shards plus the marker file; a directory holding DeepSpeed's engine
checkpoint plus the marker), a plain DCP directory written without phalanx, and a file from
``torch.save(model.state_dict())``. It reads only metadata: the result's ``tree`` holds the entries with
every tensor either real (a memory-mapped file's) or a ``meta`` placeholder of the right shape and dtype
whose data ``Source.load`` reads when asked. Converting a checkpoint therefore holds about one tensor
(or one batch of shards) in memory at a time, not the whole checkpoint (``phalanx ckpt``).
``read_everything(path)`` is the same reader with every tensor read: what ``fabric.load(path)`` without
state, ``load_from_checkpoint`` and a strategy that cannot re-cut another's shards get.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import phalanx.checkpoint.checksums as checksums
import phalanx.checkpoint.snapshot as snapshot
import phalanx.checkpoint.storage as storage
from phalanx.checkpoint.deepspeed_shards import open_deepspeed
from phalanx.checkpoint.format import (
    DCP_LAYOUT,
    DEEPSPEED_LAYOUT,
    MARKER,
    META_KEY,
    check_directory,
    check_format,
    corrupt,
    looks_like_raw_state_dict,
    read_file,
)
from phalanx.checkpoint.protocol import (
    MODULE,
    PLAIN_DCP,
    SAFETENSORS,
    SHARDED,
    SINGLE,
    STATE_DICT,
    Source,
    guess_kind,
    placeholder,
    tensors,
)
from phalanx.utils import diagnostics
from phalanx.utils.errors import CheckpointError

#: ``phalanx ckpt convert --to safetensors`` writes a directory with these (and config.json if given).
SAFETENSORS_FILE, SAFETENSORS_CHECKSUMS = "model.safetensors", "phalanx_checksums.json"
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}
#: dcp.load calls read shards in batches of about this many bytes (fewer calls; bounded memory).
BATCH_BYTES = 16 * 2**20


# ---------------------------------------------------------------------- where a checkpoint is
@dataclass(frozen=True)
class Found:
    """A checkpoint on disk: ``path`` (the previous checkpoint's ``.old-`` copy when ``recovered``),
    and ``problem``: why it cannot be loaded, or None."""

    path: Path
    recovered: bool
    problem: str | None


def _incomplete(path: Path) -> str:
    hint = (" (If it is a torch.distributed.checkpoint directory written without phalanx, `phalanx consolidate` "
            "turns it into one file.)" if (path / ".metadata").is_file() else "")
    return (
        f"{path} is not a complete sharded checkpoint: {MARKER} is missing. phalanx moves a checkpoint directory "
        "into place only after every rank finished writing, so this directory was not produced by a completed "
        f"phalanx save (or was copied incompletely). Use an earlier checkpoint.{hint}"
    )


def find(path: str | Path) -> Found | None:
    """Whether a checkpoint exists at ``path`` and is complete (no process group needed; reads no data)."""
    if snapshot.is_reference(path):
        return Found(Path(path), False, snapshot.problem_with(Path(path)))
    located = storage.locate(Path(path))
    if located is None:
        return None
    found, recovered = located
    return Found(found, recovered, _incomplete(found) if found.is_dir() and not (found / MARKER).is_file() else None)


def locate(path: Path, complete: bool = True) -> Found:
    """The checkpoint to read for ``path`` (saying so when it is the previous one, a save having been
    interrupted while replacing it); raises ``CheckpointError`` if there is none, or, with ``complete``,
    if it is not a complete checkpoint."""
    found = find(path)
    if found is None:
        raise CheckpointError(f"No checkpoint at {path}.")
    if found.recovered:
        diagnostics.notice(
            f"A save of {path} was interrupted while replacing it; loading the previous checkpoint, {found.path}."
        )
    if complete and found.problem:
        raise CheckpointError(found.problem)
    return found


def read_marker(directory: Path, weights_only: bool, mmap: bool = False) -> dict[str, Any]:
    """The marker of a directory checkpoint: ``{META_KEY: meta, "extras": entries the shards do not hold}``
    (which may be large: an optimizer state the shards could not name); ``mmap``: as :func:`format.read_file`."""
    marker = read_file(directory / MARKER, weights_only, what="Checkpoint marker", mmap=mmap)
    meta = marker.get(META_KEY)
    if not isinstance(meta, dict) or "layout" not in meta or not isinstance(marker.get("extras"), dict):
        raise CheckpointError(
            f"{directory / MARKER} is not a marker this phalanx version reads (format "
            f"{meta.get('format_version') if isinstance(meta, dict) else '?'}). Load it with the phalanx version "
            "that wrote it and save it again."
        )
    return marker


# ---------------------------------------------------------------------- one file
def _open_file(path: Path, weights_only: bool, verify: bool, mmap: bool) -> Source:
    ckpt, checked = None, False
    if mmap:
        try:  # memory-mapped: nothing is read until a tensor is used
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        except Exception:
            pass  # torch's pre-zip format, or a damaged file: read_file says which
    if ckpt is None:
        ckpt, checked = read_file(path, weights_only), True  # read_file verifies what it reads
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path} holds a {type(ckpt).__name__}, not a dict of state.")
    if looks_like_raw_state_dict(ckpt):
        return Source(path, STATE_DICT, {}, {"model": ckpt}, {"model": MODULE}, [path],
                      verified=False if verify else None)
    meta = ckpt.get(META_KEY, {})
    record = check_format(meta, path) if META_KEY in ckpt else None  # none: not written by phalanx
    recorded = record is not None and record.get("entries") is not None
    if verify and record is not None and recorded and not checked:
        # Converting a damaged file would hand on wrong values under new, unrecorded checksums: refuse.
        found = checksums.check_state(ckpt, record, path)
        if found:
            raise corrupt(found, path)
    tree = {k: v for k, v in ckpt.items() if k != META_KEY}
    saved = meta.get("entries") if isinstance(meta, dict) else None
    kinds = {k: (saved or {}).get(k) or guess_kind(v) for k, v in tree.items()}
    return Source(path, SINGLE, meta if isinstance(meta, dict) else {}, tree, kinds, [path],
                  verified=recorded if verify else None)


# ---------------------------------------------------------------------- torch.distributed.checkpoint shards
class _DCPReader:
    """Reads the tensors of a DCP directory: one per call, or, once the order they will be asked for is
    known (``expect``), a batch of about ``BATCH_BYTES`` of them that are asked for next."""

    def __init__(self, directory: Path, sizes: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        self.directory, self.sizes = directory, sizes
        self.order: list[str] = []
        self.position: dict[str, int] = {}
        self.cache: dict[str, torch.Tensor] = {}

    def expect(self, keys: list[str]) -> None:
        self.order, self.position = keys, {k: i for i, k in enumerate(keys)}

    def _nbytes(self, key: str) -> int:
        shape, dtype = self.sizes[key]
        return int(torch.Size(shape).numel()) * dtype.itemsize

    def get(self, key: str) -> torch.Tensor:
        if key not in self.cache:
            batch, total = [key], self._nbytes(key)
            for k in self.order[self.position[key] + 1:] if key in self.position else []:
                if total + self._nbytes(k) > BATCH_BYTES:
                    break
                batch.append(k)
                total += self._nbytes(k)
            self.cache.update(self._read({k: torch.empty(self.sizes[k][0], dtype=self.sizes[k][1]) for k in batch}))
        return self.cache.pop(key)

    def _read(self, flat: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import load

        try:
            with warnings.catch_warnings():  # one process without a process group is intended here
                warnings.simplefilter("ignore")
                load(flat, storage_reader=FileSystemReader(str(self.directory)),
                         planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        except BaseException as err:  # DCP wraps failures in a BaseException subclass
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(f"Cannot read the sharded checkpoint {self.directory}: {type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''}") from err
        return flat


def _set_path(tree: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` (DCP's planner_data: str keys, int list positions) into nested dicts/lists."""
    node: Any = tree
    for here, nxt in itertools.pairwise(path):
        empty: Any = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            while len(node) <= here:
                node.append(None)
            node[here] = node[here] if node[here] is not None else empty
            node = node[here]
        else:
            node = node.setdefault(here, empty)
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def _open_dcp(directory: Path, weights_only: bool, marker: dict[str, Any] | None, verify: bool) -> Source:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from phalanx.checkpoint.dcp import METADATA, check_metadata

    if not (directory / METADATA).is_file():
        raise CheckpointError(f"{directory} is not a complete sharded checkpoint: {METADATA} is missing. Use an "
                              "earlier checkpoint.")
    if weights_only:
        check_metadata(directory)  # torch unpickles .metadata; refuse one that could run code first
    checked = _check_shards(directory, marker, verify)
    md = FileSystemReader(str(directory)).read_metadata()
    paths = dict(md.planner_data or {})
    sizes = {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    reader = _DCPReader(directory, sizes)
    tree: dict[str, Any] = {}
    source = Source(directory, SHARDED if marker is not None else PLAIN_DCP, {}, tree, {},
                    sorted(p for p in directory.iterdir() if p.is_file()), verified=checked)
    keys: dict[int, str] = {}
    for key, (shape, dtype) in sizes.items():
        t = placeholder(shape, dtype)
        source.loaders[id(t)] = lambda key=key: reader.get(key)  # type: ignore[misc]
        keys[id(t)] = key
        _set_path(tree, paths.get(key, (key,)), t)
    source.expect = lambda order: reader.expect([keys[id(t)] for t in order if id(t) in keys])
    others = [k for k in md.state_dict_metadata if k not in sizes]
    if others:  # small plain values (hyperparameters, param names): read in one go, safely
        values = _read_bytes(directory, others, weights_only)
        for key in others:
            _set_path(tree, paths.get(key, (key,)), values[key])
    if marker is None:
        source.kinds = {k: guess_kind(v) for k, v in tree.items()}
        return source
    meta, info = marker[META_KEY], marker[META_KEY].get("shards", {})
    source.meta = meta
    source.name_keyed = set(info.get("optimizers", []))
    tree.update(marker["extras"])
    source.kinds = {k: meta.get("entries", {}).get(k) or guess_kind(v) for k, v in tree.items()}
    return source


def _read_bytes(directory: Path, keys: list[str], weights_only: bool) -> dict[str, Any]:
    import io

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    class _Planner(DefaultLoadPlanner):
        # torch opens these values with weights_only=False; with weights_only only plain values pass.
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=weights_only)

    flat: dict[str, Any] = dict.fromkeys(keys)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load(flat, storage_reader=FileSystemReader(str(directory)),
                 planner=_Planner(flatten_state_dict=False, allow_partial_load=True), no_dist=True)
    except BaseException as err:
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"Cannot read the plain values of the sharded checkpoint {directory}: "
                              f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err
    return flat


def _check_shards(directory: Path, marker: dict[str, Any] | None, verify: bool) -> bool | None:
    """Whether the shard files were verified against the checksums the marker recorded: True, False (no
    marker: a plain torch.distributed.checkpoint directory), None (not asked to)."""
    if not verify:
        return None
    if marker is None:
        return False
    check_directory(directory, marker[META_KEY])
    return True


# ---------------------------------------------------------------------- a safetensors export
def _open_safetensors(directory: Path, verify: bool) -> Source:
    """``phalanx ckpt convert --to safetensors``'s directory: the weights (read when asked for) and, beside
    them, the checksums it recorded (verified with ``verify``; a file from elsewhere has none)."""
    import json

    file = directory / SAFETENSORS_FILE
    record = None
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((directory / SAFETENSORS_CHECKSUMS).read_text())
    if verify and isinstance(record, dict):
        found = checksums.check_files(directory, record)
        if found:
            raise corrupt(found, directory)
    try:
        with open(file, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file} is truncated or corrupt and cannot be read: {type(err).__name__}: "
                              f"{err}") from err
    regions = [r for f in (record or {}).get("files", {}).values() for r in f.get("regions", [])]
    entry = next((r[2][0] for r in regions if r[2]), "model")  # the module entry it was exported from
    weights: dict[str, Any] = {}
    source = Source(directory, SAFETENSORS, {"converted_from": "phalanx ckpt convert"} if record else {},
                    {entry: weights}, {entry: MODULE}, sorted(p for p in directory.iterdir() if p.is_file()),
                    verified=isinstance(record, dict) if verify else None)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        t = weights[name] = placeholder(info["shape"], _SAFETENSORS_DTYPES[info["dtype"]])
        start, end = (8 + size + offset for offset in info["data_offsets"])

        def read(t: torch.Tensor = t, start: int = start, end: int = end) -> torch.Tensor:
            with open(file, "rb") as fh:
                fh.seek(start)
                return torch.frombuffer(bytearray(fh.read(end - start)), dtype=t.dtype).reshape(t.shape)

        source.loaders[id(t)] = read
    return source


# ---------------------------------------------------------------------- any of them
def open_source(path: str | Path, weights_only: bool = True, full: bool = False, verify: bool | None = None,
                foreign: bool = True, mmap: bool = True) -> Source:
    """Open the checkpoint at ``path`` (see the module docstring); raises ``CheckpointError`` with the reason.
    ``full``: the caller will read every tensor (a conversion): layouts that can only be read whole (DeepSpeed's
    flat ZeRO partitions) are read now, optimizer state included; without it no tensor data is read beyond what
    verifying takes. ``verify`` (default: ``full``): first check the checksums the checkpoint recorded (a
    mismatch raises :class:`~phalanx.utils.errors.CorruptCheckpointError`, naming the tensor). ``foreign``:
    also open what phalanx did not write as a checkpoint (a plain DCP directory, a safetensors export), which
    ``fabric.load`` refuses. ``mmap``: map a single file rather than read it into memory."""
    path = Path(path)
    verify = full if verify is None else verify
    if foreign and path.is_file() and path.suffix == ".safetensors" and path.name == SAFETENSORS_FILE:
        path = path.parent
    if foreign and (path / SAFETENSORS_FILE).is_file():
        return _open_safetensors(path, verify)
    found = locate(path, complete=not foreign)
    target = found.path
    if target.is_file():
        return _open_file(target, weights_only, verify, mmap)
    if not (target / MARKER).is_file():
        if (target / ".metadata").is_file():
            return _open_dcp(target, weights_only, None, verify)  # written by torch.distributed.checkpoint directly
        raise CheckpointError(found.problem or f"{target} is not a checkpoint.")
    marker = read_marker(target, weights_only, mmap)
    meta = marker[META_KEY]
    if meta["layout"] == DCP_LAYOUT:
        return _open_dcp(target, weights_only, marker, verify)
    if meta["layout"] == DEEPSPEED_LAYOUT:
        return open_deepspeed(target, weights_only, marker, full, _check_shards(target, marker, verify))
    raise CheckpointError(f"{target} holds {meta['layout']!r} shards, which this phalanx version cannot read.")


def read_everything(path: str | Path, weights_only: bool = True, verify: bool = True) -> dict[str, Any]:
    """Every entry of the checkpoint at ``path`` as plain CPU values, in the single-file layout (full tensors,
    optimizer state keyed by index) with phalanx's metadata under ``META_KEY``; a plain state-dict file as it
    is. Only what ``fabric.load`` accepts (no plain DCP directory, no safetensors export), checked against its
    recorded checksums unless ``verify`` is False (the caller checked them already)."""
    source = open_source(path, weights_only, full=True, verify=verify, foreign=False, mmap=False)
    if source.kind == STATE_DICT:
        return dict(source.tree["model"])
    if source.expect is not None:
        source.expect([t for _, t in tensors(source.tree) if id(t) in source.loaders])
    done: dict[int, torch.Tensor] = {}

    def read(node: Any) -> Any:
        # Placeholders sit in the dicts and lists a layout's reader built; every other value is returned as is.
        if isinstance(node, torch.Tensor) and id(node) in source.loaders:
            if id(node) not in done:
                done[id(node)] = source.load(node)
            return done[id(node)]
        if isinstance(node, dict):
            return {k: read(v) for k, v in node.items()}
        if isinstance(node, list):
            return [read(v) for v in node]
        return node

    out = {k: read(v) for k, v in source.tree.items()}
    if source.name_keyed:
        from phalanx.checkpoint.dcp import to_index_keyed

        out.update({k: to_index_keyed(out[k]) for k in source.name_keyed})
    if source.meta:
        out[META_KEY] = source.meta
    return out
