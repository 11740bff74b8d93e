"""Converting a checkpoint between layouts in one plain process: ``phalanx ckpt convert``.

Targets: ``single`` (one ``torch.save`` file, weights_only-safe: what ``torch.load`` and every strategy's
``fabric.load`` read), ``sharded`` (a ``torch.distributed.checkpoint`` directory plus phalanx's marker,
which ``fabric.load`` reads at any world size) and ``safetensors`` (one module's weights as
``model.safetensors`` in a directory, for Hugging Face ``from_pretrained``).

Every writer pulls tensors from the source one at a time (:mod:`phalanx.checkpoint.sources`), so memory
stays near the largest tensor (or one batch of DCP shards) instead of the whole checkpoint: the
single-file writer emits torch's zip format record by record, the DCP writer hands DCP each tensor
only when it writes it, and the safetensors writer streams the format's header and bytes. Outputs
appear atomically (a hidden temporary, renamed into place), and carry checksums in the form a phalanx save
records them (:mod:`phalanx.checkpoint.checksums`), which every load verifies: in the metadata of a single
file and of a sharded directory's marker, and for safetensors beside the weights (``phalanx_checksums.json``).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import sys
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import phalanx.checkpoint.checksums as checksums
import phalanx.checkpoint.storage as storage
from phalanx.checkpoint.dcp import to_index_keyed
from phalanx.checkpoint.format import DCP_LAYOUT, FILE_LAYOUT, FORMAT_VERSION, MARKER, META_KEY, check_plain
from phalanx.checkpoint.protocol import MODULE, OPTIMIZER, SAFETENSORS, Source, tensors
from phalanx.checkpoint.sources import SAFETENSORS_CHECKSUMS, SAFETENSORS_FILE, open_source
from phalanx.utils.errors import CheckpointError

TARGETS = ("single", "sharded", "safetensors")
#: Prefixes wrappers add to state-dict keys: torch.compile's, Fabric's/DDP's forward wrappers.
WRAPPER_PREFIXES = ("_orig_mod.", "_forward_module.", "module.")
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def _temporary(dst: Path, mark: str) -> Path:
    # The storage layer's naming, so a later save of ``dst`` clears what a killed conversion left.
    return dst.with_name(f".{dst.name}{mark}{uuid.uuid4().hex[:10]}")


def _publish(tmp: Path, dst: Path) -> None:
    if dst.exists():
        raise CheckpointError(f"{dst} appeared while converting; not replacing it.")
    os.replace(tmp, dst)
    storage.fsync_dir(dst.parent)


def _failed(err: BaseException, tmp: Path, dst: Path, action: str) -> BaseException:
    """Clean up after a failed write; the error to raise (the OS's cause named, as the storage layer does)."""
    storage.delete_now(tmp)
    if isinstance(err, (CheckpointError, KeyboardInterrupt, SystemExit)):
        return err
    return storage.write_error(err, dst, action)


# ---------------------------------------------------------------------- torch.save, one record at a time
class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


def _storage_type(dtype: torch.dtype) -> Any:
    name = torch.storage._dtype_to_storage_type_map().get(dtype)
    if name is None:
        raise CheckpointError(f"Tensors of dtype {dtype} cannot be written to a single file by phalanx ckpt.")
    return getattr(torch, name)


class _Pickler(pickle.Pickler):
    """Pickles like ``torch.save`` (``_rebuild_tensor_v2`` over numbered storages) without touching tensor
    data: each tensor gets a storage key; its bytes are written afterwards, one record at a time."""

    def __init__(self, fh: io.BytesIO) -> None:
        super().__init__(fh, protocol=2)
        self.order: list[torch.Tensor] = []
        self.keys: dict[int, str] = {}

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        key = self.keys.get(id(obj))
        if key is None:  # the same tensor twice (tied weights) shares one storage, as torch.save does
            key = self.keys[id(obj)] = str(len(self.order))
            self.order.append(obj)
        stride = tuple(torch.empty(tuple(obj.shape), device="meta").stride())
        ref = _StorageRef(key, obj.dtype, obj.numel())
        return torch._utils._rebuild_tensor_v2, (ref, 0, torch.Size(obj.shape), stride, False, OrderedDict())

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        return None


def stream_save(obj: Any, path: Path, load: Callable[[torch.Tensor], torch.Tensor],
                expect: Callable[[list[torch.Tensor]], None] | None = None,
                seal: Callable[[Callable[[torch.Tensor], int | None]], None] | None = None) -> None:
    """``torch.save(obj, path)`` where each tensor's data is ``load(tensor)``, called once per tensor just
    before its bytes are written (placeholders need no memory until then); ``expect`` is told that order
    first. ``seal(crc_of)`` is called once every tensor is written, with each tensor's CRC-32, and may add
    plain values to ``obj`` (its checksum record): the object itself is pickled last. Atomic; the file's
    records are named after ``path``, as ``torch.save(obj, path)`` names them."""
    check_plain(obj, "checkpoint")
    pickler = _Pickler(io.BytesIO())
    pickler.dump(obj)  # the tensors' order only: the object is pickled again at the end
    order = pickler.order
    if expect is not None:
        expect(order)
    tmp = _temporary(path, ".tmp-")
    try:
        tmp.mkdir()
        file = tmp / path.name  # torch names the records after the file it writes
        crcs: dict[int, int | None] = {}
        with torch.serialization._open_zipfile_writer(str(file)) as zf:
            zf.write_record(".format_version", "1", 1)
            alignment = str(torch.serialization._get_storage_alignment())
            zf.write_record(".storage_alignment", alignment, len(alignment))
            zf.write_record("byteorder", sys.byteorder, len(sys.byteorder))
            for key, tensor in enumerate(order):
                data = load(tensor)
                if data.storage_offset() or data.untyped_storage().nbytes() != data.nbytes:
                    data = data.clone()  # a view into a larger storage: write only its own bytes
                crcs[id(tensor)] = checksums.tensor_crc(data)
                zf.write_record(f"data/{key}", data.untyped_storage(), data.nbytes)
                del data
            if seal is not None:
                seal(lambda t: crcs.get(id(t)))
            check_plain(obj, "checkpoint")
            buf = io.BytesIO()
            final = _Pickler(buf)
            final.dump(obj)
            if [id(t) for t in final.order] != [id(t) for t in order]:
                raise CheckpointError("The checkpoint's tensors changed while it was converted.")
            zf.write_record("data.pkl", buf.getvalue(), len(buf.getvalue()))
        with open(file, "rb+") as fh:
            os.fsync(fh.fileno())
        _publish(file, path)
        storage.delete_now(tmp)
    except BaseException as err:
        raise _failed(err, tmp, path, "write checkpoint") from err


# ---------------------------------------------------------------------- the three targets
def _single_tree(source: Source) -> dict[str, Any]:
    """The entries in the single-file layout (optimizer state keyed by index, as torch's own)."""
    return {k: (to_index_keyed(v) if k in source.name_keyed else v) for k, v in source.tree.items()}


def _meta(source: Source, layout: str, **extra: Any) -> dict[str, Any]:
    # The source's checksums describe its own files, not these: the writer records the output's own.
    base = {k: v for k, v in source.meta.items() if k not in ("shards", "checksums")}
    base["format_version"] = FORMAT_VERSION
    base["entries"] = {k: source.kinds[k] for k in source.tree}
    return {**base, "layout": layout, "converted_from": source.kind, **extra}


def write_single(source: Source, dst: Path) -> None:
    payload = _single_tree(source)
    entries = dict(payload)
    meta = payload[META_KEY] = _meta(source, FILE_LAYOUT)

    def seal(crc_of: Callable[[torch.Tensor], int | None]) -> None:  # the record a phalanx save writes
        meta["checksums"] = checksums.of_state(entries, FILE_LAYOUT, crc_of=crc_of)

    stream_save(payload, dst, source.load, source.expect, seal)


def write_sharded(source: Source, dst: Path) -> None:
    """Modules (and optimizers whose parameter names are known) into DCP shards; everything else into the
    marker, as phalanx's own sharded save does with what it does not shard."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    # An index-keyed optimizer state (a single file's) cannot be named after parameters without the live
    # model, so it stays whole in the marker, which every strategy loads from.
    sharded = [k for k, kind in source.kinds.items()
               if (kind == MODULE and source.tree[k]) or (kind == OPTIMIZER and k in source.name_keyed)]

    class _Planner(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            obj = self.lookup_object(write_item.index)
            if isinstance(obj, torch.Tensor):  # read now, as DCP writes it: one tensor in memory at a time
                return source.load(obj)
            return super().resolve_data(write_item)

    tmp = _temporary(dst, ".partial-")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # one process without a process group is intended here
            save({k: source.tree[k] for k in sharded}, storage_writer=FileSystemWriter(str(tmp)),
                 planner=_Planner(), no_dist=True)
        info = {"sharded": sharded, "optimizers": [k for k in sharded if source.kinds[k] == OPTIMIZER]}
        extras = {k: v for k, v in _single_tree(source).items() if k not in sharded}
        meta = _meta(source, DCP_LAYOUT, shards=info)
        files = checksums.of_files(tmp, skip=[MARKER])  # the shards, complete now

        def seal(crc_of: Callable[[torch.Tensor], int | None]) -> None:  # the record a phalanx sharded save writes
            meta["checksums"] = {**checksums.of_state(extras, DCP_LAYOUT, within="extras", crc_of=crc_of), **files}

        stream_save({META_KEY: meta, "extras": extras}, tmp / MARKER, source.load, source.expect, seal)
        _publish(tmp, dst)
    except BaseException as err:
        raise _failed(err, tmp, dst, "write sharded checkpoint") from err


def module_entry(source: Source, entry: str | None) -> str:
    """The entry whose weights ``--to safetensors`` exports."""
    if entry is not None:
        if entry not in source.tree:
            raise CheckpointError(f"{source.path} has no entry {entry!r}; it has {sorted(source.tree)}.")
        return entry
    modules = [k for k, kind in source.kinds.items() if kind == MODULE]
    if len(modules) != 1:
        raise CheckpointError(f"{source.path} holds {len(modules)} modules ({', '.join(modules) or 'none'}): "
                              "choose one with --entry.")
    return modules[0]


def strip_prefixes(keys: list[str], prefix: str | None) -> tuple[dict[str, str], list[str]]:
    """New name for each key, and the prefixes removed. ``prefix=None`` (auto): the wrappers' prefixes
    (``_orig_mod.``, ``_forward_module.``, ``module.``) wherever a key starts with them, then ``model.``
    once if every key starts with it (a training module holding the Hugging Face model as ``self.model``).
    Otherwise exactly ``prefix``, from every key that starts with it (``""``: keep the keys)."""
    if prefix is not None:
        return {k: k[len(prefix):] if prefix and k.startswith(prefix) else k for k in keys}, [prefix] if prefix else []
    removed: list[str] = []
    names = {k: k for k in keys}
    changed = True
    while changed:
        changed = False
        for wrapper in WRAPPER_PREFIXES:
            hit = [k for k, v in names.items() if v.startswith(wrapper)]
            if hit:
                names.update({k: names[k][len(wrapper):] for k in hit})
                removed.append(wrapper)
                changed = True
    if names and all(v.startswith("model.") for v in names.values()):
        names = {k: v[len("model."):] for k, v in names.items()}
        removed.append("model.")
    return names, removed


def write_safetensors(source: Source, dst: Path, entry: str | None, prefix: str | None,
                      config: Path | None) -> dict[str, Any]:
    """``dst/model.safetensors`` with one module's weights (and ``dst/config.json`` from ``config``)."""
    key = module_entry(source, entry)
    weights = source.tree[key]
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError(f"Entry {key!r} of {source.path} is not a module's state dict (tensors by name).")
    names, removed = strip_prefixes(list(weights), prefix)
    if len(set(names.values())) != len(names):
        raise CheckpointError(f"Stripping {removed} makes two keys of {key!r} equal; pass --prefix explicitly.")
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers refuses files without it
    offset = 0
    order = sorted(weights, key=lambda k: names[k])
    for k in order:
        t = weights[k]
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{k} has dtype {t.dtype}, which safetensors cannot hold.")
        size = t.numel() * t.dtype.itemsize
        header[names[k]] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
    source.expect([weights[k] for k in order])
    start = 8 + len(raw)
    regions = [(start + header[names[k]]["data_offsets"][0], t.numel() * t.dtype.itemsize, [key, names[k]])
               for k, t in ((k, weights[k]) for k in order)]
    tmp = _temporary(dst, ".partial-")
    try:
        tmp.mkdir(parents=True)
        with open(tmp / SAFETENSORS_FILE, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little"))
            fh.write(raw)
            for k in order:
                data = source.load(weights[k])
                fh.write(data.reshape(-1).view(torch.uint8).numpy().data)
                del data
            fh.flush()
            os.fsync(fh.fileno())
        if config is not None:
            shutil.copyfile(config, tmp / "config.json")
        # The format has no room for them, so the checksums go beside it: a directory checkpoint's record, one
        # region per tensor (a mismatch names it), read back from what was written.
        record = {**checksums.of_files(tmp, named={SAFETENSORS_FILE: regions}), "layout": SAFETENSORS}
        with open(tmp / SAFETENSORS_CHECKSUMS, "w") as fh:
            json.dump(record, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _publish(tmp, dst)
    except BaseException as err:
        raise _failed(err, tmp, dst, "write safetensors") from err
    return {"entry": key, "stripped": removed, "tensors": len(order)}


def convert(src: str | Path, dst: str | Path, to: str, *, weights_only: bool = True, entry: str | None = None,
            prefix: str | None = None, config: str | Path | None = None) -> dict[str, Any]:
    """Convert the checkpoint at ``src`` to ``to`` (one of :data:`TARGETS`) at ``dst``, which must not exist.
    Returns what was done (plain values; printed by ``phalanx ckpt convert``)."""
    src, dst = Path(src), Path(dst)
    if to not in TARGETS:
        raise ValueError(f"to must be one of {', '.join(TARGETS)}, got {to!r}")
    if config is not None and not Path(config).is_file():
        raise CheckpointError(f"--config {config}: no such file.")
    if dst.exists() or dst.is_symlink():
        raise CheckpointError(f"{dst} exists; phalanx ckpt convert does not overwrite. Remove it or choose another.")
    source = open_source(src, weights_only, full=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"source": str(source.path), "source_kind": source.kind, "destination": str(dst), "to": to}
    if to == "single":
        write_single(source, dst)
    elif to == "sharded":
        write_sharded(source, dst)
    else:
        out.update(write_safetensors(source, dst, entry, prefix, Path(config) if config else None))
    if to != "safetensors":
        out["entries"] = sorted(source.tree)
        out["tensors"] = sum(1 for _ in tensors(source.tree))
    out["notes"] = list(source.notes)
    out["bytes"] = sum(f.stat().st_size for f in ([dst] if dst.is_file() else dst.rglob("*")) if f.is_file())
    return out
