"""Per-step snapshots: the checkpoint layer's tier for restarts, shared by ``callbacks.Snapshot`` (Trainer) and
``fabric.save_snapshot`` (Fabric).

A snapshot lives in node-local shared memory, which outlives the processes but not the node. Each rank
writes its own slots (:mod:`.writer`, :mod:`.slots`, :mod:`.copying`); the snapshot of a step exists once
every rank's metadata for it does, and is named by a *reference*, ``<folder>/snapshot-step=NNNNNNNNN``, a
path that ``fabric.load``, ``checkpoint.find`` and :func:`phalanx.checkpoint.latest` accept like a
checkpoint's: the checkpoint layer routes it here (:func:`restore`). A tier of the layer rather than a
package of its own because a resume must not care which it finds: the newest of checkpoints and snapshots
is one lookup, one ``load``, over the same state (``StateOwner``, ``sort_state``).

Every strategy takes this path: what a rank holds is its strategy's ``local_state`` (a DTensor's shard, a
ZeRO partition with its fp32 master weights) and goes back through its ``load_local_state``, in place and
without a collective. How often to take one is :mod:`.cadence`'s decision. The folder is derived from
something that stays the same across attempts of one run (the Trainer's ``default_root_dir``; the Fabric
script and working directory), so a restarted or rerun attempt finds it.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from phalanx.checkpoint.protocol import MODULE, OPTIMIZER, STATEFUL, StateOwner
from phalanx.checkpoint.snapshot.cadence import Cadence, Cost
from phalanx.checkpoint.snapshot.format import load_module_local, load_optimizer_local, plain_values
from phalanx.checkpoint.snapshot.slots import DATA, FolderClaim, read_header
from phalanx.checkpoint.snapshot.writer import RankSnapshots
from phalanx.checkpoint.state import sort_state
from phalanx.utils.errors import CheckpointError

SHARED_MEMORY = Path("/dev/shm")


def default_dir(*key: str | Path) -> Path:
    """``/dev/shm/phalanx-snapshots/<hash of key>``: one folder per run, the same for each of its attempts."""
    digest = hashlib.sha1("\0".join(str(Path(k).absolute()) for k in key).encode()).hexdigest()[:12]
    return SHARED_MEMORY / "phalanx-snapshots" / digest


def usable(folder: Path) -> bool:
    """Whether snapshots can be written under ``folder`` (its nearest existing parent is writable)."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return os.access(probe, os.W_OK)


REFERENCE = re.compile(r"snapshot-step=(\d+)")


def reference(folder: Path, step: int) -> Path:
    """The path that names the snapshot of ``step`` in ``folder`` (complete once every rank wrote its part)."""
    return folder / f"snapshot-step={step:09d}"


def is_reference(path: str | Path) -> bool:
    path = Path(path)
    return REFERENCE.fullmatch(path.name) is not None and not path.exists()


def complete_steps(folder: Path) -> dict[int, tuple[int, float]]:
    """The steps whose snapshot every rank finished: step -> (number of ranks, when the last one finished).
    Reads each slot's header only."""
    seen: dict[tuple[int, int], dict[int, float]] = {}
    if not folder.is_dir():
        return {}
    for entry in folder.iterdir():
        m = DATA.fullmatch(entry.name)
        header = read_header(entry) if m else None
        if header is not None and header.rank == int(m["rank"]):  # type: ignore[index]
            seen.setdefault((header.step, header.world_size), {})[header.rank] = header.finished
    out: dict[int, tuple[int, float]] = {}
    for (step, world), ranks in seen.items():
        if set(ranks) == set(range(world)):
            out[step] = (world, max(ranks.values()))
    return out


def finished_at(path: Path) -> float:
    """When every rank finished the snapshot ``path`` names (0.0 if not every rank did)."""
    m = REFERENCE.fullmatch(path.name)
    return complete_steps(path.parent).get(int(m[1]), (0, 0.0))[1] if m else 0.0


def problem_with(path: Path) -> str | None:
    """Why the snapshot ``path`` names cannot be resumed from, or None."""
    m = REFERENCE.fullmatch(path.name)
    if m is None:
        return f"{path} does not name a snapshot"
    if int(m[1]) in complete_steps(path.parent):
        return None
    return (f"not every rank finished its snapshot of step {int(m[1])} in {path.parent} (a rank was stopped while "
            "writing it, or this node's shared memory was cleared)")


def _extra(owner: StateOwner) -> dict[str, Any]:
    return {"strategy": owner.name, "precision": owner.precision.state_dict()}


def prepare(owner: StateOwner, writer: RankSnapshots, state: dict[str, Any]) -> None:
    """Set this rank's slots up for ``state`` before its first snapshot (in the background where it can be)."""
    writer.prepare(state, _extra(owner), owner.local_state)


def write(owner: StateOwner, writer: RankSnapshots, step: int, state: dict[str, Any]) -> Cost:
    """This rank's part of the snapshot of ``step`` (no collective; its reference is :func:`reference`);
    returns what it costs, filled in as the copy goes."""
    return writer.write(step, state, _extra(owner), owner.local_state)


def restore(owner: StateOwner, path: Path, state: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Put this rank's part of the snapshot ``path`` names into ``state``; return what ``state`` did not ask for."""
    problem = problem_with(path)
    if problem is not None:
        raise CheckpointError(f"Cannot load the snapshot {path}: {problem}.")
    step = int(REFERENCE.fullmatch(path.name)[1])  # type: ignore[index]
    saved, extra = RankSnapshots(path.parent, owner.global_rank, owner.world_size).read(step)
    if extra.get("strategy") != owner.name:
        raise CheckpointError(f"The snapshot {path} was written under strategy {extra.get('strategy')!r}; this job "
                              f"runs {owner.name!r}. A snapshot resumes the same topology only: resume from a disk "
                              "checkpoint.")
    entries = sort_state(state)
    absent = [e.key for e in entries if e.key not in saved]
    if strict and absent:
        raise CheckpointError(f"The snapshot {path} has no {absent}; it holds {sorted(saved)}.")
    place(owner, entries, state, saved, strict)
    if extra.get("precision"):
        owner.precision.load_state_dict(extra["precision"])
    return {k: plain_values(v) for k, v in saved.items() if k not in state}


def place(owner: StateOwner, entries: list[Any], state: dict[str, Any], saved: dict[str, Any], strict: bool) -> None:
    """Put this rank's ``saved`` parts into ``state``'s ``entries`` (``sort_state(state)``) in place: modules and
    optimizers through the owner's ``load_local_state`` (no collective), objects with ``load_state_dict``, plain
    values replaced. Shared by snapshots and the state a replica group receives from a peer (:mod:`..peer`)."""
    for e in entries:
        if e.key not in saved:
            continue
        value = saved[e.key]
        if e.kind in (MODULE, OPTIMIZER):
            owner.load_local_state(e.kind, e.obj, value, strict)
        elif e.kind == STATEFUL:
            e.obj.load_state_dict(plain_values(value))
        else:
            state[e.key] = plain_values(value)


__all__ = ["Cadence", "Cost", "FolderClaim", "RankSnapshots", "complete_steps", "default_dir", "finished_at",
           "is_reference", "load_module_local", "load_optimizer_local", "place", "prepare", "problem_with", "reference",
           "restore", "usable", "write"]
