"""A rank's snapshots in shared memory: what it holds, copied where it outlives the process, with no collective
and no serialisation of the model's tensors, while the next step runs.

Each rank keeps ``keep`` slot files in node-local shared memory (:mod:`.slots`). A write:

1. the slot with the oldest step stops counting (its header's first word is cleared);
2. every tensor of the state (a DTensor's local shard: nothing is gathered) is copied into the slot;
3. the metadata (the structure and plain values, builtins only; :mod:`.format`), then the header, its first
   word last: the slot counts again.

A slot therefore holds a complete snapshot or none, and the other slot keeps the previous step while one is
rewritten. The header names the step, the rank and the number of ranks, so the newest step that *every*
rank completed is found by reading the headers (:func:`phalanx.checkpoint.snapshot.complete_steps`): what a
restart resumes from, on every rank the same.

What the copy may overlap: the parameters and the optimizer's state change only in ``optimizer.step()``, so
they are copied while the next batch runs forward and backward, and every optimizer in the state waits for
their copy before it steps (a step pre-hook). The rest (buffers, which a forward pass updates, metric
accumulators, RNG states) is copied, or cloned, before :meth:`RankSnapshots.write` returns.

* Device tensors are copied by the device's copy engine straight into the slot, registered with CUDA as
  pinned memory, on a side stream; the optimizer's step waits for that copy on the device (a stream wait:
  the host never waits), and the commit (3.) is queued behind it (:mod:`.device`). Where the slot cannot be
  registered, they go to pinned staging memory first and the background thread moves them into the slot.
* Host tensors are copied into the slot by the background thread, in chunks (:mod:`.copying`). The
  optimizer's pre-step hook runs the chunks nobody has started itself: a busy machine never starves the step.

Before the first snapshot under "auto" the slots are set up in the background (:meth:`RankSnapshots.prepare`:
mapped, their pages allocated, on a device registered), so that no snapshot pays for that. Each write
returns its :class:`~.cadence.Cost`, filled in as it becomes known (:meth:`RankSnapshots.poll`).

A tensor changed in place outside ``optimizer.step()`` while it was being copied is caught by its version
counter: that snapshot does not count, with a warning, and later ones are copied before the call returns.
A rank killed mid-copy loses that snapshot, never the previous one: at most one more step is recomputed.
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.protocol import MODULE, OPTIMIZER, STATEFUL
from phalanx.checkpoint.snapshot import device
from phalanx.checkpoint.snapshot.cadence import Cost
from phalanx.checkpoint.snapshot.copying import CHUNK, Copier, SlotWrite, Task, TornSnapshot, chunks, unchanged
from phalanx.checkpoint.snapshot.format import Capture, LocalShard, Reader, Table, data_size, extend
from phalanx.checkpoint.snapshot.slots import HEADER_SIZE, VERSION, FolderClaim, Slot, data_name, read_header
from phalanx.checkpoint.state import sort_state
from phalanx.utils import diagnostics
from phalanx.utils.errors import CheckpointError

#: Below this many bytes of CPU tensors the copy is made before ``write`` returns: a background thread would
#: cost more in handing over than the copy itself (the copy releases the GIL; everything else holds it).
OVERLAP_BYTES = 1 << 20
_LENGTH = struct.Struct("<Q")  # the metadata starts with the length of its head (version, table, keys)

Pending = SlotWrite | device.OneCopy  # a write in flight


class RankSnapshots:
    """This rank's snapshot slots in ``folder``: :meth:`write` one step, :meth:`read` one back.

    ``overlap``: copy while the next step runs (see the module docstring); otherwise every copy is complete
    when :meth:`write` returns."""

    def __init__(self, folder: Path, rank: int, world_size: int, keep: int = 2, overlap: bool = True) -> None:
        if keep < 1:
            raise ValueError("keep at least 1 snapshot")
        self.folder, self.rank, self.world_size = Path(folder), rank, world_size
        self.overlap = overlap  #: may change between writes
        self._torn = False  # a copy was torn once: copy before returning from then on
        self._slots = [Slot(self.folder / data_name(rank, k)) for k in range(keep)]
        self._scanned = False
        self._copier: Copier | None = None
        self._engine: device.Engine | None = None  # the device's, for a state that lives on one
        self._host_state = False  # the state was found to live on the host
        self._refused: str | None = None  # why the slots are not registered with the device (two copies then)
        self._said_refused = False
        self._staging = device.Staging()
        self._setup: SlotWrite | None = None
        self._jobs: list[Pending] = []  # not yet finished, oldest first
        self._unmeasured: list[tuple[Cost, Callable[[], bool]]] = []
        self._hooks: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook's handle
        self._claim: FolderClaim | None = None
        #: Bytes of tensors in the last snapshot written (for the benchmarks).
        self.last_bytes = 0
        #: Seconds spent setting the slots up (mapping, allocating, registering), on whichever thread did it.
        self.setup_seconds = 0.0

    @property
    def path(self) -> str:
        """How snapshots are copied: "one copy" (the device into a registered slot), "two copies" (the device
        into pinned staging, then into the slot), "host" (memory copies), or "" before the first."""
        if self._engine is None:
            return "host" if self._host_state else ""
        return "two copies" if self._refused is not None else "one copy"

    def _scan(self) -> None:
        """Adopt what an earlier attempt left: the next write goes to the slot with the oldest step, never
        over the one a restart resumed from."""
        self._claim = FolderClaim(self.folder, self.rank)  # refused while another run writes here
        for slot in self._slots:
            header = read_header(slot.path)
            slot.step = header.step if header is not None and header.world_size == self.world_size else -1
        self._scanned = True

    def _engine_of(self, tensors: list[torch.Tensor]) -> device.Engine | None:
        if self._engine is None and not self._host_state:
            self._engine = device.engine_for(tensors)
            self._host_state = self._engine is None
        return self._engine

    def _capture(self, state: dict[str, Any], extra: dict[str, Any], local_state: Callable[[str, Any, Any], Any]
                 ) -> tuple[list[torch.Tensor], Table, bytes, list[bool]]:
        """The state's tensors, their table, the metadata, and which tensors only an optimizer step changes.
        Pickled on this thread: in another one it would hold the GIL this thread needs (no overlap, only
        switching)."""
        out = io.BytesIO()
        capture = Capture(out)
        keys: list[str] = []
        stable_spans: list[tuple[Any, int, int]] = []  # (module or None, first, end): changed only by a step
        for e in sort_state(state):
            start = len(capture.tensors)
            if e.kind in (MODULE, OPTIMIZER):
                capture.dump(local_state(e.kind, e.obj, e.module))
                stable_spans.append((e.obj if e.kind == MODULE else None, start, len(capture.tensors)))
                if e.kind == OPTIMIZER and id(e.obj) not in self._hooks:
                    self._hooks[id(e.obj)] = e.obj.register_step_pre_hook(self._before_step)
            else:
                capture.dump(e.obj.state_dict() if e.kind == STATEFUL else e.obj)
            keys.append(e.key)
        capture.dump(extra)
        tensors, table = capture.tensors, capture.table
        head = pickle.dumps({"version": VERSION, "table": table, "keys": keys}, protocol=pickle.HIGHEST_PROTOCOL)
        body = _LENGTH.pack(len(head)) + head + out.getvalue()
        return tensors, table, body, self._stable(tensors, stable_spans)

    @staticmethod
    def _stable(tensors: list[torch.Tensor], spans: list[tuple[Any, int, int]]) -> list[bool]:
        """Which tensors only an optimizer step changes (parameters and optimizer state, not module buffers)."""
        stable = [False] * len(tensors)
        for module, first, end in spans:
            buffers = {b.data_ptr() for b in module.buffers()} if module is not None else set()
            for i in range(first, end):
                stable[i] = tensors[i].data_ptr() not in buffers
        return stable

    # ------------------------------------------------------------------ setting up
    def prepare(self, state: dict[str, Any], extra: dict[str, Any],
                local_state: Callable[[str, Any, Any], Any]) -> None:
        """Set every slot up for this state before the first snapshot: map it, allocate its pages and, on a
        device, register it, in the background wherever the copies run there (a device state; a host state of
        :data:`OVERLAP_BYTES` or more), so that no snapshot pays for it. :meth:`ready` says when it is done."""
        if self._setup is not None:
            return
        if not self._scanned:
            self._scan()
        tensors, table, body, _ = self._capture(state, extra, local_state)
        engine = self._engine_of(tensors)
        background = engine is not None or (self.overlap and data_size(table) >= OVERLAP_BYTES)

        def set_up(slot: Slot) -> None:
            began = time.perf_counter()
            if not slot.fits(table, len(body)):
                self._map(slot, slot.size_for(table, len(body)))
            self.setup_seconds += time.perf_counter() - began

        def finish() -> None:
            if self._refused is not None:  # all or none: the two-copy path writes any slot
                for slot in self._slots:
                    slot.unpin()

        copier = self._background() if background else None
        job = self._setup = SlotWrite(lambda: [functools.partial(set_up, s) for s in self._slots], finish,
                                      copier=copier, live=False)
        job.release()  # it copies nothing that changes: it finishes once its tasks have run
        if copier is not None:
            copier.submit(job)
        else:
            job.complete()

    def ready(self, insist: bool = False) -> bool:
        """Whether the slots are set up (:meth:`prepare`); ``insist``: finish setting them up on this thread first
        (what nobody started; a background thread that holds a part leaves the idle class meanwhile)."""
        job = self._setup
        if job is not None and insist:
            job.complete()
        return job is None or job.finished

    def _map(self, slot: Slot, size: int) -> None:
        """Map ``slot`` at ``size`` bytes, registered with the device where its state lives (unless refused)."""
        engine = self._engine
        try:
            slot.map(size, engine.pin if engine is not None and self._refused is None else None)
        except device.Refused as refused:  # mapped, not registered
            self._refused = str(refused)

    def _background(self) -> Copier:
        if self._copier is None:
            self._copier = Copier()
        return self._copier

    # ------------------------------------------------------------------ writing
    def write(self, step: int, state: dict[str, Any], extra: dict[str, Any],
              local_state: Callable[[str, Any, Any], Any]) -> Cost:
        """Snapshot this rank's ``state`` (modules and optimizers as ``local_state(kind, obj, module)`` gives
        them, objects with ``state_dict`` as it gives them, plain values as they are) and ``extra`` (plain)
        into the slot with the oldest step. Returns what it costs (filled in as the copy goes: :meth:`poll`).
        Raises what made an earlier write, or the setup, fail."""
        began = time.perf_counter()
        called = self._engine.stamp() if self._engine is not None else None  # what the device does meanwhile
        for job in self._jobs:
            job.release()  # when no optimizer stepped since the last write
            self._charge(job)
        self._drop_finished()
        setup = self._setup
        if setup is not None and not setup.finished:
            setup.complete()
        if setup is not None and setup.error is not None:
            raise setup.error
        if not self._scanned:
            self._scan()
        tensors, table, body, stable = self._capture(state, extra, local_state)
        cost = Cost(nbytes=data_size(table))
        self.last_bytes = cost.nbytes
        engine = self._engine_of(tensors)
        if engine is not None:
            cost.device = True
            self._device_write(engine, step, body, table, tensors, stable, cost, began, called)
            return cost
        overlap = self.overlap and not self._torn and sum(t.nbytes for t in tensors) >= OVERLAP_BYTES
        if overlap:
            self._background()  # before the job: whoever waits for it must be able to take the thread out of idle
            job = self._host_job(step, body, table, tensors, stable, cost, began)
        else:
            job = self._job(step, body, table, lambda slot: _copies(slot, tensors), cost, began)
        self._track(job, cost)
        if overlap:
            self._background().submit(job)
        else:
            self._settle()  # here and now: nothing to overlap
        return cost

    def _track(self, job: Pending, cost: Cost, measure: Callable[[], bool] | None = None) -> None:
        job.cost = cost
        self._jobs.append(job)
        self._unmeasured.append((cost, measure or functools.partial(_measured, job, cost)))

    def _job(self, step: int, body: bytes, table: Table, tasks: Callable[[Slot], list[Task]], cost: Cost,
             began: float, release_check: Task | None = None, gate: Task | None = None, live: bool = True) -> SlotWrite:
        """The job that writes ``step`` into the slot with the oldest step, chosen when it starts (after the
        job before it finished, so the newest complete snapshot is never the one overwritten)."""
        chosen: list[Slot] = []

        def start() -> list[Task]:
            slot = min(self._slots, key=lambda s: s.step)
            slot.invalidate()  # 1. the slot no longer vouches for its contents
            if slot.prepare(table, len(body)):
                cost.one_time = True  # this slot's first snapshot: mapping it, its pages
            chosen.append(slot)
            return tasks(slot)  # 2. the copies

        def finish() -> None:
            chosen[0].vouch(step, self.world_size, self.rank, body)  # 3. the metadata, then the header's first word
            copied = job.copied_at
            cost.copy = (copied if copied is not None else time.perf_counter()) - began  # not waiting for a release

        previous = self._jobs[-1] if self._jobs else None
        assert not isinstance(previous, device.OneCopy)  # settled before the first two-copy write
        job = SlotWrite(start, finish, release_check, gate, previous, self._copier, live)
        return job

    def _host_job(self, step: int, body: bytes, table: Table, tensors: list[torch.Tensor], stable: list[bool],
                  cost: Cost, began: float) -> SlotWrite:
        with torch.no_grad():
            sources = [t if keep else t.clone() for t, keep in zip(tensors, stable)]
        versions = [(t, t._version) for t, keep in zip(tensors, stable) if keep]
        return self._job(step, body, table, lambda slot: _copies(slot, sources), cost, began,
                         release_check=lambda: unchanged(versions, step), live=True)

    def _device_write(self, engine: device.Engine, step: int, body: bytes, table: Table,
                      tensors: list[torch.Tensor], stable: list[bool], cost: Cost, began: float, called: Any) -> None:
        slot = min(self._slots, key=lambda s: s.step)
        if self._refused is None and not slot.fits(table, len(body)):
            for job in self._jobs:  # no copy may be writing the mapping that goes (a host wait, once per mapping)
                if isinstance(job, device.OneCopy) and job.slot is slot:
                    job.complete()
            self._map(slot, slot.size_for(table, len(body)))
            cost.one_time = True
        if self._refused is not None:
            self._staged_write(engine, step, body, table, tensors, stable, cost, began, called)
            return
        slot.prepare(table, len(body))  # fits: views only, nothing written
        sources: list[tuple[int, torch.Tensor]] = []
        with torch.no_grad():
            for i, (t, keep) in enumerate(zip(tensors, stable)):
                sources.append((i, t if keep or not engine.on_device(t) else engine.keep(t)))
        versions = [(t, t._version) for t, keep in zip(tensors, stable) if keep and engine.on_device(t)]
        job = device.OneCopy(engine, slot, step, self.world_size, self.rank, body, sources, versions, cost, called)
        self._track(job, cost, job.measure)
        if not self.overlap:
            job.complete()  # in the slot when the call returns (a host wait, as asked)
            self._drop_finished()
        elif self._torn:
            job.release()  # copied before anything queued after the call can change it (on the device)

    def _staged_write(self, engine: device.Engine, step: int, body: bytes, table: Table,
                      tensors: list[torch.Tensor], stable: list[bool], cost: Cost, began: float, called: Any) -> None:
        """Two copies: the device into pinned staging on the side stream now; the background thread moves
        staging into the slot once that copy's event has completed. The next optimizer step waits for the
        event on the device."""
        if not self._said_refused:
            self._said_refused = True
            diagnostics.warn(f"Snapshots in {self.folder} take two copies on rank {self.rank} (the device into "
                             f"pinned staging memory, then a thread into shared memory), not one: {self._refused}. "
                             "They cost more and may come less often; the copy is as safe.")
            if any(slot.pinned for slot in self._slots):  # all or none: every slot takes this path from now on
                self._settle()
                for slot in self._slots:
                    slot.unpin()
        overlap = self.overlap and not self._torn
        if overlap:
            self._background()
        nbytes = data_size(table)
        index, buffer, allocated = self._staging.take(nbytes, engine)
        cost.one_time = cost.one_time or allocated
        views, _ = extend(buffer, table, 0)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for view, t, keep in zip(views, tensors, stable):
                if not engine.on_device(t):
                    view.copy_(t)  # RNG states and counters: host memory, small
                else:
                    pairs.append((view, t if keep else engine.keep(t)))
        engine.begin()
        engine.copy([v for v, _ in pairs], [t for _, t in pairs])
        event, returned = engine.mark(), engine.stamp()
        versions = [(t, t._version) for t, keep in zip(tensors, stable) if keep and engine.on_device(t)]
        waits: list[tuple[Any, Any]] = []

        def release_check() -> None:
            waits.append(engine.hold(event))  # the device waits, not the host
            unchanged(versions, step)  # queued in place since the copy was: it may have read them

        job = self._job(step, body, table, lambda slot: chunks(slot.data(nbytes), buffer[:nbytes]), cost, began,
                        release_check, gate=functools.partial(engine.synchronize, event), live=False)
        self._staging.hold(index, job)

        def measure() -> bool:  # holds ``pairs`` until then: a temporary source is not reused before it is read
            if not job.finished:
                return False
            if waits and engine.query(waits[0][1]):
                cost.device_wait = engine.seconds(*waits[0])
                if called is not None:
                    cost.call_on_device = engine.seconds(called, returned)
            elif job.error is None:
                return False
            pairs.clear()
            return _measured(job, cost)

        self._track(job, cost, measure)
        if overlap:
            self._background().submit(job)
        else:
            self._settle()

    def poll(self) -> None:
        """Fill in the costs of the writes that have completed since (asks the device; never waits)."""
        waiting = []
        for cost, measured in self._unmeasured:
            if measured():
                cost.final = True
            else:
                waiting.append((cost, measured))
        self._unmeasured = waiting

    def _before_step(self, *_: Any) -> None:
        """An optimizer is about to change what unfinished copies read: each job's copy is done (the device's
        stream waits for a device copy; host copies are finished on this thread if need be) and checked.
        A failure is raised at the next write, not inside optimizer.step()."""
        for job in self._jobs:
            began = time.perf_counter()
            job.release()
            job.cost.host_wait += time.perf_counter() - began  # type: ignore[union-attr]
            self._charge(job)

    def _charge(self, job: Pending) -> None:
        """Add to ``job``'s cost what the background thread spent on it at normal priority meanwhile."""
        if self._copier is not None and job.cost is not None:
            job.cost.cpu += self._copier.charge()

    def _drop_finished(self) -> None:
        """Forget the finished jobs, raising what made one fail (a torn one: a warning)."""
        done = [job for job in self._jobs if job.finished]
        self._jobs = [job for job in self._jobs if not job.finished]
        for job in done:
            self._raise_failure(job)

    def _settle(self) -> None:
        """Finish every job in flight (on this thread, what nobody has started) and raise what made one fail."""
        for job in list(self._jobs):
            job.complete()
        self._drop_finished()

    def _raise_failure(self, job: Pending) -> None:
        error = job.error
        if error is None:
            return
        if isinstance(error, TornSnapshot):
            self._torn = True
            diagnostics.warn(f"Rank {self.rank}'s snapshot was dropped: {error}. Snapshots in {self.folder} are "
                             "copied before the call returns from now on.", rank=self.rank)
            return
        raise error

    def wait(self, keep_errors: bool = False) -> None:
        """Until every write in flight is complete or has failed; a failure is raised (``keep_errors``: at the
        next write instead)."""
        for job in self._jobs:
            job.release()
        for job in self._jobs:
            job.complete()
        if self._setup is not None:
            self._setup.complete()
        self.poll()
        if not keep_errors:
            self._drop_finished()

    def close(self, release: bool = True) -> None:
        """Finish the writes in flight and let go of the optimizers, the background thread, the slots' mappings
        (unregistered from the device first) and (``release``) the folder."""
        try:
            self.wait()
        finally:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
            if self._copier is not None:
                self._copier.stop()
                self._copier = None
            for slot in self._slots:
                slot.release()
            if self._claim is not None and release:
                self._claim.release()
                self._claim = None

    # ------------------------------------------------------------------ reading
    def read(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's ``(state, extra)`` of ``step``: tensors in memory of their own (the slot will be
        rewritten), a DTensor's shard as a :class:`LocalShard`."""
        found = [(slot, h) for slot in self._slots if (h := read_header(slot.path)) is not None and h.step == step]
        if not found:
            raise CheckpointError(f"Rank {self.rank} has no complete snapshot of step {step} in {self.folder} (its "
                                  "shared memory was cleared, or the snapshot was being rewritten).")
        slot, header = found[0]
        if header.world_size != self.world_size:
            raise CheckpointError(
                f"The snapshot of step {step} in {self.folder} was written by {header.world_size} ranks and this job "
                f"has {self.world_size}: a snapshot resumes the same topology only. Resume from a disk checkpoint.")
        size = slot.path.stat().st_size
        buffer = torch.from_file(str(slot.path), shared=False, size=size, dtype=torch.uint8)
        raw = io.BytesIO(buffer[HEADER_SIZE:HEADER_SIZE + header.meta_length].numpy().tobytes())
        try:
            (length,) = _LENGTH.unpack(raw.read(_LENGTH.size))
            head = Reader(io.BytesIO(raw.read(length))).load()
            table = head["table"]
            if header.data_offset + data_size(table) > size:
                raise CheckpointError(f"The snapshot {slot.path} is shorter than its metadata says.")
            reader = Reader(raw)
            reader.values = [LocalShard(view.clone()) if sharded else view.clone()
                             for (_, _, sharded), view in zip(table, extend(buffer, table, header.data_offset)[0],
                                                             strict=True)]
            state = {key: reader.load() for key in head["keys"]}
            extra = reader.load()
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"The snapshot metadata in {slot.path} cannot be read: {err}") from err
        return state, extra

    # ------------------------------------------------------------------ cleaning up
    def remove(self) -> None:
        """Finish the writes in flight, then delete this rank's files (rank 0: also those of ranks beyond this
        job's); the last rank to leave removes the folder. Nothing is deleted while another run holds this
        rank's part of the folder. No collective: no rank waits for another."""
        try:
            self.close(release=False)  # the folder stays claimed while its files go
        finally:
            claim = self._claim or FolderClaim.attempt(self.folder, self.rank)
            self._claim = None
            if claim is not None:
                claim.remove_files(self.rank, self.world_size)
            with contextlib.suppress(OSError):  # not empty: another rank is still writing; it removes it
                self.folder.rmdir()


def _copies(slot: Slot, sources: list[torch.Tensor]) -> list[Task]:
    return [task for view, source in zip(slot.views, sources) for task in chunks(view, source)]


def _measured(job: Pending, cost: Cost) -> bool:
    """A host job's cost is known once it has finished (its finish timed the copy)."""
    if not job.finished:
        return False
    cost.failed = job.error is not None
    return True


__all__ = ["CHUNK", "OVERLAP_BYTES", "RankSnapshots", "TornSnapshot"]
