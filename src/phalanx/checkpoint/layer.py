"""Saving, loading and removing checkpoints on any strategy: the one place this logic lives.

Layouts: one file (``torch.save`` of plain state dicts plus ``__phalanx__`` metadata), or a directory
of a backend's shards plus the marker file ``phalanx_meta.pt`` (metadata and every entry the shards
do not hold), written last. Every operation is a collective: all ranks call it, rank 0 decides and
writes, and a failure on any rank reaches every rank as a ``CheckpointError`` carrying its true
cause, so ranks never part ways (one raising while the others wait, or go on with a half-written
checkpoint).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import phalanx.checkpoint.checksums as checksums
import phalanx.checkpoint.snapshot as snapshot
import phalanx.checkpoint.storage as storage
from phalanx.checkpoint.format import (
    DCP_LAYOUT,
    DEEPSPEED_LAYOUT,
    FILE_LAYOUT,
    MARKER,
    META_KEY,
    check_directory,
    check_plain,
    looks_like_raw_state_dict,
    make_meta,
    read_file,
    strip_meta,
)
from phalanx.checkpoint.protocol import MODULE, OPTIMIZER, PLAIN, STATEFUL, Entry, ShardIO, StateOwner, of_kind
from phalanx.checkpoint.replace import is_checkpoint_file, publish_directory
from phalanx.checkpoint.sources import locate, read_everything, read_marker
from phalanx.checkpoint.state import check_entries, module_mismatch, sort_state
from phalanx.distributed.outcome import run_on_rank0, run_together
from phalanx.utils.errors import CheckpointError, CollectiveError


# ---------------------------------------------------------------------- save
def _gather(owner: StateOwner, entries: list[Entry]) -> dict[str, Any]:
    """Plain state of each entry (modules and optimizers: collectives; rank 0's result is complete)."""
    out: dict[str, Any] = {}
    for e in entries:
        if e.kind == MODULE:
            out[e.key] = owner.gather_module_state(e.obj)
        elif e.kind == OPTIMIZER:
            out[e.key] = owner.gather_optimizer_state(e.module, e.obj)
        elif e.kind == STATEFUL:
            out[e.key] = e.obj.state_dict()
        else:
            out[e.key] = e.obj
    return out


def save(owner: StateOwner, path: str | Path, state: dict[str, Any]) -> None:
    path = Path(path)
    entries = sort_state(state)
    owner.barrier("save")  # enter together: a save reached by some ranks only fails here, named
    shards = owner.checkpoint_shards()
    if shards is None:
        def write_file() -> None:
            payload = _gather(owner, entries)
            if owner.is_global_zero:
                record = checksums.of_state(payload, FILE_LAYOUT)  # before the metadata joins the payload
                payload[META_KEY] = make_meta(owner, FILE_LAYOUT, {e.key: e.kind for e in entries}, checksums=record)
                check_plain(payload)
                # A checkpoint of the directory layout at `path` (a run that changed strategy saves where the
                # earlier attempt did) is replaced once this file is complete; any other directory is refused.
                storage.write_file(payload, path, replace_dir=(path / MARKER).is_file())

        run_together(owner, "save: rank 0 wrote the checkpoint", f"Saving {path}", write_file, CheckpointError)
        return

    tmp = begin_directory(owner, path)
    try:
        info = run_together(owner, "save: every rank wrote its shards", f"Saving {path}",
                         lambda: _write_shards(shards, tmp, path, entries), CheckpointError)
        write_marker(owner, tmp, path, shards.layout, entries, info, publish=True)
    except BaseException:
        if owner.is_global_zero:
            storage.delete_now(tmp)
        raise


# The phases of a directory save, shared with the asynchronous save (phalanx.checkpoint.async_sharded).
def begin_directory(owner: StateOwner, path: Path) -> Path:
    """Rank 0 checks ``path`` can take a directory checkpoint; every rank gets the hidden directory
    the checkpoint is assembled in (a collective)."""

    def prepare() -> str:
        if path.exists() and not path.is_dir() and not is_checkpoint_file(path):
            raise CheckpointError(
                f"Cannot write the checkpoint directory {path}: a file that is not a phalanx checkpoint exists "
                "at that path; refusing to replace it. Choose another path or move the file away."
            )
        if path.is_dir() and not (path / MARKER).is_file():
            raise CheckpointError(f"{path} exists and is not a phalanx checkpoint; refusing to replace it. "
                                  "Choose another path.")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise storage.write_error(err, path, "write checkpoint") from err
        storage.clear_stale(path)
        return uuid.uuid4().hex[:12]

    token = run_on_rank0(owner, "save: agree on the temporary directory", f"Saving {path}", prepare, CheckpointError)
    return storage.partial_dir(path, token)


def write_marker(
    owner: StateOwner, tmp: Path, path: Path, layout: str, entries: list[Entry], info: dict[str, Any], publish: bool
) -> None:
    """Rank 0 writes the marker into ``tmp``: phalanx's metadata and every entry the shards (``info``)
    do not hold, as of now. With ``publish`` it then moves ``tmp`` to ``path``. A collective: a failure
    reaches every rank."""
    rest = [e for e in entries if e.key not in info["sharded"]]

    def write() -> None:
        extras = _gather(owner, rest)
        if owner.is_global_zero:
            kinds = {e.key: e.kind for e in entries}
            record = checksums.of_state(extras, layout, within="extras")
            if publish:  # the shards are complete; an asynchronous save adds theirs once written
                record.update(checksums.of_files(tmp, skip=[MARKER]))
            marker = {META_KEY: make_meta(owner, layout, kinds, shards=info, checksums=record), "extras": extras}
            check_plain(marker)
            storage.write_file(marker, tmp / MARKER, "checkpoint marker")
            if publish:
                publish_directory(tmp, path)

    name = "save: rank 0 published the checkpoint" if publish else "save: rank 0 wrote the checkpoint marker"
    run_together(owner, name, f"Saving {path}", write, CheckpointError)


def _write_shards(shards: ShardIO, tmp: Path, path: Path, entries: list[Entry]) -> dict[str, Any]:
    try:
        return shards.write(tmp, entries)
    except (CheckpointError, CollectiveError):
        raise
    except Exception as err:
        raise storage.write_error(err, path, "write the shards of checkpoint") from err


# ---------------------------------------------------------------------- load
def _reader(owner: StateOwner, layout: str, path: Path) -> ShardIO:
    io = owner.checkpoint_shards(layout)
    if io is None and layout == DCP_LAYOUT:
        from phalanx.checkpoint.dcp import DCPShards

        io = DCPShards()
    if io is None and layout == DEEPSPEED_LAYOUT:
        # DeepSpeed's ZeRO partitions, merged into full state on every rank and loaded as a file would be.
        from phalanx.checkpoint.deepspeed_shards import DeepSpeedShards
        from phalanx.checkpoint.reshard import FullStateReader

        io = FullStateReader(DeepSpeedShards(), owner)
    if io is None:
        raise CheckpointError(
            f"{path} holds {layout} shards, which {owner.name!r} cannot read. Load it with the strategy that wrote "
            "it (or save it there with state_dict_type='full', a single file every strategy reads)."
        )
    return io


def _plan(
    owner: StateOwner, path: Path, entries: list[Entry], strict: bool, weights_only: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank 0: check the checkpoint against ``entries``. Returns what every rank needs (plain, small)
    and, for a single file, the file's content (kept on rank 0)."""
    found = locate(path).path
    names = {e.key for e in entries}
    if found.is_dir():
        marker = read_marker(found, weights_only)
        meta, extras = marker[META_KEY], marker["extras"]
        info = meta.get("shards", {})
        io = _reader(owner, meta["layout"], found)
        loadable = check_entries(entries, meta["entries"], strict, path)
        in_shards = set(info.get("sharded", []))
        io.check(found, info, [e for e in loadable if e.key in in_shards], weights_only)
        check_directory(found, meta)  # rank 0 alone, before any rank reads a shard
        for e in of_kind(loadable, MODULE):
            shapes = io.saved_shapes(found, info, e.key) if e.key in in_shards else extras[e.key]
            _check_module(owner, e, shapes, strict)
        plan = {
            "found": str(found), "layout": meta["layout"], "info": info, "meta": meta,
            "keys": [e.key for e in loadable],
            "values": {e.key: extras[e.key] for e in loadable if e.key not in in_shards},
            "unrequested": {k: v for k, v in extras.items() if k not in names},
        }
        return plan, {}
    ckpt = read_file(found, weights_only)
    meta = ckpt.get(META_KEY, {})
    saved = meta.get("entries") or {k: "unknown" for k in ckpt if k != META_KEY}
    loadable = check_entries(entries, saved, strict, path, raw_state_dict=looks_like_raw_state_dict(ckpt))
    for e in of_kind(loadable, MODULE, OPTIMIZER):
        if not isinstance(ckpt[e.key], dict):
            raise CheckpointError(f"Entry {e.key!r} of {path} is a {type(ckpt[e.key]).__name__}, not a state dict.")
        if e.kind == MODULE:
            _check_module(owner, e, ckpt[e.key], strict)
    plan = {"found": str(found), "layout": FILE_LAYOUT, "meta": meta, "keys": [e.key for e in loadable]}
    if owner.loads_full_state_on_rank0:
        # Only rank 0 holds the file: what is not broadcast tensor by tensor travels with the plan.
        # An optimizer that has not stepped has no tensors, only hyperparameters every rank needs.
        plan["values"] = {e.key: ckpt[e.key] for e in loadable
                          if e.kind in (STATEFUL, PLAIN) or (e.kind == OPTIMIZER and not ckpt[e.key].get("state"))}
        plan["unrequested"] = {k: v for k, v in strip_meta(ckpt).items() if k not in names}
    return plan, ckpt


def _check_module(owner: StateOwner, e: Entry, given: dict[str, Any] | None, strict: bool) -> None:
    if given is None:
        return  # the layout cannot tell its shapes: the backend's own load checks them
    name, expected = owner.module_layout(e.obj)
    error = module_mismatch(name, expected, given, strict)
    if error:
        raise CheckpointError(error)


def load(
    owner: StateOwner, path: str | Path, state: dict[str, Any] | None, strict: bool, weights_only: bool = True
) -> dict[str, Any]:
    """Restore ``state`` in place; return the checkpoint's entries ``state`` did not ask for (all of
    them, as full tensors, when ``state`` is None)."""
    path = Path(path)
    owner.barrier("load")
    if snapshot.is_reference(path):
        # Each rank reads its own part: a snapshot is only ever restored on the topology that wrote it.
        return run_together(owner, "load (finish)", f"Loading the snapshot {path}",
                         lambda: snapshot.restore(owner, path, state or {}, strict), CheckpointError)
    if state is None:
        # Each rank reads everything for itself; nothing to agree on but the end.
        everything = run_together(owner, "load (finish)", f"Loading {path}",
                               lambda: strip_meta(read_everything(path, weights_only)), CheckpointError)
        return everything
    entries = sort_state(state)
    local: dict[str, Any] = {}

    def plan() -> dict[str, Any]:
        shared, ckpt = _plan(owner, path, entries, strict, weights_only)
        local.update(ckpt)
        return shared

    verdict = run_on_rank0(owner, "load: rank 0 checked the checkpoint", f"Loading {path}", plan, CheckpointError)

    def restore() -> dict[str, Any]:
        return _restore(owner, verdict, [e for e in entries if e.key in verdict["keys"]], state, strict,
                        local, weights_only)

    return run_together(owner, "load (finish)", f"Loading {path}", restore, CheckpointError)


def _restore(
    owner: StateOwner, verdict: dict[str, Any], entries: list[Entry], state: dict[str, Any], strict: bool,
    local: dict[str, Any], weights_only: bool,
) -> dict[str, Any]:
    found = Path(verdict["found"])
    values: dict[str, Any] = verdict.get("values", {})
    from_rank0 = False
    unrequested = verdict.get("unrequested")
    if verdict["layout"] != FILE_LAYOUT:
        in_shards = set(verdict["info"].get("sharded", []))
        if in_shards & {e.key for e in entries}:
            sharded = [e for e in entries if e.key in in_shards]
            _reader(owner, verdict["layout"], found).read(found, verdict["info"], sharded, strict)
        entries = [e for e in entries if e.key not in in_shards]
    elif owner.loads_full_state_on_rank0:
        from_rank0 = True
    elif not owner.is_global_zero:
        local = read_file(found, weights_only)  # every rank reads the file itself
    if unrequested is None:
        names = set(state)
        unrequested = {k: v for k, v in strip_meta(local).items() if k not in names}
    # Modules first, then optimizers: under FSDP each is a collective, in the same order on every rank.
    for e in of_kind(entries, MODULE):
        value = values[e.key] if e.key in values else local.get(e.key, {})
        owner.scatter_module_state(e.obj, value, strict, from_rank0 and e.key not in values)
    for e in of_kind(entries, OPTIMIZER):
        value = values[e.key] if e.key in values else local.get(e.key, {})
        owner.scatter_optimizer_state(e.module, e.obj, value, from_rank0 and e.key not in values)
    for e in of_kind(entries, STATEFUL, PLAIN):
        value = values[e.key] if e.key in values else local[e.key]
        if e.kind == STATEFUL:
            e.obj.load_state_dict(value)
        else:
            state[e.key] = value
    precision_state = verdict["meta"].get("precision_state")
    if precision_state:
        owner.precision.load_state_dict(precision_state)
    return dict(unrequested)


def load_raw(owner: StateOwner, path: str | Path, obj: Any, strict: bool, weights_only: bool = True) -> None:
    """Load a plain state dict file (``torch.save(model.state_dict())``) into one module or optimizer."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"No state dict file at {path}." if not path.exists() else
                              f"{path} is a directory; load_raw reads one state dict file. Use fabric.load.")
    sd = read_file(path, weights_only, what="State dict file")
    if META_KEY in sd:
        first = next((k for k in sd if k != META_KEY), "model")
        raise CheckpointError(
            f"{path} is a phalanx checkpoint (entries {sorted(strip_meta(sd))}), not a plain state dict: load it "
            f"with fabric.load(path, {{{first!r}: ...}})."
        )
    (entry,) = sort_state({"obj": obj})
    if entry.kind == MODULE:
        _check_module(owner, entry, sd, strict)
        owner.scatter_module_state(entry.obj, sd, strict, False)
    elif entry.kind == OPTIMIZER:
        owner.scatter_optimizer_state(entry.module, entry.obj, sd, False)
    else:
        raise CheckpointError(f"load_raw loads into a module or an optimizer, got {type(obj).__name__}.")


# ---------------------------------------------------------------------- remove
def remove(owner: StateOwner, path: str | Path) -> None:
    """Delete the checkpoint at ``path`` (file or directory); every rank calls, rank 0 deletes."""
    target = Path(path)
    run_on_rank0(owner, "remove checkpoint", f"Removing {target}", lambda: storage.remove(target),
                 CheckpointError)
