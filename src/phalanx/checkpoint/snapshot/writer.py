"""A rank's snapshots in shared memory: what it holds, copied where it outlives the process, with no collective
and no serialisation of the model's tensors, while the next step runs.

Each rank keeps ``keep`` slot files in node-local shared memory (:mod:`.slots`). A write is a :class:`~.copying.Job`:

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

* CPU tensors are copied into the slot by the background thread, in chunks. The optimizer's pre-step hook
  runs the chunks nobody has started itself (:mod:`.copying`: a busy machine never starves the step).
* CUDA tensors are copied on a side stream into pinned host memory (two staging buffers, so one snapshot's
  copy into the slot overlaps the next one's device copy). The optimizer's step waits for that copy on the
  device (a stream wait: the host never waits), and the background thread moves staging to the slot.

A tensor changed in place outside ``optimizer.step()`` while it was being copied is caught by its version
counter: that snapshot does not count, with a warning, and later ones are copied before the call returns.
A rank killed mid-copy loses that snapshot, never the previous one: at most one more step is recomputed.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import struct
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.protocol import MODULE, OPTIMIZER, STATEFUL
from phalanx.checkpoint.snapshot.copying import CHUNK, Copier, Job, Task, TornSnapshot, chunks
from phalanx.checkpoint.snapshot.format import Capture, LocalShard, Reader, Table, data_size, extend
from phalanx.checkpoint.snapshot.slots import HEADER_SIZE, VERSION, FolderClaim, Slot, data_name, read_header
from phalanx.checkpoint.state import sort_state
from phalanx.utils import diagnostics
from phalanx.utils.errors import CheckpointError

#: Below this many bytes of CPU tensors the copy is made before ``write`` returns: a background thread would
#: cost more in handing over than the copy itself (the copy releases the GIL; everything else holds it).
OVERLAP_BYTES = 1 << 20
_LENGTH = struct.Struct("<Q")  # the metadata starts with the length of its head (version, table, keys)


class _Staging:
    """Two pinned host buffers for device copies, each held by the job that moves it into a slot."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.holders: list[Job | None] = [None, None]
        self.order = [0, 1]  # least recently taken first
        self.stream: Any = None

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A free buffer of at least ``nbytes``. With both held, the least recently taken one's job is completed
        first: the calling thread does what is left of it."""
        free = [i for i in self.order if self.holders[i] is None or self.holders[i].finished]  # type: ignore[union-attr]
        index = free[0] if free else self.order[0]
        holder = self.holders[index]
        if holder is not None:
            holder.complete()
        self.order.remove(index)
        self.order.append(index)
        buffer = self.buffers[index]
        if buffer is None or buffer.numel() < nbytes:
            self.buffers[index] = None  # the old one goes before the new one is pinned
            buffer = self.buffers[index] = torch.empty(nbytes + max(1 << 16, nbytes >> 4), dtype=torch.uint8,
                                                       pin_memory=True)
        return index, buffer

    def hold(self, index: int, job: Job) -> None:
        self.holders[index] = job


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
        self._staging = _Staging()
        self._jobs: list[Job] = []  # not yet finished, oldest first
        self._hooks: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook's handle
        self._claim: FolderClaim | None = None
        #: Bytes of tensors in the last snapshot written, and per recent snapshot where its time went (seconds:
        #: ``capture`` on the calling thread, ``device`` copying to pinned memory, ``drain`` from there into the
        #: slot): a report for the benchmarks.
        self.last_bytes = 0
        self.timings: deque[dict[str, float]] = deque(maxlen=8)

    def _scan(self) -> None:
        """Adopt what an earlier attempt left: the next write goes to the slot with the oldest step, never
        over the one a restart resumed from."""
        self._claim = FolderClaim(self.folder, self.rank)  # refused while another run writes here
        for slot in self._slots:
            header = read_header(slot.path)
            slot.step = header.step if header is not None and header.world_size == self.world_size else -1
        self._scanned = True

    # ------------------------------------------------------------------ writing
    def write(self, step: int, state: dict[str, Any], extra: dict[str, Any],
              local_state: Callable[[str, Any, Any], Any]) -> None:
        """Snapshot this rank's ``state`` (modules and optimizers as ``local_state(kind, obj, module)`` gives
        them, objects with ``state_dict`` as it gives them, plain values as they are) and ``extra`` (plain)
        into the slot with the oldest step. Raises what made an earlier write fail."""
        began = time.perf_counter()
        for job in self._jobs:
            job.release()  # when no optimizer stepped since the last write
        self._drop_finished()
        if not self._scanned:
            self._scan()
        # Pickled on this thread: in another one it would hold the GIL this thread needs (no overlap, only switching).
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
        self.last_bytes = data_size(table)
        stable = self._stable(tensors, stable_spans)
        on_device = any(t.is_cuda for t in tensors)
        overlap = self.overlap and not self._torn and (on_device or sum(t.nbytes for t in tensors) >= OVERLAP_BYTES)
        if overlap and self._copier is None:
            self._copier = Copier()
        timing = {"bytes": float(self.last_bytes)}
        self.timings.append(timing)
        if on_device:
            job = self._device_job(step, body, table, tensors, stable, timing)
        elif overlap:
            job = self._host_job(step, body, table, tensors, stable)
        else:
            job = self._job(step, body, table, lambda slot: _copies(slot, tensors))
        self._jobs.append(job)
        if overlap:
            assert self._copier is not None
            self._copier.submit(job)
        else:
            self._settle()  # here and now: nothing to overlap
        timing["capture"] = time.perf_counter() - began

    @staticmethod
    def _stable(tensors: list[torch.Tensor], spans: list[tuple[Any, int, int]]) -> list[bool]:
        """Which tensors only an optimizer step changes (parameters and optimizer state, not module buffers)."""
        stable = [False] * len(tensors)
        for module, first, end in spans:
            buffers = {b.data_ptr() for b in module.buffers()} if module is not None else set()
            for i in range(first, end):
                stable[i] = tensors[i].data_ptr() not in buffers
        return stable

    def _job(self, step: int, body: bytes, table: Table, tasks: Callable[[Slot], list[Task]],
             release_check: Task | None = None, gate: Task | None = None, live: bool = True,
             timing: dict[str, float] | None = None) -> Job:
        """The job that writes ``step`` into the slot with the oldest step, chosen when it starts (after the
        job before it finished, so the newest complete snapshot is never the one overwritten)."""
        chosen: list[Slot] = []

        def start() -> list[Task]:
            slot = min(self._slots, key=lambda s: s.step)
            slot.invalidate()  # 1. the slot no longer vouches for its contents
            slot.prepare(table, len(body))
            chosen.append(slot)
            return tasks(slot)  # 2. the copies

        def finish() -> None:
            chosen[0].vouch(step, self.world_size, self.rank, body)  # 3. the metadata, then the header's first word
            if timing is not None and "drained_from" in timing:
                timing["drain"] = time.perf_counter() - timing.pop("drained_from")

        previous = self._jobs[-1] if self._jobs else None
        return Job(start, finish, release_check, gate, previous, self._copier, live)

    def _host_job(self, step: int, body: bytes, table: Table, tensors: list[torch.Tensor],
                  stable: list[bool]) -> Job:
        with torch.no_grad():
            sources = [t if keep else t.clone() for t, keep in zip(tensors, stable)]
        versions = [(t, t._version) for t, keep in zip(tensors, stable) if keep]
        return self._job(step, body, table, lambda slot: _copies(slot, sources),
                         release_check=lambda: _unchanged(versions, step))

    def _device_job(self, step: int, body: bytes, table: Table, tensors: list[torch.Tensor],
                    stable: list[bool], timing: dict[str, float]) -> Job:
        """Device tensors go to pinned staging on a side stream now; the job moves staging into the slot once
        that copy's event has completed. The next optimizer step waits for the event on the device."""
        nbytes = data_size(table)
        index, buffer = self._staging.take(nbytes)
        views, _ = extend(buffer, table, 0)
        staging = self._staging
        if staging.stream is None:
            staging.stream = torch.cuda.Stream()
        side, main = staging.stream, torch.cuda.current_stream()
        device_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        clones = []
        with torch.no_grad():
            for view, t, keep in zip(views, tensors, stable):
                if not t.is_cuda:
                    view.copy_(t)  # RNG states and counters: host memory, small
                elif keep:
                    device_pairs.append((view, t))
                else:
                    clone = t.clone()  # changes in the next forward: taken now, in stream order
                    clones.append(clone)
                    device_pairs.append((view, clone))
            side.wait_stream(main)
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(side)
            with torch.cuda.stream(side):
                if device_pairs:
                    torch._foreach_copy_([v for v, _ in device_pairs], [t for _, t in device_pairs], non_blocking=True)
        for clone in clones:
            clone.record_stream(side)  # not reused before the side stream has read it
        event = torch.cuda.Event(enable_timing=True)
        event.record(side)
        versions = [(t, t._version) for t, keep in zip(tensors, stable) if keep and t.is_cuda]

        def gate() -> None:  # before a thread moves staging into the slot
            event.synchronize()
            if "device" not in timing:
                timing["device"] = begin.elapsed_time(event) / 1e3
                timing["drained_from"] = time.perf_counter()

        def release_check() -> None:
            torch.cuda.current_stream().wait_event(event)  # the device waits, not the host
            _unchanged(versions, step)  # queued in place since the copy was: it may have read them

        def tasks(slot: Slot) -> list[Task]:
            return chunks(slot.data(nbytes), buffer[:nbytes])

        job = self._job(step, body, table, tasks, release_check, gate=gate, live=False, timing=timing)
        staging.hold(index, job)
        return job

    def _before_step(self, *_: Any) -> None:
        """An optimizer is about to change what unfinished copies read: each job's copy is done (the device's
        stream waits for a device copy; host copies are finished on this thread if need be) and checked.
        A failure is raised at the next write, not inside optimizer.step()."""
        for job in self._jobs:
            job.release()

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

    def _raise_failure(self, job: Job) -> None:
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
        if not keep_errors:
            self._drop_finished()

    def close(self, release: bool = True) -> None:
        """Finish the writes in flight and let go of the optimizers, the background thread and (``release``) the
        folder."""
        try:
            self.wait()
        finally:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
            if self._copier is not None:
                self._copier.stop()
                self._copier = None
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


def _unchanged(versions: list[tuple[torch.Tensor, int]], step: int) -> None:
    changed = next((i for i, (t, seen) in enumerate(versions) if t._version != seen), None)
    if changed is not None:
        raise TornSnapshot(f"a parameter or optimizer state (tensor {changed} of the snapshot of step {step}) was "
                           "changed in place outside optimizer.step() while it was being copied")


__all__ = ["CHUNK", "OVERLAP_BYTES", "RankSnapshots", "TornSnapshot"]
