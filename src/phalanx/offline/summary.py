"""What a checkpoint holds, read from its metadata: ``phalanx ckpt inspect``.

Beyond the checksums it recorded, which are verified by default (every byte is read once, on several
threads), no tensor data is read (files are memory-mapped, shards described by DCP's metadata, DeepSpeed's
weights by its recorded shapes), so inspecting needs no trust in the file beyond what ``weights_only=True``
allows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.protocol import DEEPSPEED, PLAIN_DCP, SAFETENSORS, SHARDED, SINGLE, STATE_DICT, tensors
from phalanx.checkpoint.sources import open_source

_LAYOUTS = {
    SINGLE: "single file (torch.save)",
    STATE_DICT: "plain state dict file (torch.save(model.state_dict()))",
    SAFETENSORS: "safetensors directory (model.safetensors, for from_pretrained)",
    SHARDED: "sharded directory (torch.distributed.checkpoint shards + phalanx marker)",
    PLAIN_DCP: "torch.distributed.checkpoint directory without phalanx's marker",
    DEEPSPEED: "DeepSpeed engine checkpoint directory (+ phalanx marker)",
}


def _loadable_by(kind: str, meta: dict[str, Any]) -> list[str]:
    shards = meta.get("shards", {})
    if kind == SINGLE:
        return ["fabric.load(path, state) under any strategy and world size",
                "torch.load(path) (weights_only=True)",
                "phalanx ckpt convert --to sharded | safetensors"]
    if kind == STATE_DICT:
        return ["model.load_state_dict(torch.load(path)) / fabric.load_raw(path, model)",
                "phalanx ckpt convert --to single | sharded | safetensors"]
    if kind == SHARDED:
        return ["fabric.load(path, state) under any strategy and world size (DCP reshards)",
                "torch.distributed.checkpoint (dcp.load, format_utils.dcp_to_torch_save)",
                "phalanx ckpt convert --to single | safetensors (phalanx consolidate: --to single)"]
    if kind == SAFETENSORS:
        return ["transformers' from_pretrained(path) (with a config.json beside it)",
                "safetensors.torch.load_file(path/model.safetensors)"]
    if kind == PLAIN_DCP:
        return ["torch.distributed.checkpoint (dcp.load, format_utils.dcp_to_torch_save)",
                "phalanx ckpt convert --to single | sharded | safetensors"]
    return [f"fabric.load(path, state) under any strategy and world size (natively under DeepSpeed with "
            f"{shards.get('world_size')} ranks at ZeRO stage {shards.get('stage')}; elsewhere ZeRO's partitions are "
            "merged on load)",
            "DeepSpeed's zero_to_fp32 (model weights)",
            "phalanx ckpt convert --to single | sharded | safetensors (ZeRO's partitions merged: weights and "
            "optimizer state; then any strategy and world size)"]


def counters(tree: dict[str, Any]) -> dict[str, Any]:
    """Step and epoch: a Trainer checkpoint's ``loops`` entry, else plain top-level ``step``/``global_step``
    and ``epoch`` values (a Fabric loop's state)."""
    loops = tree.get("loops")
    if isinstance(loops, dict):
        return {"step": loops.get("global_step"), "epoch": loops.get("epoch"),
                "batches_done": loops.get("batches_done"), "trainer": True}
    out: dict[str, Any] = {"trainer": False}
    for name in ("step", "global_step", "epoch"):
        value = tree.get(name)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta:
            value = value.item()
        if isinstance(value, int) and not isinstance(value, bool):
            out["step" if name == "global_step" else name] = value
    return out


_CHECKSUMS = {True: "verified (crc32 of every tensor matches what was saved)",
              False: "none recorded (not written by phalanx): not verified",
              None: "not verified (--no-verify)"}


def describe(path: str | Path, weights_only: bool = True, verify: bool = True) -> dict[str, Any]:
    """Everything ``phalanx ckpt inspect`` shows, as plain JSON-able values; tensors largest first. With
    ``verify`` the recorded checksums are checked first: a mismatch raises CorruptCheckpointError, naming
    the tensor."""
    source = open_source(path, weights_only, verify=verify)
    meta = source.meta
    listed: list[dict[str, Any]] = sorted(
        ({"name": name, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
          "bytes": t.numel() * t.dtype.itemsize} for name, t in tensors(source.tree)),
        key=lambda row: (-row["bytes"], row["name"]))
    entries = []
    for key, value in source.tree.items():
        rows = list(tensors(value))
        entries.append({"key": key, "kind": source.kinds.get(key, "plain"), "tensors": len(rows),
                        "bytes": sum(t.numel() * t.dtype.itemsize for _, t in rows),
                        "value": None if rows or isinstance(value, (dict, list, tuple)) else repr(value)[:80]})
    shards = meta.get("shards", {})
    return {
        "path": str(source.path),
        "layout": source.kind,
        "layout_description": _LAYOUTS[source.kind],
        "strategy": meta.get("strategy"),
        "world_size": meta.get("world_size"),
        "precision": meta.get("precision"),
        "zero_stage": shards.get("stage") if source.kind == DEEPSPEED else None,
        "format_version": meta.get("format_version"),
        "torch_version": meta.get("torch_version"),
        "converted_from": meta.get("converted_from"),
        **counters(source.tree),
        "entries": entries,
        "tensors": listed,
        "tensor_count": len(listed),
        "tensor_bytes": sum(int(row["bytes"]) for row in listed),
        "disk_bytes": source.disk_bytes,
        "files": len(source.files),
        "checksums": _CHECKSUMS[source.verified],
        "loadable_by": _loadable_by(source.kind, meta),
        "notes": source.notes,
    }


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def render(info: dict[str, Any], top: int | None) -> str:
    """``describe``'s result as text; ``top``: how many tensors to list (None: all)."""
    lines = [f"{info['path']}: {info['layout_description']}"]
    facts = [f"{k.replace('_', ' ')}: {info[k]}" for k in
             ("strategy", "world_size", "precision", "zero_stage", "step", "epoch", "converted_from")
             if info.get(k) is not None]
    if facts:
        lines.append("  " + ", ".join(facts))
    lines.append(f"  size: {human(info['tensor_bytes'])} in {info['tensor_count']} tensors; "
                 f"{human(info['disk_bytes'])} on disk in {info['files']} file(s)")
    lines.append(f"  checksums: {info['checksums']}")
    lines.append("entries:")
    for e in info["entries"]:
        what = f"{e['tensors']} tensors, {human(e['bytes'])}" if e["tensors"] else (e["value"] or "no tensors")
        lines.append(f"  {e['key']:<24} {e['kind']:<10} {what}")
    rows = info["tensors"] if top is None else info["tensors"][:top]
    if rows:
        lines.append("tensors:" if top is None or top >= len(info["tensors"]) else
                     f"largest {len(rows)} of {len(info['tensors'])} tensors (--all lists every one):")
        width = max(len(r["name"]) for r in rows)
        for r in rows:
            lines.append(f"  {r['name']:<{width}}  {r['dtype']:<9} {tuple(r['shape'])!s:<16} {human(r['bytes'])}")
    lines.append("loadable by:")
    lines += [f"  - {how}" for how in info["loadable_by"]]
    lines += [f"note: {note}" for note in info["notes"]]
    return "\n".join(lines)
