"""Any phalanx checkpoint, opened for reading tensor by tensor in one plain process (no process group).

``open_source(path)`` recognises the three layouts phalanx writes (one file; a directory of
``torch.distributed.checkpoint`` shards plus the marker file; a directory holding DeepSpeed's engine
checkpoint plus the marker), a plain DCP directory written without phalanx, and a file from
``torch.save(model.state_dict())``. It reads only metadata: the result's ``tree`` holds the entries with
every tensor either real (a memory-mapped file's) or a ``meta`` placeholder of the right shape and dtype
whose data ``Source.load`` reads when asked. Converting a checkpoint therefore holds about one tensor
(or one batch of shards) in memory at a time, not the whole checkpoint (``phalanx ckpt``).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import phalanx.checkpoint.checksums as checksums
from phalanx.checkpoint import find
from phalanx.checkpoint.deepspeed_shards import DeepSpeedShards
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
from phalanx.checkpoint.protocol import MODULE, OPTIMIZER, PLAIN
from phalanx.utils.errors import CheckpointError

SINGLE, SHARDED, DEEPSPEED, PLAIN_DCP, STATE_DICT = "single", "sharded", "deepspeed", "dcp", "state_dict"
SAFETENSORS = "safetensors"
#: ``phalanx ckpt convert --to safetensors`` writes a directory with these (and config.json if given).
SAFETENSORS_FILE, SAFETENSORS_CHECKSUMS = "model.safetensors", "phalanx_checksums.json"
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}
#: dcp.load calls read shards in batches of about this many bytes (fewer calls; bounded memory).
BATCH_BYTES = 16 * 2**20


def placeholder(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    """A tensor that records shape and dtype and holds no data (its bytes are read on ``Source.load``)."""
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


@dataclass
class Source:
    """An opened checkpoint (see the module docstring). ``kinds``: entry -> module/optimizer/...;
    ``name_keyed``: optimizer entries whose state is keyed by parameter name (DCP's form) rather than
    torch's index; ``notes``: what a conversion leaves out, said to the user."""

    path: Path
    kind: str
    meta: dict[str, Any]
    tree: dict[str, Any]
    kinds: dict[str, str]
    files: list[Path]
    name_keyed: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    loaders: dict[int, Callable[[], torch.Tensor]] = field(default_factory=dict)
    #: Told the order ``load`` will be called in (before the first call), a layout may read ahead in batches.
    expect: Callable[[list[torch.Tensor]], None] = lambda order: None
    #: Whether the recorded checksums were verified: True, False (none recorded), None (not asked to).
    verified: bool | None = None

    def load(self, tensor: torch.Tensor) -> torch.Tensor:
        """The data of a tensor of ``tree``, on the CPU and contiguous (read from disk if a placeholder)."""
        loader = self.loaders.get(id(tensor))
        out = loader() if loader is not None else tensor
        if out.is_meta:
            raise CheckpointError(f"{self.path}: a tensor of shape {tuple(out.shape)} has no data to read.")
        out = out.detach().cpu().contiguous()
        if tuple(out.shape) != tuple(tensor.shape) or out.dtype != tensor.dtype:
            raise CheckpointError(f"{self.path}: a tensor read as {tuple(out.shape)} {out.dtype}, but its metadata "
                                  f"says {tuple(tensor.shape)} {tensor.dtype}; the checkpoint is inconsistent.")
        return out

    @property
    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``tree`` with its path (``entry/key/...``)."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from tensors(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from tensors(value, f"{prefix}/{i}" if prefix else str(i))


def guess_kind(value: Any) -> str:
    """The kind of an entry in a file without phalanx's entry record."""
    if isinstance(value, dict) and {"state", "param_groups"} <= set(value):
        return OPTIMIZER
    if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        return MODULE
    return PLAIN


# ---------------------------------------------------------------------- one file
def _open_file(path: Path, weights_only: bool, verify: bool) -> Source:
    try:  # memory-mapped: nothing is read until a tensor is used
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except Exception:
        ckpt = read_file(path, weights_only)  # torch's pre-zip format, or the clear error for a damaged file
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path} holds a {type(ckpt).__name__}, not a dict of state.")
    if looks_like_raw_state_dict(ckpt):
        return Source(path, STATE_DICT, {}, {"model": ckpt}, {"model": MODULE}, [path],
                      verified=False if verify else None)
    meta = ckpt.get(META_KEY, {})
    record = check_format(meta, path) if META_KEY in ckpt else None  # none: not written by phalanx
    checked = record is not None and record.get("entries") is not None
    if verify and record is not None and checked:
        # Converting a damaged file would hand on wrong values under new, unrecorded checksums: refuse.
        found = checksums.check_state(ckpt, record, path)
        if found:
            raise corrupt(found, path)
    tree = {k: v for k, v in ckpt.items() if k != META_KEY}
    saved = meta.get("entries") if isinstance(meta, dict) else None
    kinds = {k: (saved or {}).get(k) or guess_kind(v) for k, v in tree.items()}
    return Source(path, SINGLE, meta if isinstance(meta, dict) else {}, tree, kinds, [path],
                  verified=checked if verify else None)


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
        raise CheckpointError(f"{directory} is not a complete sharded checkpoint: {METADATA} is missing.")
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


# ---------------------------------------------------------------------- DeepSpeed's engine checkpoint
def _model_states(directory: Path) -> Path:
    """DeepSpeed's model-states file (ZeRO 1/2: one for all ranks; ZeRO-3: rank 0's holds the same shapes)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        found = sorted(directory.glob(f"*/{name}"))
        if len(found) == 1:
            return found[0]
    raise CheckpointError(f"{directory} does not hold one DeepSpeed engine checkpoint (a folder with "
                          "mp_rank_00_model_states.pt).")


def _open_deepspeed(directory: Path, weights_only: bool, marker: dict[str, Any], full: bool, verify: bool) -> Source:
    meta = marker[META_KEY]
    info = meta.get("shards", {})
    entries = meta.get("entries", {})
    sharded = list(info.get("sharded", []))
    model_key = next((k for k in sharded if entries.get(k) == MODULE), "model")
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    rest = {k: entries.get(k) or guess_kind(v) for k, v in marker["extras"].items()}
    checked = _check_shards(directory, marker, verify)
    if full:
        # ZeRO keeps each parameter group as one flat partition per rank: the state is rebuilt whole.
        merged = _read_deepspeed(directory, info, weights_only)
        if merged is not None:
            return Source(directory, DEEPSPEED, meta, {**merged, **marker["extras"]},
                          {**{k: entries.get(k, MODULE) for k in merged}, **rest}, files, verified=checked)
    # Shapes without reading the partitions: DeepSpeed's model-states file holds them (and the buffers).
    states = read_file(_model_states(directory), True, what="DeepSpeed model states")
    buffers = set(states.get("buffer_names", []))
    shapes: dict[str, Any] = {}
    for group in states.get("param_shapes", []):
        shapes.update(group)
    shapes.update(states.get("frozen_param_shapes") or {})
    module: dict[str, Any] = {}
    for name, value in states.get("module", {}).items():
        if name in buffers:
            module[name] = value.float() if value.is_floating_point() else value  # zero_to_fp32's choice
    for name, shape in shapes.items():
        module[name] = placeholder(shape, torch.float32)  # the float32 master weights
    for alias, target in (states.get("shared_params") or {}).items():
        if target in module:
            module[alias] = module[target]
    source = Source(directory, DEEPSPEED, meta, {model_key: module, **marker["extras"]}, {model_key: MODULE, **rest},
                    files, verified=checked)
    merged_weights: dict[str, Any] = {}

    def weight(name: str) -> torch.Tensor:
        if not merged_weights:
            merged_weights.update(_zero_to_fp32(directory, weights_only))
        value = merged_weights[name]
        return value if isinstance(value, torch.Tensor) else value.contiguous()  # ZeRO-3's lazy gathered tensor

    for name, value in module.items():
        if value.is_meta:
            source.loaders[id(value)] = lambda name=name: weight(name)  # type: ignore[misc]
    skipped = [k for k in sharded if k != model_key]
    if skipped:
        how = "is read when converting" if full is False else "is not read here"
        source.notes.append(f"{', '.join(skipped)}: DeepSpeed's partitioned optimizer state (laid out for "
                            f"{info.get('world_size')} ranks at ZeRO stage {info.get('stage')}) {how}.")
    return source


def _read_deepspeed(directory: Path, info: dict[str, Any], weights_only: bool) -> dict[str, Any] | None:
    """Weights and optimizer state merged from ZeRO's partitions (the checkpoint layer's reader)."""
    out: dict[str, Any] = DeepSpeedShards().read_all(directory, info, weights_only)
    return out


def _zero_to_fp32(directory: Path, weights_only: bool) -> dict[str, Any]:
    """The model's float32 weights through DeepSpeed's own zero_to_fp32 (its files unpickled in full)."""
    if weights_only:
        raise CheckpointError(
            f"{directory} is a DeepSpeed engine checkpoint: its optimizer files hold DeepSpeed objects that only "
            "unpickling (which can run code) rebuilds. If you trust where it comes from, pass --trust."
        )
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as err:
        raise CheckpointError(f"Reading the DeepSpeed checkpoint {directory} needs deepspeed "
                              "(pip install phalanx[deepspeed]).") from err
    # DeepSpeed prints its progress: keep stdout for phalanx's own output (--json).
    with contextlib.redirect_stdout(sys.stderr):
        out: dict[str, Any] = get_fp32_state_dict_from_zero_checkpoint(
            str(directory), tag=_model_states(directory).parent.name, lazy_mode=True)
    return out


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
def open_source(path: str | Path, weights_only: bool = True, full: bool = False, verify: bool | None = None) -> Source:
    """Open the checkpoint at ``path`` (see the module docstring); raises ``CheckpointError`` with the reason.
    ``full``: the caller will read every tensor (a conversion): layouts that can only be read whole (DeepSpeed's
    flat ZeRO partitions) are read now, optimizer state included; without it no tensor data is read beyond what
    verifying takes. ``verify`` (default: ``full``): first check the checksums the checkpoint recorded (a
    mismatch raises :class:`~phalanx.utils.errors.CorruptCheckpointError`, naming the tensor)."""
    path = Path(path)
    verify = full if verify is None else verify
    if path.is_file() and path.suffix == ".safetensors" and path.name == SAFETENSORS_FILE:
        path = path.parent
    if (path / SAFETENSORS_FILE).is_file():
        return _open_safetensors(path, verify)
    found = find(path)
    if found is None:
        raise CheckpointError(f"No checkpoint at {path}.")
    target = found.path
    if target.is_file():
        return _open_file(target, weights_only, verify)
    if not (target / MARKER).is_file():
        if (target / ".metadata").is_file():
            return _open_dcp(target, weights_only, None, verify)  # written by torch.distributed.checkpoint directly
        raise CheckpointError(found.problem or f"{target} is not a checkpoint.")
    marker = read_file(target / MARKER, weights_only, what="Checkpoint marker")
    meta = marker.get(META_KEY)
    if not isinstance(meta, dict) or not isinstance(marker.get("extras"), dict):
        raise CheckpointError(f"{target / MARKER} is not a marker this phalanx version reads.")
    if meta.get("layout") == DCP_LAYOUT:
        return _open_dcp(target, weights_only, marker, verify)
    if meta.get("layout") == DEEPSPEED_LAYOUT:
        return _open_deepspeed(target, weights_only, marker, full, verify)
    raise CheckpointError(f"{target} holds {meta.get('layout')!r} shards, which phalanx ckpt cannot read.")
