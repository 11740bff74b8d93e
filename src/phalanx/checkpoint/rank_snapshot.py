"""Per-rank snapshots in shared memory: what each rank holds, copied where it outlives the process, with
no collective and no serialisation of the model's tensors.

A per-step snapshot written like a checkpoint (gather to rank 0, pickle, checksum, atomic file) cost
1.5-4x the step it protected (bench/survival.py), so nobody could afford to take one every step. Here
each rank keeps ``keep`` slot files in node-local shared memory (``/dev/shm``), mapped once and reused:
``[header | metadata | tensors]``. A write is memory copies only (no system call once mapped), in an
order that makes it safe against ``kill -9`` at any instruction:

1. the header's first word is cleared (the slot stops counting as a snapshot);
2. every tensor of the state (a DTensor's local shard: nothing is gathered) is copied into the slot, and
   the metadata (the structure and plain values, builtins only; :mod:`.snapshot_format`) beside it;
3. the header is written, its first word last.

A slot therefore holds a complete snapshot or none, and the other slot keeps the previous step while
one is rewritten. The header names the step, the rank and the number of ranks, so the newest step that
*every* rank completed is found by reading the headers (:mod:`phalanx.checkpoint.snapshots`): what a
restart resumes from, on every rank the same. Opening one runs no code (see :mod:`.snapshot_format`).

Restoring needs the same topology (the same strategy and number of ranks on the same node), which is
what a restart has; a run resumed elsewhere uses the disk checkpoints.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import pickle
import queue
import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.snapshot_format import Capture, LocalShard, Reader, Table, data_size, extend
from phalanx.checkpoint.state import MODULE, OPTIMIZER, STATEFUL, sort_state
from phalanx.utils import diagnostics
from phalanx.utils.errors import CheckpointError, MisconfigurationError

VERSION = 2  # 2: every tensor in the data region; the metadata is [head length | head | one pickle per entry]
#: Below this many bytes of tensors the copy is made before ``write`` returns: a background thread would
#: cost more in handing over than the copy itself (the copy releases the GIL; everything else holds it).
OVERLAP_BYTES = 1 << 20
DATA = re.compile(r"r(?P<rank>\d+)-k(?P<slot>\d+)\.data")
LOCK = re.compile(r"r(?P<rank>\d+)\.lock")
MAGIC = b"PHXSNAP1"  # the header's first word, written last: the slot vouches for its contents
_HEADER = struct.Struct("<8sqqqqqqd")  # magic, version, step, world size, rank, metadata length, data offset, time
_HEADER_SIZE = 64
_LENGTH = struct.Struct("<Q")  # the metadata starts with the length of its head (version, table, keys)
_PAGE = 4096


def data_name(rank: int, slot: int) -> str:
    return f"r{rank:05d}-k{slot}.data"


@dataclass(frozen=True)
class Header:
    """A complete slot: which step of which rank (of how many), and when its write finished."""

    step: int
    world_size: int
    rank: int
    meta_length: int
    data_offset: int
    finished: float


def read_header(path: Path) -> Header | None:
    """The header of the slot file ``path``, or None unless it holds a complete snapshot (no mapping)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_HEADER.size)
    except OSError:
        return None
    if len(raw) < _HEADER.size:
        return None
    magic, version, step, world, rank, length, offset, finished = _HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION or step < 0:
        return None
    return Header(step, world, rank, length, offset, finished)


class _Slot:
    """One file of node-local shared memory, mapped while this process writes to it:

    ``[header (64 bytes) | metadata (pickle) | tensors, each 64-byte aligned]``

    The header's first word (:data:`MAGIC`) is cleared before anything else of the slot is rewritten and
    written after everything else, so the file vouches for exactly what it holds. No system call is made
    once the slot is mapped: a write is memory copies only.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.buffer: torch.Tensor | None = None
        self.bytes: Any = None  # a NumPy view of the same memory, for the header and metadata
        self.views: list[torch.Tensor] = []
        self.table: Table = []
        self.ends: list[int] = []  # where each view ends in the file
        self.meta_room = self.data_offset = 0
        self.step = -1

    def prepare(self, table: Table, meta_length: int) -> None:
        """Map the file large enough for ``table`` and metadata of ``meta_length`` bytes; views of the tensors.
        The views of an unchanged leading part of the table are kept: the parameters and optimizer state come
        first and keep their shapes, while a metric accumulator near the end grows every step."""
        if self.buffer is not None and meta_length <= self.meta_room:
            if table == self.table:  # the usual case, compared in C
                return
            same = 0
            for now, before in zip(table, self.table):
                if now != before:
                    break
                same += 1
            start = self.ends[same - 1] if same else self.data_offset
            views, ends = extend(self.buffer, table[same:], start)
            if not ends or ends[-1] <= self.buffer.numel():
                self.views, self.ends = self.views[:same] + views, self.ends[:same] + ends
                self.table = list(table)
                return
        room = -(-(2 * meta_length + _PAGE) // _PAGE) * _PAGE  # grows rarely: the metadata barely changes
        data_offset = _HEADER_SIZE + room
        need = data_offset + data_size(table)
        size = need + max(1 << 16, need >> 4)  # room for accumulators that grow during an epoch
        if self.buffer is None or self.buffer.numel() < need:
            # Reserve the memory now (ENOSPC is an error here), not on the first copy (SIGBUS on a full tmpfs).
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < size:
                    os.posix_fallocate(fd, 0, size)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            self.buffer = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)
            self.bytes = memoryview(self.buffer.numpy())  # type: ignore[arg-type]  # bytes written: one memcpy each
        self.invalidate()
        self.views, self.ends = extend(self.buffer, table, data_offset)
        self.table, self.meta_room, self.data_offset = list(table), room, data_offset

    def invalidate(self) -> None:
        if self.bytes is not None:
            self.bytes[:8] = bytes(8)
        self.step = -1

    def vouch(self, step: int, world: int, rank: int, body: bytes) -> None:
        self.bytes[_HEADER_SIZE:_HEADER_SIZE + len(body)] = body
        header = _HEADER.pack(MAGIC, VERSION, step, world, rank, len(body), self.data_offset, time.time())
        self.bytes[8:_HEADER.size] = header[8:]
        self.bytes[:8] = MAGIC  # last
        self.step = step


class _Worker:
    """One daemon thread that runs one job at a time. (A ThreadPoolExecutor's future costs the training thread
    more than the copy of a small model it stands for.)"""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="phalanx-snapshot", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # The copy only needs cores the training leaves idle (while it waits in a collective, or between
        # steps): in the idle scheduling class, it never takes a core from a thread that wants one. It cannot
        # starve: an optimizer waiting for it sleeps, and the core it frees runs the copy.
        idle = getattr(os, "SCHED_IDLE", None)
        if idle is not None:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, idle, os.sched_param(0))  # pid 0: this thread only
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except BaseException as err:
                self._error = err
            finally:
                self._idle.set()

    def submit(self, job: Callable[[], None]) -> None:
        self._idle.clear()
        self._jobs.put(job)

    def result(self) -> None:
        """Wait for the job in flight; raise what it raised."""
        self._idle.wait()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


class FolderClaim:
    """This process's hold on one rank's snapshots in ``folder``, from its first snapshot until :meth:`release`.

    Two runs that snapshot into the same folder at the same time (two fits from one ``default_root_dir``, one
    Fabric script started twice in one directory) would overwrite each other's slots, delete them when one
    ends, and a restart of either could resume the other's state: another model, other settings, no error.
    The claim is an exclusive ``flock`` on ``r<rank>.lock``: the second run is refused at its first
    snapshot, naming the process that holds the folder. The kernel releases it when the holder ends,
    however it ends (``kill -9`` included), so a restarted attempt or a rerun claims it again at once.
    """

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = folder / f"r{rank:05d}.lock"
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)  # what a refused run names
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            who = (f"Another Trainer or Fabric of this process (pid {holder}), still running or never torn down,"
                   if holder == str(os.getpid()) else f"Another process (pid {holder})")
            raise MisconfigurationError(
                f"{who} is writing rank {rank}'s snapshots in {folder}: two runs are using one snapshot folder at "
                "the same time, and would overwrite each other's snapshots. Give each run its own folder: its own "
                "Trainer(default_root_dir=...) or Snapshot(dirpath=...), or for Fabric "
                "fabric.save_snapshot(..., directory=...)."
            ) from None
        except BaseException:  # the fd (and a lock taken) must not outlive a failed claim
            os.close(fd)
            raise
        self._fd: int | None = fd

    @classmethod
    def attempt(cls, folder: Path, rank: int) -> FolderClaim | None:
        """The claim, or None while another process holds it (or the folder does not exist)."""
        if not folder.is_dir():
            return None
        try:
            return cls(folder, rank)
        except MisconfigurationError:
            return None

    def release(self, remove: bool = False) -> None:
        """Let go of the folder (``remove``: delete the lock file first, while still holding it)."""
        if self._fd is None:
            return
        if remove:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        os.close(self._fd)
        self._fd = None


class TornSnapshot(RuntimeError):
    """A tensor copied in the background changed before its copy finished; that snapshot was not kept."""


class RankSnapshots:
    """This rank's snapshot slots in ``folder``: :meth:`write` one step, :meth:`read` one back.

    With ``overlap`` (the default) a write returns once the state is *captured*: the plain values and
    the skeleton, and a private copy of every tensor that can change before the next optimizer step
    (buffers, which a forward pass updates, metric accumulators, RNG states). The parameters and the
    optimizer's state change only in ``optimizer.step()``, so they are copied by a background thread while
    the next batch's forward and backward run, and every optimizer in the state waits for that copy
    before it steps (a step pre-hook). A tensor changed anyway meanwhile (in place, outside
    ``optimizer.step()``) is caught by its version counter: that snapshot is dropped, with a warning, and
    later ones are copied before ``write`` returns. A rank killed mid-copy loses that snapshot, never
    the previous one: at most one more step is recomputed.
    """

    def __init__(self, folder: Path, rank: int, world_size: int, keep: int = 2, overlap: bool = True) -> None:
        if keep < 1:
            raise ValueError("keep at least 1 snapshot")
        self.folder, self.rank, self.world_size = Path(folder), rank, world_size
        self.overlap = overlap  #: may change between writes
        self._torn = False  # a background copy was torn once: copy before returning from then on
        self._slots = [_Slot(self.folder / data_name(rank, k)) for k in range(keep)]
        self._scanned = False
        self._worker: _Worker | None = None
        self._pending = False
        self._error: BaseException | None = None  # from a write that failed in the background
        self._hooks: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook's handle
        self._claim: FolderClaim | None = None

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
        into the slot with the oldest step. Raises what made the previous background write fail."""
        self.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
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
        overlap = self.overlap and not self._torn and sum([t.nbytes for t in tensors]) >= OVERLAP_BYTES
        if overlap:
            # Parameters and optimizer state change only in optimizer.step(), which waits for the copy. The rest
            # (buffers, which a forward pass updates, metric states, RNG states) is copied now.
            stable = [False] * len(tensors)
            for module, first, end in stable_spans:
                buffers = {b.data_ptr() for b in module.buffers()} if module is not None else set()
                for i in range(first, end):
                    stable[i] = tensors[i].data_ptr() not in buffers
            with torch.no_grad():
                sources = [t if keep else t.clone() for t, keep in zip(tensors, stable)]
            versions = [(t, t._version) for t, keep in zip(tensors, stable) if keep]
        else:
            sources, versions = tensors, []
        if overlap:
            if self._worker is None:
                self._worker = _Worker()
            self._worker.submit(lambda: self._commit(step, body, table, sources, versions))
            self._pending = True
        else:
            self._commit(step, body, table, sources, versions)

    def _commit(self, step: int, body: bytes, table: Table, sources: list[torch.Tensor],
                versions: list[tuple[torch.Tensor, int]]) -> None:
        slot = min(self._slots, key=lambda s: s.step)
        slot.invalidate()  # 1. the slot no longer vouches for its contents
        slot.prepare(table, len(body))
        if sources:  # 2. copy
            with torch.no_grad():
                torch._foreach_copy_(slot.views, sources)
        changed = next((i for i, (t, seen) in enumerate(versions) if t._version != seen), None)
        if changed is not None:
            raise TornSnapshot(f"a parameter or optimizer state (tensor {changed} of the snapshot of step {step}) "
                               "was changed in place outside optimizer.step() while it was being copied")
        slot.vouch(step, self.world_size, self.rank, body)  # 3. the metadata, then the header's first word

    def _before_step(self, *_: Any) -> None:
        self.wait(keep_errors=True)  # an error surfaces at the next write, not inside optimizer.step()

    def wait(self, keep_errors: bool = False) -> None:
        """Until the write in flight is complete (or has failed)."""
        if not self._pending or self._worker is None:
            return
        self._pending = False
        try:
            self._worker.result()
        except TornSnapshot as err:
            self._torn = True
            diagnostics.warn(f"Rank {self.rank}'s snapshot was dropped: {err}. Snapshots in {self.folder} are "
                             "copied before the call returns from now on.", rank=self.rank)
        except BaseException as err:
            if not keep_errors:
                raise
            self._error = err

    def close(self, release: bool = True) -> None:
        """Finish the write in flight and let go of the optimizers, the worker thread and (``release``) the
        folder."""
        try:
            self.wait()
        finally:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
            if self._worker is not None:
                self._worker.stop()
                self._worker = None
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
        raw = io.BytesIO(buffer[_HEADER_SIZE:_HEADER_SIZE + header.meta_length].numpy().tobytes())
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
        """Finish the write in flight, then delete this rank's files (rank 0: also those of ranks beyond this
        job's); the last rank to leave removes the folder. Nothing is deleted while another run holds this
        rank's part of the folder. No collective: no rank waits for another."""
        try:
            self.close(release=False)  # the folder stays claimed while its files go
        finally:
            claim = self._claim or FolderClaim.attempt(self.folder, self.rank)
            self._claim = None
            if claim is not None:
                for entry in list(self.folder.iterdir()):
                    m = DATA.fullmatch(entry.name) or LOCK.fullmatch(entry.name)
                    if m is None:
                        continue
                    rank = int(m["rank"])  # this rank's lock file goes with its claim, below
                    if (rank == self.rank and m.re is DATA) or (self.rank == 0 and rank >= self.world_size):
                        with contextlib.suppress(FileNotFoundError):
                            entry.unlink()
                claim.release(remove=True)
            with contextlib.suppress(OSError):  # not empty: another rank is still writing; it removes it
                self.folder.rmdir()
