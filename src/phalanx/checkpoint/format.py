"""What a phalanx checkpoint file may contain, and opening one without running code.

torch.load unpickles, and unpickling can run any code the file names. torch >= 2.6 therefore opens
files with ``weights_only=True`` by default, which accepts tensors and plain containers only. Every
file phalanx writes (single-file checkpoints, the marker inside a sharded directory, ``phalanx
consolidate`` output) is checked against that set *before* it is written, so plain ``torch.load(path)``
opens it, and phalanx reads with ``weights_only=True`` unless the caller trusts the file and says so.
"""

from __future__ import annotations

import contextlib
import pickle
import re
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import torch

import phalanx.checkpoint.checksums as checksums
from phalanx.utils.errors import CheckpointError, CorruptCheckpointError

META_KEY = "__phalanx__"
#: The file inside a directory checkpoint that holds phalanx's metadata and the non-sharded entries;
#: written last, so a directory without it is an interrupted save.
MARKER = "phalanx_meta.pt"
#: The one format this version writes and reads: only plain values (loads with weights_only=True), entry
#: kinds and the shard layout recorded, and checksums (``meta["checksums"]``,
#: :mod:`phalanx.checkpoint.checksums`) verified on every load. Any other is refused (:func:`check_format`).
FORMAT_VERSION = 3
#: How a checkpoint's tensors are stored (``meta["layout"]``): one file, a torch.distributed.checkpoint
#: directory, or a directory holding DeepSpeed's engine checkpoint; each directory layout has a marker.
FILE_LAYOUT, DCP_LAYOUT, DEEPSPEED_LAYOUT = "file", "torch.distributed.checkpoint", "deepspeed"

_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_CONTAINERS = (dict, OrderedDict, Counter, list, tuple, set, torch.Size)


def find_unsafe(obj: Any, root: str = "state") -> tuple[str, Any] | None:
    """The first value in ``obj`` that ``torch.load(weights_only=True)`` would refuse, with its location
    (e.g. ``state['hparams']['cfg']``); None when everything is tensors and plain containers."""
    stack: list[tuple[Any, list[str]]] = [(obj, [root])]
    seen: set[int] = set()
    while stack:
        item, where = stack.pop()
        kind = type(item)
        if kind in _PLAIN_SCALARS:
            continue
        if kind in _PLAIN_TENSORS:
            # A tensor carrying Python attributes pickles them too; they must be plain as well.
            extra = getattr(item, "__dict__", None)
            if extra:
                stack += [(v, [*where, f".{k}"]) for k, v in extra.items()]
            continue
        if kind not in _CONTAINERS:
            return "".join(where), item
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            for key, value in item.items():
                if type(key) not in _PLAIN_SCALARS and type(key) is not tuple:
                    return "".join([*where, f" (key {key!r})"]), key
                stack.append((value, [*where, f"[{key!r}]"]))
        else:
            stack += [(value, [*where, f"[{i}]"]) for i, value in enumerate(item)]
    return None


def check_plain(obj: Any, root: str = "state") -> None:
    """Refuse to write what could not be opened safely (see the module docstring)."""
    found = find_unsafe(obj, root)
    if found is None:
        return
    where, value = found
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint cannot hold: "
        "phalanx writes only tensors and plain Python values (dict, list, tuple, str, int, float, bool, None) "
        "so that torch.load opens the file with weights_only=True, without running code from it. Store a "
        "plain form instead (e.g. str(path), vars(namespace), value.item(), the object's state_dict(); an "
        "object with state_dict()/load_state_dict() is saved that way automatically)."
    )


def make_meta(owner: Any, layout: str, entries: dict[str, str], **extra: Any) -> dict[str, Any]:
    """phalanx's own record in every checkpoint: who wrote it and how (plain values only)."""
    return {
        "format_version": FORMAT_VERSION,
        "layout": layout,
        "entries": dict(entries),
        "strategy": str(owner.name),
        "world_size": int(owner.world_size),
        "precision": str(owner.precision.name),
        "precision_state": owner.precision.state_dict(),
        "torch_version": str(torch.__version__),
        **extra,
    }


# ---------------------------------------------------------------------- reading
def _refused_global(err: BaseException) -> str | None:
    """The class or function a weights_only load refused to rebuild (None: the file is damaged instead)."""
    if not isinstance(err, pickle.UnpicklingError):
        return None
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
    return found.group(1) if found else None


def read_file(path: Path, weights_only: bool = True, what: str = "Checkpoint", mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint file onto the CPU, turning every way it can be unreadable into a clear error. ``mmap``:
    map its tensors instead of reading them into memory (their pages are read when used; verifying reads each
    once)."""
    path = Path(path)
    size = path.stat().st_size
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except (ImportError, AttributeError) as err:
        raise CheckpointError(
            f"{what} {path} refers to code that cannot be imported here ({type(err).__name__}: {err}). "
            "Make the classes it was saved with importable (same package and module path), then load again."
        ) from err
    except Exception as err:
        refused = _refused_global(err)
        if refused is not None:
            raise CheckpointError(
                f"{what} {path} holds objects other than tensors and plain Python values (a {refused}), so it "
                "was not opened: unpickling it could run code. If you trust where the file comes from, "
                "load it with fabric.load(path, state, weights_only=False) (or fabric.load_raw(..., "
                "weights_only=False)); saving it again with phalanx then gives a file that opens safely."
            ) from err
        # A file cut short, zero-filled past its data (a killed save's preallocated temporary) or otherwise
        # damaged can fail anywhere in torch.load: in the zip reader, in the legacy tar fallback (KeyError),
        # or in unpickling. All of it means the same to the user.
        raise CheckpointError(
            f"{what} {path} ({size} bytes) is truncated or corrupt and cannot be read: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. "
            "phalanx writes checkpoints atomically, so this file was not produced by a completed phalanx save; "
            "use an earlier checkpoint."
        ) from err
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{what} {path} holds a {type(ckpt).__name__}, not a dict of state.")
    if META_KEY not in ckpt:
        return ckpt  # not written by phalanx (torch.save(model.state_dict())): nothing recorded to check
    record = check_format(ckpt[META_KEY], path)
    if record.get("entries") is not None:
        found = checksums.check_state(ckpt, record, path)
        if found:
            raise corrupt(found, path.parent if path.name == MARKER else path, what)
    return ckpt


def looks_like_raw_state_dict(ckpt: dict[str, Any]) -> bool:
    """A file written by ``torch.save(model.state_dict())``: tensors under dotted parameter names."""
    values = [v for k, v in ckpt.items() if k != META_KEY]
    return META_KEY not in ckpt and bool(values) and all(hasattr(v, "shape") for v in values)


def strip_meta(ckpt: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in ckpt.items() if k != META_KEY}


# ---------------------------------------------------------------------- checksums
_SUFFIXES = (".ckpt", ".pt", ".pth")


def earlier_checkpoint(checkpoint: Path) -> Path | None:
    """The newest other checkpoint next to ``checkpoint`` (a file with a checkpoint suffix, or a directory
    with a marker) written before it, else the newest other one; None if there is none. A link to
    ``checkpoint`` itself (``last.ckpt``) does not count."""
    checkpoint = Path(checkpoint)
    own = 0.0
    with contextlib.suppress(OSError):
        own = checkpoint.stat().st_mtime
    candidates: list[tuple[bool, float, str, Path]] = []
    with contextlib.suppress(OSError):
        for sibling in checkpoint.parent.iterdir():
            if sibling.name.startswith(".") or sibling.name == checkpoint.name:
                continue
            with contextlib.suppress(OSError):
                if sibling.exists() and checkpoint.exists() and sibling.samefile(checkpoint):
                    continue
                if (sibling.is_file() and sibling.suffix in _SUFFIXES) or (sibling / MARKER).is_file():
                    mtime = sibling.stat().st_mtime
                    candidates.append((mtime <= own, mtime, sibling.name, sibling))
    return max(candidates)[3] if candidates else None


def _described(m: checksums.Mismatch, checkpoint: Path) -> str:
    where = "" if m.file == checkpoint else f" in {m.file}"  # a directory's file, or a marker
    if m.entry is None and m.saved is None:
        return f"{m.file}: {m.detail}"  # missing, or another size
    if m.entry is None:
        return f"bytes {m.detail} of {m.file}, which hold no tensor's data, do not match their checksum"
    if m.key is None:
        return f"entry {m.entry!r}{where} is not what was saved: {m.detail}"
    return (f"tensor {m.key!r} of entry {m.entry!r}{where} does not match its checksum (crc32 "
            f"{m.saved or 0:#010x} saved, {m.found or 0:#010x} now)")


def corrupt(found: list[checksums.Mismatch], checkpoint: Path, what: str = "Checkpoint") -> CorruptCheckpointError:
    """The error for a checkpoint whose bytes no longer match the checksums recorded when it was saved."""
    more = f" (and {len(found) - 1} more mismatch{'es' if len(found) > 2 else ''})" if len(found) > 1 else ""
    earlier = earlier_checkpoint(checkpoint)
    advice = f"Use the previous checkpoint, {earlier}." if earlier else "Use an earlier checkpoint."
    return CorruptCheckpointError(
        f"{what} {checkpoint} is corrupt: {_described(found[0], checkpoint)}{more}. Its bytes changed after phalanx "
        "saved it (a failing disk, a damaged copy), so loading it would silently give wrong values; it was refused. "
        f"{advice}"
    )


def check_format(meta: Any, path: Path) -> dict[str, Any]:
    """The checksum record of phalanx metadata ``meta`` (of the checkpoint at ``path``), after refusing
    metadata of any format but :data:`FORMAT_VERSION`, or without the record that format carries."""
    version = meta.get("format_version") if isinstance(meta, dict) else None
    record = checksums.applies(meta)
    if version != FORMAT_VERSION or record is None:
        raise CheckpointError(
            f"{path} is a phalanx checkpoint of format {version if version is not None else 'unknown'}"
            f"{' without checksums' if record is None else ''}; this phalanx version reads only format "
            f"{FORMAT_VERSION}, whose checksums every load verifies. Load it with the phalanx version that wrote "
            "it and save it again with this one, or load its weights into the model yourself and save them here."
        )
    return record


def check_directory(directory: Path, meta: dict[str, Any]) -> None:
    """Verify the shard files of a directory checkpoint against the checksums its marker recorded."""
    record = check_format(meta, directory)
    if not isinstance(record.get("files"), dict):
        raise CheckpointError(f"The marker of {directory} records no checksums of its shard files: the save that "
                              "wrote it did not finish. Use an earlier checkpoint.")
    found = checksums.check_files(directory, record)
    if found:
        raise corrupt(found, directory)
