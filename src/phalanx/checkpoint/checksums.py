"""Checksums a checkpoint carries so that a load notices bytes changed on disk.

torch.load does not check the CRCs in torch.save's zip records: a file with flipped bytes in a
tensor's data loads without a word and training resumes from wrong weights. phalanx therefore records,
while saving, a CRC-32 of every tensor's bytes (and one of the entry's other values and structure) in
its metadata, and for a directory checkpoint a CRC-32 of every byte range of every shard file (in a
``torch.distributed.checkpoint`` file, one range per tensor, so a mismatch names the tensor). Loads
recompute and compare them (:mod:`phalanx.checkpoint.format` turns a mismatch into the error).

zlib's CRC-32 releases the GIL, so tensors are hashed on a few threads; it catches every burst of
flipped bits up to 32 bits long and any other change with probability 1 - 2**-32. This is about
corruption, not tampering: whoever can rewrite the file can rewrite the CRCs.

This module knows nothing of the checkpoint's layout (no phalanx imports besides torch), so
:mod:`phalanx.checkpoint.format` and the shard writers can both use it.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ALGORITHM = "crc32"
#: Bytes read per call when checksumming a file region (bounded memory for shards of any size).
_CHUNK = 16 * 2**20
#: Below this many tensor bytes a thread pool costs more than it saves.
_PARALLEL_BYTES = 32 * 2**20
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device)


@dataclass(frozen=True)
class Mismatch:
    """One recorded checksum that what was read no longer matches. ``entry``/``key``: the state entry
    and the key inside it (``key`` None: the entry as a whole; both None: the file, or bytes of it no
    tensor owns); ``saved``/``found``: the CRCs (None where there is nothing to compare); ``detail``:
    what differs, in words (for unnamed file bytes: their range)."""

    file: Path
    entry: str | None
    key: str | None
    saved: int | None
    found: int | None
    detail: str = ""


# ---------------------------------------------------------------------- tensors in memory
def tensor_crc(tensor: torch.Tensor) -> int | None:
    """CRC-32 of the tensor's bytes in memory order (None where there are no plain bytes to hash:
    sparse, quantized, meta or subclass tensors, which are then not checked)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
        return None
    if tensor.is_quantized or tensor.device.type == "meta":
        return None
    t = tensor.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()  # one tensor at a time: at most one extra copy in host memory
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return 0
    return zlib.crc32(t.view(torch.uint8).numpy().data)


def _walk(value: Any, path: str, tensors: list[tuple[str, torch.Tensor]], parts: list[str]) -> None:
    """Collect the tensors under ``value`` in a fixed order (dicts keep their order through pickling) and
    describe everything else: key paths, container sizes, plain values, tensor dtypes and shapes."""
    kind = type(value)
    if isinstance(value, torch.Tensor):
        tensors.append((path, value))
        parts.append(f"{path}:tensor:{value.dtype}:{tuple(value.shape)}")
    elif kind in _PLAIN:
        parts.append(f"{path}:{kind.__name__}:{value!r}")
    elif isinstance(value, dict):
        parts.append(f"{path}:dict:{len(value)}")
        for k, v in value.items():
            _walk(v, f"{path}.{k}" if path else str(k), tensors, parts)
    elif isinstance(value, (list, tuple)):
        if all(type(v) in _PLAIN for v in value):  # e.g. an RNG state's 625 ints: one part, not 625 calls
            parts.append(f"{path}:{kind.__name__}:{value!r}")
            return
        parts.append(f"{path}:{kind.__name__}:{len(value)}")
        for i, v in enumerate(value):
            _walk(v, f"{path}[{i}]", tensors, parts)
    elif isinstance(value, (set, frozenset)):
        # A set's order depends on the process's hash seed; its sorted reprs do not.
        parts.append(f"{path}:{kind.__name__}:{sorted(repr(v) for v in value)}")
    else:  # never in a file phalanx wrote (check_plain); no repr, which may hold an address
        parts.append(f"{path}:{kind.__module__}.{kind.__qualname__}")


def _crcs(tensors: list[torch.Tensor]) -> list[int | None]:
    total = sum(t.numel() * t.element_size() for t in tensors)
    workers = min(4, os.cpu_count() or 1, len(tensors))
    if workers < 2 or total < _PARALLEL_BYTES:
        return [tensor_crc(t) for t in tensors]
    with ThreadPoolExecutor(workers, thread_name_prefix="phalanx-crc") as pool:
        return list(pool.map(tensor_crc, tensors))


def of_entry(value: Any, crc_of: Callable[[torch.Tensor], int | None] | None = None) -> dict[str, Any]:
    """The record of one state entry: ``tensors``, [key, crc] in traversal order, and ``plain``, a CRC of
    everything else (structure, plain values, tensor dtypes and shapes). ``crc_of``: each tensor's CRC where
    the caller computed it already (a writer that streams the data: the tensors themselves hold none)."""
    tensors: list[tuple[str, torch.Tensor]] = []
    parts: list[str] = []
    _walk(value, "", tensors, parts)
    crcs = [crc_of(t) for _, t in tensors] if crc_of is not None else _crcs([t for _, t in tensors])
    return {
        "tensors": [[key, crc] for (key, _), crc in zip(tensors, crcs)],
        "plain": zlib.crc32("\n".join(parts).encode("utf-8", "backslashreplace")),
    }


def of_state(entries: dict[str, Any], layout: str, within: str | None = None,
             crc_of: Callable[[torch.Tensor], int | None] | None = None) -> dict[str, Any]:
    """The checksum record of a checkpoint file's entries (``within``: the key they sit under in the
    file, e.g. a marker's ``"extras"``; None: the top level). ``layout``, the checkpoint's, ties the
    record to it: metadata copied into a checkpoint of another layout does not carry a stale record
    into it (see :func:`applies`)."""
    return {"algorithm": ALGORITHM, "layout": layout, "within": within,
            "entries": {str(k): of_entry(v, crc_of) for k, v in entries.items()}}


def applies(meta: Any) -> dict[str, Any] | None:
    """The checksum record in phalanx metadata ``meta`` if it describes this checkpoint, else None (no
    record: written before format 3; another layout's record: metadata copied by a converter)."""
    record = meta.get("checksums") if isinstance(meta, dict) else None
    if not isinstance(record, dict) or record.get("algorithm") != ALGORITHM:
        return None
    return record if record.get("layout") == meta.get("layout") else None


def plain_of(value: Any) -> int:
    """The ``plain`` part of :func:`of_entry` alone (reads no tensor data)."""
    parts: list[str] = []
    _walk(value, "", [], parts)
    return zlib.crc32("\n".join(parts).encode("utf-8", "backslashreplace"))


def expected_tensors(value: Any, record: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor, int | None]]:
    """(key, tensor, recorded crc) for each tensor of an entry, in the recorded order; raises ValueError
    when the tensors are not the ones recorded (the structure changed)."""
    tensors: list[tuple[str, torch.Tensor]] = []
    _walk(value, "", tensors, [])
    recorded = record.get("tensors", [])
    if len(recorded) != len(tensors):
        raise ValueError(f"it holds {len(tensors)} tensors, {len(recorded)} were saved")
    for (key, tensor), (saved_key, crc) in zip(tensors, recorded):
        if key != saved_key:
            raise ValueError(f"tensor {key!r} was saved as {saved_key!r}")
        yield key, tensor, crc


def check_state(ckpt: dict[str, Any], record: dict[str, Any], file: Path) -> list[Mismatch]:
    """Every recorded checksum of a loaded file's entries that its content no longer matches."""
    within = record.get("within")
    entries = ckpt.get(within, {}) if within else ckpt
    out: list[Mismatch] = []
    work: list[tuple[str, str, torch.Tensor, int]] = []
    for entry, rec in record.get("entries", {}).items():
        if entry not in entries:
            out.append(Mismatch(file, entry, None, None, None, "the entry is missing"))
            continue
        value = entries[entry]
        if plain_of(value) != rec.get("plain"):
            out.append(Mismatch(file, entry, None, rec.get("plain"), plain_of(value),
                                "its non-tensor values or its structure changed"))
        try:
            work += [(entry, key, t, crc) for key, t, crc in expected_tensors(value, rec) if crc is not None]
        except ValueError as err:
            out.append(Mismatch(file, entry, None, None, None, str(err)))
    crcs = _crcs([t for _, _, t, _ in work])
    out += [Mismatch(file, entry, key, saved, now) for (entry, key, _, saved), now in zip(work, crcs) if now != saved]
    return out


# ---------------------------------------------------------------------- files of a directory checkpoint
def _dcp_regions(directory: Path) -> dict[str, list[tuple[int, int, list[str]]]]:
    """Byte ranges of each tensor (and pickled value) in a ``torch.distributed.checkpoint`` directory's
    shard files: file -> [(offset, length, [entry, key...])]. Empty where the directory has none."""
    if not (directory / ".metadata").is_file():
        return {}
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    md = FileSystemReader(str(directory)).read_metadata()
    planner = md.planner_data if isinstance(md.planner_data, dict) else {}
    out: dict[str, list[tuple[int, int, list[str]]]] = {}
    for index, info in (md.storage_data or {}).items():
        where = planner.get(index.fqn)
        name = [str(p) for p in where] if isinstance(where, (list, tuple)) and where else [index.fqn]
        out.setdefault(str(info.relative_path), []).append((int(info.offset), int(info.length), name))
    return out


def _file_crcs(file: Path, regions: Iterable[tuple[int, int]]) -> list[int]:
    out = []
    with open(file, "rb") as fh:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        for offset, length in regions:
            fh.seek(offset)
            crc, left = 0, length
            while left:
                n = fh.readinto(view[: min(left, _CHUNK)])
                if not n:
                    break  # the file is shorter than recorded: the size check reports it
                crc = zlib.crc32(view[:n], crc)
                left -= n
            out.append(crc)
    return out


def of_files(directory: Path, skip: Iterable[str] = (),
             named: dict[str, list[tuple[int, int, list[str]]]] | None = None) -> dict[str, Any]:
    """The record of every file under ``directory`` (relative path -> size and [offset, length, name,
    crc] regions covering every byte). Tensors' byte ranges are regions of their own, so a mismatch names
    the tensor: in DCP shard files found from DCP's metadata, elsewhere given as ``named`` (file -> [(offset,
    length, [entry, key])]); other bytes (headers, a backend's own files) are unnamed regions."""
    skipped = set(skip)
    if named is None:
        try:
            named = _dcp_regions(directory)
        except Exception:  # unreadable metadata: fall back to ranges without names (still every byte)
            named = {}
    files: dict[str, Any] = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = file.relative_to(directory).as_posix()
        if rel in skipped:
            continue
        size = file.stat().st_size
        regions: list[tuple[int, int, list[str] | None]] = []
        pos = 0
        for offset, length, name in sorted(named.get(rel, [])):
            if offset < pos or offset + length > size:
                continue  # overlapping or out of range: the bytes stay covered by the gap regions
            if offset > pos:
                regions.append((pos, offset - pos, None))
            regions.append((offset, length, name))
            pos = offset + length
        if pos < size or not regions:
            regions.append((pos, size - pos, None))
        crcs = _file_crcs(file, [(o, n) for o, n, _ in regions])
        files[rel] = {"size": size, "regions": [[o, n, name, c] for (o, n, name), c in zip(regions, crcs)]}
    return {"algorithm": ALGORITHM, "files": files}


def check_files(directory: Path, record: dict[str, Any]) -> list[Mismatch]:
    """Every recorded file of a directory checkpoint that is missing, has another size, or whose bytes no
    longer match."""
    out: list[Mismatch] = []
    for rel, rec in record.get("files", {}).items():
        file = directory / rel
        if not file.is_file():
            out.append(Mismatch(file, None, None, None, None, "the file is missing"))
            continue
        size = file.stat().st_size
        if size != rec["size"]:
            out.append(Mismatch(file, None, None, None, None, f"it has {size} bytes, {rec['size']} were written"))
            continue
        regions = rec["regions"]
        crcs = _file_crcs(file, [(o, n) for o, n, _, _ in regions])
        for (offset, length, name, saved), now in zip(regions, crcs):
            if now != saved:
                entry, key = (name[0], ".".join(name[1:]) or None) if name else (None, None)
                out.append(Mismatch(file, entry, key, saved, now, f"{offset}-{offset + length}"))
    return out
