"""``CheckpointConnector``: what a Trainer checkpoint holds, putting it back exactly, and the runs that
survive (stop on preemption, resume after a restart).

Saved: the model, optimizer, schedulers (and the precision's loss scaler, through fabric.save), the
loop counters and the position inside the epoch, every callback's ``state_dict``, the datamodule's
state, and per rank: the RNG states (now and at the start of the epoch) and the training metric
accumulators. Resuming restores all of it, so a run killed mid-epoch and resumed ends bit-identical
to one that never stopped (deterministic CPU runs).

Checkpoints are taken only between optimizer steps: saving inside an accumulation window would drop
the gradients accumulated so far, so the Trainer refuses. Everything stored is a tensor or a plain
Python value (hyperparameters are converted), so the file opens with ``torch.load(weights_only=True)``.

* **Preemption.** ``fabric.stop_requested()`` runs at every optimizer-step boundary (one all-reduce of two
  integers). When any rank received SIGTERM/SIGUSR1, every rank writes the same complete checkpoint
  (``last.ckpt`` in the first ModelCheckpoint's folder, or ``<log_dir>/checkpoints``) and the process ends
  with exit code 75 and one line on the terminal.
* **Restarts.** Under a restarting launcher (``Trainer(max_restarts=K)``, ``phalanx run --max-restarts K``,
  ``torchrun --max-restarts K``) a restarted attempt resumes by itself from the newest complete checkpoint
  or snapshot its run wrote (:meth:`CheckpointConnector.newest_resumable`), or else from the one its run
  started from, and says in one line what failed and where it resumed (:mod:`phalanx.distributed.restarts`);
  never silently from step 0, never from another run's state.
* **One run per folder.** A fit claims ``default_root_dir`` before it writes anything (rank 0 holds a
  :class:`~phalanx.distributed.runfolder.RunClaim` until the fit ends); a second fit there is refused.
* **Reruns.** The preemption is recorded in ``default_root_dir`` (``preempted.json``). The next fit there with
  ``ckpt_path=None`` resumes from that checkpoint and says so; an explicit ``ckpt_path`` naming another one is
  refused, naming both ways on; the record goes when the resumed fit ends.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
from collections.abc import Callable, Mapping
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from phalanx import checkpoint
from phalanx.checkpoint import find_unsafe
from phalanx.checkpoint.snapshot import Cadence
from phalanx.core.module_state import load_metric_states, metric_states
from phalanx.distributed import restarts
from phalanx.distributed.runfolder import PreemptedRun, RunClaim
from phalanx.distributed.runlogs import shown_path
from phalanx.utils import diagnostics
from phalanx.utils.errors import CheckpointError, CorruptCheckpointError, MisconfigurationError
from phalanx.utils.seed import capture_rng_state

if TYPE_CHECKING:
    from phalanx.checkpoint import AsyncCheckpoint
    from phalanx.trainer.attributes import TrainerAttributes

FORMAT = 1


def callback_keys(callbacks: list[Any]) -> list[tuple[str, Any]]:
    """A stable key per stateful callback: its ``state_key`` (or class name), numbered if repeated."""
    seen: dict[str, int] = {}
    out = []
    for cb in callbacks:
        if not callable(getattr(cb, "state_dict", None)):
            continue
        key = getattr(cb, "state_key", None) or type(cb).__qualname__
        n = seen.get(key, 0)
        seen[key] = n + 1
        out.append((key if n == 0 else f"{key}#{n}", cb))
    return out


def plain_hparams(value: Any, where: str = "hparams") -> Any:
    """Hyperparameters as plain values: a Namespace, dataclass or mapping becomes a dict, a path a str,
    an enum its value, a NumPy scalar or array a number or list. Anything else is stored as its
    ``repr`` with a warning (hyperparameters are a record, not state that resuming needs)."""
    if find_unsafe(value) is None:
        return value
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k) if find_unsafe(k) else k: plain_hparams(v, f"{where}[{k!r}]")
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain_hparams(v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, (PurePath, os.PathLike)):
        return os.fspath(value)
    if isinstance(value, enum.Enum):
        return plain_hparams(value.value, where)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()  # a tensor subclass: stored as a plain tensor
    tolist = getattr(value, "tolist", None)  # NumPy scalars and arrays
    if callable(tolist) and type(value).__module__.startswith("numpy"):
        return plain_hparams(tolist(), where)
    diagnostics.warn(
        f"The hyperparameter {where} is a {type(value).__qualname__}, which a checkpoint cannot hold (it must open "
        f"with torch.load(weights_only=True)); its repr is stored instead. Pass plain values to save_hyperparameters."
    )
    return repr(value)


class CheckpointConnector:
    """Saves, finds and restores a Trainer's checkpoints and snapshots (``trainer.checkpoint_connector``).
    It reads nearly everything the Trainer holds, so it takes the Trainer."""

    def __init__(self, trainer: TrainerAttributes) -> None:
        self.trainer = trainer
        self._claim: RunClaim | None = None  # rank 0's, while a fit runs
        self._autoresumed: PreemptedRun | None = None  # the preempted run this fit resumes without being asked

    def save(self, path: str | Path, weights_only: bool = False) -> AsyncCheckpoint | None:
        """Write a checkpoint (call on every rank; rank 0 writes, atomically). Returns the handle of a save that
        continues in the background, if the strategy saves so."""
        t = self.trainer
        t.loss_check.flush()  # never a checkpoint of weights that took a non-finite loss's step
        return t.fabric.save(path, self._state(weights_only, gather=True, what="trainer.save_checkpoint()"))

    def snapshot(self, folder: Path, keep: int, overlap: bool, every_n_steps: int | str | Cadence,
                 max_overhead: float, rng: Callable[[], dict[str, Any]] = capture_rng_state) -> Path | None:
        """This step's snapshot in ``folder`` when one is due (every rank, every step; see ``fabric.save_snapshot``).
        Each rank keeps its own RNG and metric state, so nothing is gathered."""
        t = self.trainer
        return t.fabric.save_snapshot(lambda: self._state(False, gather=False, what="A snapshot", rng=rng),
                                      t.global_step,
                                      folder, keep=keep, overlap=overlap, every_n_steps=every_n_steps,
                                      max_overhead=max_overhead)

    def _state(self, weights_only: bool, gather: bool, what: str,
               rng: Callable[[], dict[str, Any]] = capture_rng_state) -> dict[str, Any]:
        """Everything a checkpoint holds. ``rank_states``: every rank's (``gather``, a collective) or only this
        rank's, at its index (a snapshot, which each rank writes for itself)."""
        t = self.trainer
        if t.model is None:
            raise MisconfigurationError(f"{what} needs a model: call it during or after fit/validate.")
        if t.in_window:
            raise MisconfigurationError(
                f"{what} was called inside a gradient-accumulation window: the gradients accumulated "
                "so far are not part of a checkpoint, so resuming would not match. Save after an optimizer step "
                "(e.g. when trainer.global_step changes), as ModelCheckpoint does."
            )
        state: dict[str, Any] = {"model": t.model, "phalanx_trainer": FORMAT,
                                 "hyper_parameters": plain_hparams(dict(t.module.hparams))}
        if not weights_only:
            if t.optimizer is not None:
                state["optimizer"] = t.optimizer
            for i, config in enumerate(t.lr_scheduler_configs):
                state[f"lr_scheduler_{i}"] = config.scheduler
            loop = t.loop_state
            done = loop.epoch_finished
            per_batch, sampler = t.train_samples_per_batch, t.train_sampler
            replicas = sampler.num_replicas if sampler is not None else 0
            composition = (replicas, per_batch // replicas if replicas else 0, t.accumulate_grad_batches)
            state["loops"] = loop.state_dict(t.world_size, per_batch, composition)
            state["callbacks"] = {key: cb.state_dict() for key, cb in callback_keys(t.callbacks)}
            if t.datamodule is not None:
                state["datamodule"] = t.datamodule.state_dict()
            own = {
                "rng": rng(),
                "epoch_rng": None if done else loop.epoch_start_rng,
                "results": None if done else t.logger_connector.train_state_dict(host=gather),
                # torchmetrics state: not in state_dict (non-persistent)
                "metrics": metric_states(t.module, host=gather),
            }
            if gather:
                state["rank_states"] = t.fabric.all_gather_object(own)
            else:
                state["rank_states"] = [own if r == t.global_rank else None for r in range(t.world_size)]
        for _, hook in t.hooks.callback_methods("on_save_checkpoint"):  # those that define it (looked up once)
            hook(t, t.module, state)
        t.module.on_save_checkpoint(state)
        return state

    def resolve(self, ckpt_path: str | Path | None) -> Path | None:
        """The checkpoint ``ckpt_path`` ("last", "best" or a path) names, decided on rank 0 for every rank.
        A file or a sharded directory counts; an incomplete one is an error, never a silent fresh start."""
        t = self.trainer
        if ckpt_path is None:
            return None
        verdict: tuple[str | None, str | None, str | None] = (None, None, None)  # path, error kind, message
        if t.is_global_zero:
            verdict = self._resolve_here(ckpt_path)
        found, kind, message = t.fabric.broadcast(verdict)
        if kind == "missing":
            raise MisconfigurationError(message)
        if kind == "incomplete":
            raise CheckpointError(message)
        if kind == "fresh":
            diagnostics.warn(str(message), rank=t.global_rank)
        elif kind == "first":
            diagnostics.info(str(message), rank=t.global_rank)
        return Path(found) if found is not None else None

    def checkpoint_dirs(self) -> list[Path]:
        """Where a resumed or restarted fit looks for its newest state: every ModelCheckpoint folder (for the
        default ``<root>/<name>/version_N/checkpoints``, every version's: a rerun logs into a new version), the
        folders of callbacks that keep snapshots (``snapshot_dirpath``), and ``<default_root_dir>/checkpoints``."""
        t = self.trainer
        dirs: list[Path] = []
        for cb in t.checkpoint_callbacks:
            if not cb.dirpath:
                continue
            folder = Path(cb.dirpath)
            dirs.append(folder)
            if folder.name == "checkpoints" and folder.parent.name.startswith("version_"):
                dirs += sorted(folder.parent.parent.glob("version_*/checkpoints"))
        dirs += [Path(d) for cb in t.callbacks if (d := getattr(cb, "snapshot_dirpath", None))]
        dirs.append(Path(t.default_root_dir) / "checkpoints")
        return list(dict.fromkeys(dirs))

    def newest_resumable(self, also: list[str] | None = None, since: float = 0.0) -> Path | None:
        """The newest complete checkpoint a fit can resume from: ``last*`` checkpoints (ModelCheckpoint's last,
        the preemption checkpoint) and snapshots in :func:`checkpoint_dirs` finished at ``since`` or later (a
        time), and the paths in ``also``. Top-k checkpoints are not candidates: they may hold weights only.
        Rank-local: call on rank 0 and share."""
        t = self.trainer
        found = [checkpoint.latest(self.checkpoint_dirs(), "last*")]
        found += [checkpoint.latest([Path(d)], world_size=t.world_size)
                  for cb in t.callbacks if (d := getattr(cb, "snapshot_dirpath", None))]
        found = [f for f in found if f is not None and checkpoint.finished_at(f) >= since]
        for candidate in filter(None, also or []):
            hit = checkpoint.find(candidate)
            if hit is not None and hit.problem is None and not hit.recovered:
                found.append(Path(candidate))
        return max(filter(None, found), key=checkpoint.finished_at, default=None)

    def _resolve_here(self, ckpt_path: str | Path) -> tuple[str | None, str | None, str | None]:
        t = self.trainer
        if ckpt_path in ("last", "best"):
            attr = "last_model_path" if ckpt_path == "last" else "best_model_path"
            candidates = [getattr(cb, attr, "") for cb in t.checkpoint_callbacks]
            if ckpt_path == "last":
                candidates += [str(Path(cb.dirpath) / "last.ckpt") for cb in t.checkpoint_callbacks if cb.dirpath]
                newest = self.newest_resumable(candidates)  # a preemption checkpoint or snapshot may be newer
                candidates = [str(newest), *candidates] if newest is not None else candidates
            for candidate in filter(None, candidates):
                found = checkpoint.find(candidate)
                if found is None:
                    continue
                if found.problem:
                    return None, "incomplete", (
                        f"ckpt_path={ckpt_path!r} resolves to {candidate}, which cannot be resumed from: "
                        f"{found.problem} "
                        "Pass the path of an earlier checkpoint as ckpt_path."
                    )
                return candidate, None, None
            if ckpt_path == "best":
                return None, "missing", ("ckpt_path='best' needs a ModelCheckpoint with a monitor that has saved a "
                                         "checkpoint.")
            folders = sorted({str(cb.dirpath) for cb in t.checkpoint_callbacks if cb.dirpath})
            if any(cb.dirpath and getattr(cb, "save_last", False) for cb in t.checkpoint_callbacks):
                # Set up to resume, nothing saved yet: the first attempt of a run that will resume later.
                return None, "first", (
                    f"ckpt_path='last': no last.ckpt in {folders} yet; training starts from scratch (a later run "
                    "with the same command resumes from the last.ckpt this one writes)."
                )
            return None, "fresh", (
                f"ckpt_path='last': no last.ckpt in the ModelCheckpoint folders {folders}; training starts from "
                "scratch. "
                "Give ModelCheckpoint save_last=True and a fixed dirpath to resume across runs."
            )
        found = checkpoint.find(ckpt_path)
        if found is None:
            return None, "missing", f"ckpt_path {checkpoint.missing(ckpt_path, self.checkpoint_dirs())}"
        if found.problem:
            return None, "incomplete", f"ckpt_path={str(ckpt_path)!r} cannot be loaded: {found.problem}"
        return str(ckpt_path), None, None

    def load_weights(self, path: str | Path) -> None:
        """Only the model (for validate/test/predict with ckpt_path)."""
        self.trainer.fabric.load(path, {"model": self.trainer.model}, strict=False)

    def restore(self, path: str | Path) -> None:
        """Restore everything ``save`` wrote; the loops pick up the resume state at the next epoch start."""
        t = self.trainer
        state: dict[str, Any] = {"model": t.model, "optimizer": t.optimizer}
        for i, config in enumerate(t.lr_scheduler_configs):
            state[f"lr_scheduler_{i}"] = config.scheduler
        try:
            rest = t.fabric.load(path, state, strict=True)
        except CorruptCheckpointError:
            raise  # says what to do (use an earlier checkpoint): the hint below would mislead
        except CheckpointError as err:
            raise CheckpointError(
                f"Cannot resume training from {path}: {err} (a weights-only checkpoint, or one written with a "
                "different configure_optimizers, cannot resume a fit; load its weights with trainer.validate/test"
                "(ckpt_path=...) or fabric.load instead)."
            ) from err
        if rest.get("phalanx_trainer") != FORMAT or "loops" not in rest:
            raise CheckpointError(f"{path} was not written by phalanx.Trainer.save_checkpoint; it cannot resume a fit.")
        self._restore_rest(rest)

    def _restore_rest(self, rest: dict[str, Any]) -> None:
        """Everything but the model, optimizer and schedulers: counters, callbacks, datamodule, this rank's RNG and
        metric state, and where the next epoch starts."""
        t = self.trainer
        loops = rest["loops"]
        t.loop_state.load_state_dict(loops)
        saved = rest.get("callbacks", {})
        current = dict(callback_keys(t.callbacks))
        for key, cb_state in saved.items():
            if key in current:
                current[key].load_state_dict(cb_state)
            else:
                diagnostics.warn(f"The checkpoint holds state of callback {key!r}, which this Trainer does not have; "
                                 "it is ignored.", rank=t.global_rank)
        if t.datamodule is not None and "datamodule" in rest:
            t.datamodule.load_state_dict(rest["datamodule"])
        ranks = rest["rank_states"]
        if len(ranks) == t.world_size:
            mine = ranks[t.global_rank]
        else:
            # A different world size cannot replay per-rank random streams; say so, keep going.
            diagnostics.notice(f"The checkpoint was written by {len(ranks)} ranks and this job has {t.world_size}: "
                               "data order and counters are restored, per-rank RNG states and partial epoch metrics "
                               "are "
                               "not.", rank=t.global_rank)
            mine = {"rng": capture_rng_state(), "epoch_rng": None, "results": None}
        load_metric_states(t.module, mine.get("metrics"))
        replicas, batch_size = int(loops["data_replicas"]), int(loops["batch_size"])
        t.set_resume_state({
            "batches_done": t.loop_state.batches_done, "samples": int(loops["samples_consumed"]),
            "samples_per_batch": replicas * batch_size,  # the saved global batch, for loops.resume_start
            "composition": (replicas, batch_size, int(loops["accumulate_grad_batches"])) if replicas else None,
            "rng": mine["rng"], "epoch_rng": mine["epoch_rng"],
            "results": mine["results"],
        })
        for cb in t.callbacks:
            hook = getattr(cb, "on_load_checkpoint", None)
            if callable(hook):
                hook(t, t.module, rest)
        t.module.on_load_checkpoint(rest)

    def share_with_replica_groups(self) -> None:
        """Under fault tolerance: what a group that (re)joins receives from this one is everything a snapshot holds
        (no collective: each rank its own part), and the sampler's seed. A no-op without replica groups."""
        t = self.trainer
        groups = t.fabric.replica_groups
        if groups is None:
            return
        groups.samples_per_step = t.train_samples_per_batch * t.accumulate_grad_batches // groups.env.groups

        def state() -> dict[str, Any]:
            out = self._state(False, gather=False, what="A replica group's state")
            out["train_sampler_seed"] = t.train_sampler.seed if t.train_sampler is not None else 0
            return out

        t.fabric.join_replica_groups(state, self._healed)

    def _healed(self, rest: dict[str, Any]) -> None:
        """A live group's state arrived (model, optimizer and schedulers are in place): take its counters and data
        position. It was captured inside the step both groups are taking, before the loop counted that batch, so
        this group goes on after it; the epoch in progress ends at this step (``LoopState.healed``)."""
        t = self.trainer
        if t.train_sampler is not None:
            t.train_sampler.seed = int(rest["train_sampler_seed"])
        loops = dict(rest["loops"])
        loops["batches_done"] = int(loops["batches_done"]) + 1
        loops["samples_consumed"] = int(loops["samples_consumed"]) + int(loops["data_replicas"]) * int(
            loops["batch_size"])
        self._restore_rest({**rest, "loops": loops})
        t.loop_state.healed = True

    def preemption_path(self) -> Path:
        """Where the preemption checkpoint goes: ``last.ckpt`` where ``fit(ckpt_path="last")`` looks first."""
        t = self.trainer
        folder = next((Path(cb.dirpath) for cb in t.checkpoint_callbacks if cb.dirpath), None)
        return (folder if folder is not None else Path(t.log_dir) / "checkpoints") / "last.ckpt"

    def stop_for_preemption(self) -> NoReturn:
        """Every rank: write the checkpoint, then end the process (exit code 75) with one line on rank 0, which
        records the run as preempted in its folder once the checkpoint is complete."""
        t = self.trainer
        path = self.preemption_path()
        pending = self.save(path)
        if pending is not None:
            pending.wait()
        t.fabric.exit_preempted(path, step=t.global_step)

    def check_preemption(self) -> None:
        """At an optimizer-step boundary, on every rank: stop here if any rank was asked to."""
        t = self.trainer
        if t.fabric.stop_requested():
            self.stop_for_preemption()

    # ------------------------------------------------------------------ the run's folder, where a fit starts
    def claim_folder(self) -> None:
        """Before a fit writes anything: claim ``default_root_dir`` for it (rank 0; every rank raises the same
        error while another run holds it)."""
        t = self.trainer
        refusal: str | None = None
        if t.is_global_zero:
            try:
                self._claim = RunClaim(Path(t.default_root_dir), restarted=t.fabric.restart_count > 0)
            except MisconfigurationError as err:
                refusal = str(err)
            except OSError as err:  # e.g. a file system without locks: run, but say what is not guarded
                diagnostics.warn(f"The run folder {t.default_root_dir} cannot be claimed ({err}): a second run started "
                                 "there would not be refused.", rank=0)
        refusal = t.fabric.broadcast(refusal)
        if refusal is not None:
            raise MisconfigurationError(refusal)

    def release_folder(self, failed: bool) -> None:
        """After the fit: let go of the folder (leaving its record where a restarted attempt may follow)."""
        if self._claim is not None:
            self._claim.release(ended_well=not failed)
            self._claim = None

    def starting_point(self, ckpt_path: Any) -> Path | None:
        """The checkpoint this fit starts from, on every rank: on a restarted attempt the newest state of this
        run (:meth:`resume_after_restart`); after a preemption recorded in the folder, its checkpoint (``ckpt_path``
        None, or naming it; another is refused); else what ``ckpt_path`` names."""
        t = self.trainer
        if t.fabric.restart_count > 0:
            return self.resolve(self.resume_after_restart())
        verdict: tuple[PreemptedRun | None, str | None] = (None, None)
        if t.is_global_zero:
            try:
                found = PreemptedRun.read(Path(t.default_root_dir))
                verdict = (found, None) if found is None or checkpoint.find(found.checkpoint) is not None else (
                    found, "missing")
            except MisconfigurationError as err:
                verdict = (None, str(err))
        preempted, problem = t.fabric.broadcast(verdict)
        if preempted is None:
            if problem is not None:
                raise MisconfigurationError(problem)
            return self.resolve(ckpt_path)
        record = shown_path(str(PreemptedRun.path(Path(t.default_root_dir))))
        kept = shown_path(preempted.checkpoint)
        if problem == "missing":
            raise MisconfigurationError(
                f"The run in this folder was preempted{preempted.at()} ({record} records it), but its checkpoint "
                f"{kept} is gone. Either put the checkpoint back to resume it, or delete {record} to start afresh.")
        path = self.resolve(kept if ckpt_path is None else ckpt_path)
        if path is None or not preempted.is_checkpoint(path):
            raise MisconfigurationError(
                f"The run in this folder was preempted{preempted.at()} and its checkpoint {kept} waits to be resumed "
                f"({record} records it); ckpt_path={str(ckpt_path)!r} would start from "
                f"{'scratch' if path is None else path} and overwrite what that run wrote. Either resume it: run with "
                f"ckpt_path=None (or {kept!r}); or keep it and start anew: delete {record} (the checkpoint stays), "
                "or train in another folder (Trainer(default_root_dir=...)).")
        self._autoresumed = preempted if ckpt_path is None else None
        return path

    def started_from(self, path: Path | None) -> None:
        """Record (rank 0) the checkpoint this fit started from, where its restarted attempts may resume too."""
        if self._claim is not None and self.trainer.fabric.restart_count == 0:
            self._claim.resumed_from(path)

    def fit_done(self) -> None:
        """The fit ended well: the preempted run it resumed (or any preempted run recorded here) is done."""
        t = self.trainer
        if t.is_global_zero:
            PreemptedRun.remove(Path(t.default_root_dir))
        self._autoresumed = None

    def resume_after_restart(self) -> str | None:
        """On a restarted attempt: the newest state this run wrote (since its first attempt started), else the
        checkpoint it started from; None (and one line saying so) when there is neither. Every rank."""
        t = self.trainer
        newest: Path | None = None
        if t.is_global_zero:
            record = self._claim.record if self._claim is not None else None
            start = [record.resumed_from] if record is not None and record.resumed_from else []
            newest = self.newest_resumable(start, since=record.started if record is not None else 0.0)
        found: str | None = t.fabric.broadcast(str(newest) if newest is not None else None)
        gone = [str(d) for cb in t.callbacks if (d := getattr(cb, "snapshot_dirpath", None)) and not any(d.glob("*"))]
        if gone and t.is_global_zero:
            diagnostics.notice(f"No snapshot in {', '.join(gone)} (removed when the failed attempt's fit ended, or "
                               "this node's shared memory was cleared, or the node is another one): resuming from the "
                               f"disk checkpoint {found or '(none)'} instead.")
        if found is None and t.fabric.replica_groups is None:  # a replica group heals from a peer and says so
            where = ", ".join(str(d) for d in self.checkpoint_dirs())
            restarts.started_over(
                f"No checkpoint to resume from in {where}: training starts again from step 0 (add "
                "ModelCheckpoint(save_last=True, every_n_train_steps=...) or phalanx.callbacks.Snapshot so that a "
                "restart "
                "continues where the failed attempt was)", t.global_rank)
        return found

    def announce_resume(self, path: Path | None) -> None:
        """After a fit restored ``path`` (a rerun's ``ckpt_path``, or a restart's newest state), say where it
        resumed (one line, rank 0; on a restarted attempt with what failed before)."""
        t = self.trainer
        if path is not None:
            why = "" if self._autoresumed is None else (
                f": the run in this folder was preempted there "
                f"({shown_path(str(PreemptedRun.path(Path(t.default_root_dir))))}), and fit(ckpt_path=None) resumes it")
            restarts.resumed(path, t.global_step, t.current_epoch, t.global_rank, why)
