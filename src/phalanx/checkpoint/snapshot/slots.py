"""The files of per-rank snapshots in node-local shared memory: one slot file per snapshot kept, its header,
and a rank's claim on the folder (see :mod:`phalanx.checkpoint.snapshot`).

A slot is ``[header | metadata | tensors]``, mapped once and reused. Its header's first word is cleared before
anything else of the slot is rewritten and written after everything else, so a slot holds a complete snapshot
or none, whatever instruction a ``kill -9`` lands on.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import struct
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.snapshot.format import Table, data_size, extend
from phalanx.utils.errors import MisconfigurationError

VERSION = 2  # 2: every tensor in the data region; the metadata is [head length | head | one pickle per entry]
DATA = re.compile(r"r(?P<rank>\d+)-k(?P<slot>\d+)\.data")
LOCK = re.compile(r"r(?P<rank>\d+)\.lock")
MAGIC = b"PHXSNAP1"  # the header's first word, written last: the slot vouches for its contents
_HEADER = struct.Struct("<8sqqqqqqd")  # magic, version, step, world size, rank, metadata length, data offset, time
HEADER_SIZE = 64
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


#: Registers a slot's mapping with the device as pinned memory; returns what undoes it (:mod:`.device`).
Pin = Callable[[torch.Tensor], Callable[[], None]]
#: madvise(MADV_POPULATE_WRITE), Linux 5.14+: the pages are allocated now, not at the first copy's faults.
_POPULATE_WRITE = 23


class Slot:
    """One file of node-local shared memory, mapped while this process writes to it:

    ``[header (64 bytes) | metadata (pickle) | tensors, each 64-byte aligned]``

    The header's first word (:data:`MAGIC`) is cleared before anything else of the slot is rewritten and
    written after everything else, so the file vouches for exactly what it holds. No system call is made
    once the slot is mapped: a write is memory copies only. A mapping may be registered with a device
    (:meth:`map`'s ``pin``), so that the device's copy engine writes into it directly; it is unregistered
    before it is unmapped, whatever ends the process's use of it (:meth:`release`, a larger mapping, exit).
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
        self._unpin: weakref.finalize[Any, Slot] | None = None

    @property
    def pinned(self) -> bool:
        return self._unpin is not None and self._unpin.alive

    @staticmethod
    def _sizes(table: Table, meta_length: int) -> tuple[int, int]:
        """(metadata room, bytes needed) of a fresh layout of ``table`` after ``meta_length`` bytes of metadata."""
        room = -(-(2 * meta_length + _PAGE) // _PAGE) * _PAGE  # grows rarely: the metadata barely changes
        return room, HEADER_SIZE + room + data_size(table)

    def size_for(self, table: Table, meta_length: int) -> int:
        """The bytes to map for ``table``: what it needs and room for accumulators that grow during an epoch."""
        need = self._sizes(table, meta_length)[1]
        return need + max(1 << 16, need >> 4)

    def fits(self, table: Table, meta_length: int) -> bool:
        """Whether :meth:`prepare` can lay ``table`` out without mapping the file again."""
        if self.buffer is None:
            return False
        if meta_length <= self.meta_room and (table == self.table or
                                              self.data_offset + data_size(table) <= self.buffer.numel()):
            return True  # a kept prefix extends to the offsets a fresh layout from data_offset has
        return self._sizes(table, meta_length)[1] <= self.buffer.numel()

    def map(self, size: int, pin: Pin | None = None) -> None:
        """Map the file at ``size`` bytes at least (the memory reserved now: ENOSPC here, not SIGBUS at the first
        copy), its pages allocated; with ``pin``, registered with the device. The header is left as it is: the
        file may hold the snapshot a restart resumed from. No copy may be writing the current mapping."""
        self.release()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.posix_fallocate(fd, 0, size)
            mapped = mmap.mmap(fd, os.fstat(fd).st_size)  # shared, read and write
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(mapped, dtype=torch.uint8)  # the tensor keeps the mapping alive
        self.bytes = memoryview(mapped)  # bytes written: one memcpy each
        if pin is not None:  # registering allocates the pages too
            self._unpin = weakref.finalize(self, pin(self.buffer))  # before the mapping goes, even at exit
        else:
            with contextlib.suppress(OSError, ValueError):  # an older kernel: the first copy faults them in
                mapped.madvise(_POPULATE_WRITE)

    def unpin(self) -> None:
        """Unregister the mapping from the device (no copy may be writing it)."""
        if self._unpin is not None:
            self._unpin()
            self._unpin = None

    def release(self) -> None:
        """Let go of the mapping (unregistered first); the file stays as it is."""
        self.unpin()
        self.buffer = self.bytes = None
        self.views, self.table, self.ends = [], [], []
        self.meta_room = self.data_offset = 0

    def prepare(self, table: Table, meta_length: int, pin: Pin | None = None) -> bool:
        """Views of the tensors for ``table`` after metadata of ``meta_length`` bytes, mapping the file (larger)
        first if need be; returns whether it did (a one-time cost), after which the slot no longer vouches for
        its old contents. The views of an unchanged leading part of the table are kept: the parameters and
        optimizer state come first and keep their shapes, while a metric accumulator near the end grows."""
        if self.buffer is not None and meta_length <= self.meta_room:
            if table == self.table:  # the usual case, compared in C
                return False
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
                return False
        room, need = self._sizes(table, meta_length)
        mapped = self.buffer is None or self.buffer.numel() < need
        if mapped:
            self.map(self.size_for(table, meta_length), pin)
            self.invalidate()
        assert self.buffer is not None
        self.views, self.ends = extend(self.buffer, table, HEADER_SIZE + room)
        self.table, self.meta_room, self.data_offset = list(table), room, HEADER_SIZE + room
        return mapped

    def data(self, size: int) -> torch.Tensor:
        """The first ``size`` bytes of the data region, as laid out by :meth:`prepare` (one memory copy fills it
        from a buffer laid out by :func:`~phalanx.checkpoint.snapshot.format.extend` from 0: every tensor
        starts 64-byte aligned in both, and the data region starts aligned)."""
        assert self.buffer is not None
        return self.buffer[self.data_offset:self.data_offset + size]

    def region(self, start: int, end: int) -> torch.Tensor:
        """Bytes ``start:end`` of the file (the header word is ``0:8``, the rest of the header ``8:64``)."""
        assert self.buffer is not None
        return self.buffer[start:end]

    def invalidate(self) -> None:
        if self.bytes is not None:
            self.bytes[:8] = bytes(8)
        self.step = -1

    def vouch(self, step: int, world: int, rank: int, body: bytes) -> None:
        self.bytes[HEADER_SIZE:HEADER_SIZE + len(body)] = body
        self.bytes[8:_HEADER.size] = header_tail(step, world, rank, len(body), self.data_offset)
        self.bytes[:8] = MAGIC  # last
        self.step = step


def header_tail(step: int, world: int, rank: int, meta_length: int, data_offset: int) -> bytes:
    """The header after its first word (written before it)."""
    return _HEADER.pack(MAGIC, VERSION, step, world, rank, meta_length, data_offset, time.time())[8:]


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

    def remove_files(self, rank: int, world_size: int) -> None:
        """Delete this rank's slot files (rank 0: also those of ranks beyond ``world_size``, left by a larger
        earlier run), then let go of the folder, deleting this rank's lock file."""
        for entry in list(self.path.parent.iterdir()):
            m = DATA.fullmatch(entry.name) or LOCK.fullmatch(entry.name)
            if m is None:
                continue
            owner = int(m["rank"])  # this rank's lock file goes with the claim, below
            if (owner == rank and m.re is DATA) or (rank == 0 and owner >= world_size):
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
        self.release(remove=True)

    def release(self, remove: bool = False) -> None:
        """Let go of the folder (``remove``: delete the lock file first, while still holding it)."""
        if self._fd is None:
            return
        if remove:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        os.close(self._fd)
        self._fd = None


