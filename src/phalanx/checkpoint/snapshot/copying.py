"""Copying a snapshot into its slot while training goes on, without making the training thread wait for a
thread that cannot run.

A write becomes a :class:`SlotWrite` with three phases: *start* (choose and map the slot, clear its header: the
slot stops counting), *tasks* (memory copies of at most :data:`CHUNK` bytes each, in any order, on any
thread), and *finish* (write the metadata, then the header's first word: the slot counts again). Between
the tasks and the finish the job is *released* by whoever changes what it copies next (the optimizer's
pre-step hook, the next write): that is where an in-place change the copy could have missed is noticed,
and such a job ends without counting (see :class:`TornSnapshot`).

One background thread (:class:`Copier`) runs the jobs in order. A thread that must not go on before a job
has got somewhere (the optimizer step, which changes the parameters being copied; the next write, which
needs the slot or the staging buffer) does not just wait: it claims the job's remaining tasks and runs them
itself, at its own priority (:meth:`SlotWrite.copy`, :meth:`SlotWrite.complete`). Only a task the background thread
holds is waited for, and only while the background thread runs at normal priority.

The background thread runs in the idle scheduling class (``SCHED_IDLE``): it takes only cores the training
leaves idle, so a copy that nobody waits for never slows a step. An idle-class thread gets almost no CPU
while every core is busy (the other ranks, data-loader workers, another job on the node), so whoever waits
for it first takes it out of the class. Linux lets a process do that only with CAP_SYS_NICE or
``RLIMIT_NICE`` >= 20 (tried once per process); where it cannot, the thread never enters the class.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import queue
import threading
import time
from collections.abc import Callable

import torch

from phalanx.checkpoint.snapshot.cadence import Cost

#: Bytes per copy task: the most a waiting thread can find held by the background thread.
CHUNK = 4 << 20

Task = Callable[[], object]


class TornSnapshot(RuntimeError):
    """A tensor being copied in the background changed before its copy finished; that snapshot does not count."""


@functools.cache  # a right of the process, asked once
def idle_class_allowed() -> bool:
    """Whether this process may take a thread out of ``SCHED_IDLE`` again (tried on a throwaway thread)."""
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is None:
        return False
    result: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, idle, os.sched_param(0))
        except OSError:
            result.append(False)
            return
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="phalanx-priority-probe", daemon=True)
    thread.start()
    thread.join()
    return bool(result and result[0])


class SlotWrite:
    """One snapshot copy: ``start()`` returns the copy tasks; ``gate`` (if any) runs before the first task on
    each thread that runs tasks (a device copy's event); ``release_check`` runs once at :meth:`release` and
    raises :class:`TornSnapshot` if the copy cannot be trusted; ``finish`` runs once, after the tasks and the
    release, unless the job failed or was torn. ``live``: the tasks read the live tensors, so a release waits
    for them (a job that copies a staged copy is released at once). ``previous``: the job that must have
    finished before this one starts."""

    def __init__(self, start: Callable[[], list[Task]], finish: Task, release_check: Task | None = None,
                 gate: Task | None = None, previous: SlotWrite | None = None, copier: Copier | None = None,
                 live: bool = True) -> None:
        self._start, self._finish, self._check, self._gate = start, finish, release_check, gate
        self._live = live
        self.previous = previous
        self._copier = copier
        self._cond = threading.Condition()
        self._tasks: list[Task] | None = None
        self._starting = False
        self._next = self._done = 0
        self._released = self._finishing = self.finished = False
        self.error: BaseException | None = None  # why it does not count (TornSnapshot, or a failure)
        self.cost: Cost | None = None  # what the snapshot costs (the writer's)
        self.copied_at: float | None = None  # when the last copy task ended (time.perf_counter)

    # ------------------------------------------------------------------ phases (any thread)
    def _run_start(self) -> list[Task]:
        with self._cond:
            if self._tasks is None and not self._starting and self.error is None:
                self._starting = True
                mine = True
            else:
                mine = False
        if mine:
            try:
                if self.previous is not None:
                    self.previous.complete()
                    self.previous = None
                tasks = self._start()
            except BaseException as err:
                self._fail(err)
                raise
            with self._cond:
                self._tasks = tasks
                if not tasks:
                    self.copied_at = time.perf_counter()
                self._cond.notify_all()
        with self._cond:
            self._wait_for(lambda: self._tasks is not None)
            return self._tasks or []

    def _run_tasks(self, tasks: list[Task]) -> None:
        gated = False
        while True:
            with self._cond:
                if self.error is not None or self._next >= len(tasks):
                    return
                index = self._next
                self._next += 1
            try:
                if not gated and self._gate is not None:
                    self._gate()
                gated = True
                with torch.no_grad():  # grad mode is per thread; a copy of a parameter records nothing
                    tasks[index]()
            except BaseException as err:
                self._fail(err)
                raise
            with self._cond:
                self._done += 1
                if self._done == len(tasks):
                    self.copied_at = time.perf_counter()
                    self._cond.notify_all()

    def _run_finish(self) -> None:
        with self._cond:
            self._wait_for(lambda: self._released)
            if self._finishing or self.error is not None:
                self._wait_for(lambda: self.finished)
                return
            self._finishing = True
        try:
            self._finish()
        except BaseException as err:
            self._fail(err)
            raise
        with self._cond:
            self.finished = True
            self._cond.notify_all()

    def _fail(self, err: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = err
            self.finished = True  # nothing more happens to this job: waiters go on
            self._cond.notify_all()

    def _wait_for(self, condition: Callable[[], bool]) -> None:
        """Wait (holding ``_cond``) until ``condition`` or the job failed; the background thread, which holds
        what is waited for, runs at normal priority meanwhile."""
        while not condition() and self.error is None:
            if self._copier is not None and not self._copier.is_current():
                self._copier.boost()
            self._cond.wait()

    # ------------------------------------------------------------------ what the threads call
    def work(self) -> None:
        """The background thread's part: everything, in order."""
        try:
            self._run_tasks(self._run_start())
            with self._cond:
                self._wait_for(lambda: self._done == len(self._tasks or []))
            self._run_finish()
        except BaseException:  # recorded in self.error, reported by the writer
            pass

    def copy(self) -> None:
        """Return once every copy task ran: run those nobody has claimed yet on this thread."""
        tasks = self._run_start()
        self._run_tasks(tasks)
        with self._cond:
            self._wait_for(lambda: self._done == len(tasks))

    def release(self) -> None:
        """What is copied may change from now on: for a job that copies from the live tensors, after its copy
        (:meth:`copy` first); ``release_check`` decides whether the job still counts."""
        with self._cond:
            if self._released:
                return
        try:
            if self._live:
                self.copy()
            if self._check is not None and self.error is None:
                self._check()
        except Exception as err:  # torn, or a copy failed: this job does not count
            self._fail(err)
        finally:
            with self._cond:
                self._released = True
                self._cond.notify_all()

    def complete(self) -> None:
        """Return once the job has finished (or failed): run what nobody has claimed yet on this thread."""
        with contextlib.suppress(Exception):  # a failure is in self.error
            self.copy()
            self.release()
            self._run_finish()


class Copier:
    """One daemon thread that runs :class:`SlotWrite` s in order. (A ThreadPoolExecutor's future costs the training
    thread more than the copy of a small model it stands for.)"""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[SlotWrite | None] = queue.SimpleQueue()
        self._idle_class = idle_class_allowed()
        self._tid: int | None = None
        self._clock: int | None = None  # the thread's CPU-time clock (readable from any thread)
        self._boosted = False
        self._normal_since: float | None = None  # its CPU time when it last began to run at normal priority
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-snapshot", daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        self._tid = threading.get_native_id()
        getclock = getattr(time, "pthread_getcpuclockid", None)
        self._clock = getclock(threading.get_ident()) if getclock is not None else None
        self._started.set()
        while (job := self._jobs.get()) is not None:
            self._lower()
            job.work()

    def _cpu(self) -> float | None:
        return time.clock_gettime(self._clock) if self._clock is not None else None

    def _lower(self) -> None:
        if self._idle_class:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # pid 0: this thread only
            self._boosted, self._normal_since = False, None
        else:
            self._normal_since = self._cpu()  # it competes with the training from the start

    def boost(self) -> None:
        """Take the thread out of the idle class until its next job (someone waits for what it holds)."""
        if self._idle_class and not self._boosted and self._tid is not None:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(self._tid, os.SCHED_OTHER, os.sched_param(0))
            self._boosted, self._normal_since = True, self._cpu()

    def charge(self) -> float:
        """CPU seconds the thread has spent at normal priority since it was last asked: taken from the cores the
        training competes for on a busy machine (in the idle class it takes only idle ones)."""
        since, now = self._normal_since, self._cpu()
        if since is None or now is None:
            return 0.0
        self._normal_since = now
        return max(0.0, now - since)

    def is_current(self) -> bool:
        return threading.get_native_id() == self._tid

    def submit(self, job: SlotWrite) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def chunks(destination: torch.Tensor, source: torch.Tensor) -> list[Task]:
    """Copy tasks of at most :data:`CHUNK` bytes that together copy ``source`` into ``destination`` (tensors of
    one shape and dtype).

    Between host tensors laid out alike, a task is a plain ``memmove``: one thread, the caller's (a tensor copy
    would fan out over every core through torch's thread pool, whose threads are not in the background
    thread's scheduling class, and take the cores the training needs, a GPU's launching thread included).
    Anything else (a device tensor, a strided one) is one ``copy_``."""
    nbytes = source.nbytes
    plain = (source.device.type == destination.device.type == "cpu" and source.is_contiguous()
             and destination.is_contiguous() and destination.nbytes == nbytes)
    if not plain:
        return [functools.partial(torch.Tensor.copy_, destination, source)]
    return [functools.partial(_move, destination, source, a, min(CHUNK, nbytes - a)) for a in range(0, nbytes, CHUNK)]


def _move(destination: torch.Tensor, source: torch.Tensor, start: int, size: int) -> None:
    ctypes.memmove(destination.data_ptr() + start, source.data_ptr() + start, size)  # the GIL is released meanwhile


def unchanged(versions: list[tuple[torch.Tensor, int]], step: int) -> None:
    """Raise :class:`TornSnapshot` if a tensor changed in place since its version was taken (the copy may have
    read part of the change)."""
    changed = next((i for i, (t, seen) in enumerate(versions) if t._version != seen), None)
    if changed is not None:
        raise TornSnapshot(f"a parameter or optimizer state (tensor {changed} of the snapshot of step {step}) was "
                           "changed in place outside optimizer.step() while it was being copied")
