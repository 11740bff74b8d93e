"""What a Fabric loop saves and resumes from: ``fabric.save`` / ``load`` / ``load_raw`` /
``remove_checkpoint`` / ``latest_checkpoint``.

Thin on purpose: what a checkpoint holds, how it is written atomically and read without running code
is the checkpoint layer's (:mod:`phalanx.checkpoint`), reached through the strategy, which decides who
writes what (rank 0 a full file, every rank its shards). Here the user-facing arguments are checked,
with what to write instead, and a restarted attempt says where it resumed (or that it started over).

A run that was preempted in this folder (``preempted.json``, written by ``fabric.exit_preempted``) keeps its
checkpoint: a later run may save over it only once it has loaded it (resumed the preempted run); a run that
resumed from it and ends well removes the record.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

from phalanx import checkpoint
from phalanx.distributed import restarts
from phalanx.distributed.launch import restart_count
from phalanx.distributed.runfolder import PreemptedRun
from phalanx.distributed.runlogs import shown_path
from phalanx.offline.summary import counters
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.checkpoint import AsyncCheckpoint
    from phalanx.fabric.snapshots import Snapshots
    from phalanx.strategies import Strategy


#: The entry a checkpoint of a replica group holds torchft's manager state (its step count) and the tally under.
REPLICA_GROUPS_KEY = "replica_groups"


class Persistence:
    """The checkpoint calls of one Fabric. Every rank calls them, after joining the job (the strategy
    decides who writes); ``latest`` remembers what it found, so that loading it is reported as resuming."""

    def __init__(self, strategy: Strategy, snapshots: Snapshots, folder: Path | None = None) -> None:
        """``folder``: the run's folder, where a preempted run is recorded (None: the working directory)."""
        self._strategy, self._snapshots, self._folder = strategy, snapshots, folder
        self._latest: Path | None = None
        self._resumed_preempted = False  # this run loaded the checkpoint of the preempted run recorded here

    def _preempted(self) -> PreemptedRun | None:
        """The preempted run whose checkpoint this run has not resumed (on its first attempt: a restart
        continues a run that did, or that did not find one)."""
        if self._resumed_preempted or restart_count() > 0:
            return None
        return PreemptedRun.read(self._folder or Path.cwd())

    def save(self, path: str | Path, state: dict[str, Any], filter: Any) -> AsyncCheckpoint | None:
        if filter is not None:
            raise MisconfigurationError(
                "fabric.save(filter=...) is not supported: a checkpoint holds whole state dicts, so that it can "
                "always be loaded back strictly. Save a dict of the entries you want instead (e.g. "
                "{'adapter': {k: v for k, v in model.state_dict().items() if 'lora' in k}})."
            )
        if not isinstance(state, Mapping):
            raise MisconfigurationError(f"fabric.save expects a dict of state, got {type(state).__name__}.")
        preempted = self._preempted()
        if preempted is not None and preempted.is_checkpoint(path):
            record = shown_path(str(PreemptedRun.path(self._folder or Path.cwd())))
            raise MisconfigurationError(
                f"fabric.save({str(path)!r}) would overwrite the checkpoint of the run preempted{preempted.at()} in "
                f"this folder ({record} records it), which this run has not resumed. Either resume it: "
                "fabric.load(fabric.latest_checkpoint(...), state) with its folder before training; or keep it and "
                f"start afresh: save elsewhere, or delete {record} first."
            )
        state = dict(state)
        groups = self._strategy.replica_groups
        if groups is not None:  # torchft's step counter goes with the weights: a rerun's groups agree on where they are
            state.setdefault(REPLICA_GROUPS_KEY, groups)
        return self._strategy.save_checkpoint(path, state)

    def load(self, path: str | Path, state: dict[str, Any] | None, strict: bool,
             weights_only: bool | None) -> dict[str, Any]:
        self._snapshots.settle()  # a snapshot copied in the background is complete before anything is loaded
        rest = self._strategy.load_checkpoint(path, state, strict, weights_only is not False)
        groups = self._strategy.replica_groups
        if groups is not None and REPLICA_GROUPS_KEY in rest and (state is None or REPLICA_GROUPS_KEY not in state):
            groups.load_state_dict(rest.pop(REPLICA_GROUPS_KEY))
        preempted = self._preempted()
        self._resumed_preempted = self._resumed_preempted or (preempted is not None and preempted.is_checkpoint(path))
        if self._latest is not None and Path(path) == self._latest:
            found = counters({**rest, **(state or {})})
            restarts.resumed(path, found.get("step"), found.get("epoch"), self._strategy.global_rank)
        return rest

    def load_raw(self, path: str | Path, obj: nn.Module | Optimizer, strict: bool, weights_only: bool | None) -> None:
        self._strategy.load_raw_checkpoint(path, obj, strict, weights_only is not False)

    def remove(self, path: str | Path) -> None:
        self._strategy.remove_checkpoint(path)

    def latest(self, dirs: list[Path]) -> Path | None:
        """The newest complete checkpoint in ``dirs``: rank 0 decides and broadcasts its answer (the caller
        has joined a job of several processes)."""
        self._snapshots.settle()
        strategy = self._strategy
        if strategy.num_processes > 1:
            found = checkpoint.latest(dirs, world_size=strategy.world_size) if strategy.global_rank == 0 else None
            answer = strategy.broadcast(str(found) if found is not None else None)
            self._latest = Path(answer) if answer is not None else None
        else:
            self._latest = checkpoint.latest(dirs, world_size=1)
        if self._latest is None:
            restarts.started_over(f"Nothing to resume from in {', '.join(map(str, dirs))}: the loop starts from its "
                                  "beginning", strategy.global_rank)
        return self._latest

    def end(self, failed: bool) -> None:
        """The run ends (``failed``: not well, or preempted again): one that resumed the preempted run recorded
        in its folder and ends well removes the record (rank 0)."""
        if self._resumed_preempted and not failed and self._strategy.global_rank == 0:
            PreemptedRun.remove(self._folder or Path.cwd())

    def say_started_over(self) -> None:
        """At the first ``fabric.backward`` of a restarted attempt that did not resume through ``latest``: say
        so (rank 0), so that a restart is never silent."""
        restarts.started_over("The script runs again from its start: it resumes only from what it loads itself "
                              "(fabric.latest_checkpoint finds the newest checkpoint)", self._strategy.global_rank)


__all__ = ["Persistence"]
