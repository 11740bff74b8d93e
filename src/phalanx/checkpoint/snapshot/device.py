"""Snapshots of device tensors: the device's copy engine writes them straight into the slot, whose mapping is
registered with CUDA as pinned memory (one copy); where registration is refused, into pinned staging memory,
which the background thread then moves into the slot (two copies, :class:`Staging`).

**One copy.** A slot's mapping (a file in ``/dev/shm``) is registered with ``cudaHostRegister`` once, when it
is mapped: in the background before the first snapshot (:meth:`~.writer.RankSnapshots.prepare`), and
unregistered before it is unmapped (:meth:`~.slots.Slot.release`, a larger mapping, the end of the
process). A snapshot is then queued on a side stream, in this order (:class:`OneCopy`):

1. the slot's header word is cleared: the slot stops counting;
2. every tensor is copied into its place in the slot; the next optimizer step waits for this on the device
   (a stream wait, never a host wait);
3. once the host has checked that no tensor changed in place meanwhile (version counters, when the
   optimizer is about to step), the metadata and the rest of the header, then the header word: the slot
   counts again.

Stream order makes a slot hold a complete snapshot or none, whatever instant a kill lands on, and the slot
kept meanwhile holds the previous one: the next snapshot's step 1 is queued after this one's step 3. The
metadata, the header and the state's host tensors (RNG states, counters) reach the slot through the device
(pinned memory, the device, the slot), so that they too land in stream order; nothing of a snapshot is
written by the host, and no snapshot waits for the previous one on the host. "Complete" is the last copy's
event, which the host only queries.

:class:`Engine` is everything of this that touches CUDA. The tests put a host emulation in its place, whose
queue runs when the test says, so that the order above, a kill at any point of it and the fallback are
tested on a machine without a GPU (tests/checkpoint/test_snapshot_device.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from phalanx.checkpoint.snapshot.cadence import Cost
from phalanx.checkpoint.snapshot.copying import SlotWrite, TornSnapshot, unchanged
from phalanx.checkpoint.snapshot.slots import HEADER_SIZE, MAGIC, Slot, header_tail

#: cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the current device's.
_PORTABLE = 1
_ALIGN = 64


class Refused(RuntimeError):
    """The device would not register a slot's mapping; the message says why."""


class Engine:
    """A device's part in snapshots: a side stream, what is queued on it, and registering host memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        words = torch.tensor([*MAGIC, *bytes(8)], dtype=torch.uint8).pin_memory()
        with torch.cuda.stream(self.stream):
            on_device = words.to(device, non_blocking=True)
        self.magic, self.zero = on_device[:8], on_device[8:]  # the header word, set and cleared

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def pin(self, buffer: torch.Tensor) -> Callable[[], None]:
        """Register ``buffer``'s memory (a slot's mapping) as pinned; returns what unregisters it."""
        ptr, size = buffer.data_ptr(), buffer.numel()
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.device):
            result = cudart.cudaHostRegister(ptr, size, _PORTABLE)
        if int(result) != 0:
            reason = f"cudaHostRegister refused {size / 2**20:.0f} MiB: {cudart.cudaGetErrorString(result)}"
            self._forget_error()
            raise Refused(reason)
        return functools.partial(_unregister, ptr, self.device, os.getpid())

    def _forget_error(self) -> None:
        """A failed runtime call stays this thread's "last error", which torch would report at its next kernel
        launch on this thread as that kernel's failure: launch one now and let it take the report."""
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                with contextlib.suppress(RuntimeError):
                    torch.ones(1, device=self.device).add_(1)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def begin(self) -> Any:
        """The side stream waits for what the training stream has queued so far; returns an event there."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return self.mark()

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def copy(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        if targets:
            with torch.no_grad(), torch.cuda.stream(self.stream):
                torch._foreach_copy_(targets, sources, non_blocking=True)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (pinned) on the device, copied on the side stream."""
        with torch.cuda.stream(self.stream):
            return host.to(self.device, non_blocking=True)

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` as it is now in the training stream's order (a buffer the next forward changes),
        which the side stream reads later."""
        clone = tensor.clone()
        clone.record_stream(self.stream)  # not reused before the side stream has read it
        return clone

    def stamp(self) -> Any:
        """An event on the training stream, now: two of them time what the device did, or idled, in between."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def hold(self, event: Any) -> tuple[Any, Any]:
        """The training stream waits for ``event`` on the device; two events there time the wait."""
        main = torch.cuda.current_stream(self.device)
        reach, resume = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reach.record(main)
        main.wait_event(event)
        resume.record(main)
        return reach, resume

    @staticmethod
    def query(event: Any) -> bool:
        return bool(event.query())

    @staticmethod
    def synchronize(event: Any) -> None:
        event.synchronize()

    @staticmethod
    def seconds(start: Any, end: Any) -> float:
        """Between two completed events."""
        return float(start.elapsed_time(end)) / 1e3


def engine_for(tensors: list[torch.Tensor]) -> Engine | None:
    """The engine of the device the state lives on (None: a host state)."""
    device = next((t.device for t in tensors if t.is_cuda), None)
    return Engine(device) if device is not None else None


def _unregister(ptr: int, device: torch.device, pid: int) -> None:
    if os.getpid() != pid:  # a forked child (a data-loader worker) shares the mapping, not the registration
        return
    with contextlib.suppress(Exception):  # the device failed, or CUDA is going: the driver lets go at exit
        torch.cuda.synchronize(device)  # no copy may still be writing it
        torch.cuda.cudart().cudaHostUnregister(ptr)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class OneCopy:
    """A snapshot the device copies straight into a registered slot (see the module docstring): its copies are
    queued when it is made; :meth:`release` queues its commit once the tensors may change."""

    def __init__(self, engine: Engine, slot: Slot, step: int, world: int, rank: int, body: bytes,
                 sources: list[tuple[int, torch.Tensor]], versions: list[tuple[torch.Tensor, int]],
                 cost: Cost, called: Any) -> None:
        self.engine, self.slot, self.step, self.cost = engine, slot, step, cost
        self._called = called  # the training stream's event when the call began (None: the first call)
        self.error: BaseException | None = None
        self._versions = versions
        # What the host adds, in pinned memory: the header after its word, the metadata, the host tensors.
        tail = header_tail(step, world, rank, len(body), slot.data_offset)
        on_host = [(i, t) for i, t in sources if not engine.on_device(t)]
        on_device = [(i, t) for i, t in sources if engine.on_device(t)]
        self._meta = (_ALIGN, len(body))
        places, at = [], _aligned(_ALIGN + len(body))
        for _, t in on_host:
            places.append(at)
            at = _aligned(at + t.nbytes)
        host = engine.pinned(at)
        ctypes.memmove(host.data_ptr(), tail, len(tail))
        ctypes.memmove(host.data_ptr() + _ALIGN, body, len(body))
        with torch.no_grad():
            for (_, t), place in zip(on_host, places):
                _typed(host, place, t).copy_(t)
        self._host_parts = [(slot.views[i], place, t) for (i, t), place in zip(on_host, places)]
        slot.step = -1
        self._begin = engine.begin()
        engine.copy([slot.region(0, 8)], [engine.zero])  # 1. the slot stops counting
        engine.copy([slot.views[i] for i, _ in on_device], [t for _, t in on_device])  # 2. the tensors
        self._copied = engine.mark()
        self._staged = engine.upload(host)
        self._host = host  # alive until uploaded (torch's pinned-memory cache tracks it too)
        self._sources = [t for _, t in on_device]  # alive until copied: a temporary is not reused before
        self._done: Any = None
        self._wait: tuple[Any, Any] | None = None
        self._returned = engine.stamp()  # the call is over

    def release(self) -> None:
        """The tensors may change from now on: the training stream waits for their copy (on the device); the
        snapshot is committed unless one changed in place during the copy (then it never counts)."""
        if self._wait is not None:
            return
        engine, slot = self.engine, self.slot
        self._wait = engine.hold(self._copied)
        try:
            unchanged(self._versions, self.step)
        except TornSnapshot as torn:
            self.error = torn
            return  # the slot stays cleared: it never counts
        staged, (start, length) = self._staged, self._meta
        targets = [slot.region(HEADER_SIZE, HEADER_SIZE + length), slot.region(8, HEADER_SIZE)]
        sources = [staged[start:start + length], staged[:HEADER_SIZE - 8]]
        for view, place, t in self._host_parts:
            targets.append(view)
            sources.append(_typed(staged, place, t))
        engine.copy(targets, sources)  # 3. the metadata, the host tensors, the header
        engine.copy([slot.region(0, 8)], [engine.magic])  # its first word last: the slot counts again
        self._done = engine.mark()
        slot.step = self.step

    @property
    def finished(self) -> bool:
        """Complete (or torn); asks the device, never waits."""
        return self.error is not None or (self._done is not None and self.engine.query(self._done))

    def measure(self) -> bool:
        """Fill in the cost once every part of it is known (the events have completed); returns whether it is."""
        if not self.finished or self._wait is None or not self.engine.query(self._wait[1]):
            return False
        engine, cost = self.engine, self.cost
        cost.device_wait = engine.seconds(*self._wait)
        cost.copy = engine.seconds(self._begin, self._copied)
        if self._called is not None:
            cost.call_on_device = engine.seconds(self._called, self._returned)
        cost.failed = self.error is not None
        self._staged = self._host = None  # type: ignore[assignment]
        self._sources = []
        return True

    def complete(self) -> None:
        """Return once the snapshot is in the slot (a host wait: for the end of a run, not a step)."""
        self.release()
        self.engine.synchronize(self._done if self._done is not None else self._copied)


def _typed(raw: torch.Tensor, at: int, like: torch.Tensor) -> torch.Tensor:
    """``raw``'s bytes from ``at`` as a tensor of ``like``'s dtype and shape."""
    return raw[at:at + like.nbytes].view(like.dtype).view(like.shape)


class Staging:
    """Two pinned host buffers for the two-copy path, each held by the job that moves it into a slot."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.holders: list[SlotWrite | None] = [None, None]
        self.order = [0, 1]  # least recently taken first

    def take(self, nbytes: int, engine: Engine) -> tuple[int, torch.Tensor, bool]:
        """A free buffer of at least ``nbytes``, and whether it was allocated now (a one-time cost). With both
        held, the least recently taken one's job is completed first: the calling thread does what is left."""
        free = [i for i in self.order if self.holders[i] is None or self.holders[i].finished]  # type: ignore[union-attr]
        index = free[0] if free else self.order[0]
        holder = self.holders[index]
        if holder is not None:
            holder.complete()
        self.order.remove(index)
        self.order.append(index)
        buffer = self.buffers[index]
        allocated = buffer is None or buffer.numel() < nbytes
        if allocated:
            self.buffers[index] = None  # the old one goes before the new one is pinned
            buffer = self.buffers[index] = engine.pinned(nbytes + max(1 << 16, nbytes >> 4))
        assert buffer is not None
        return index, buffer, allocated

    def hold(self, index: int, job: SlotWrite) -> None:
        self.holders[index] = job


__all__ = ["Engine", "OneCopy", "Refused", "Staging", "engine_for"]
