"""The snapshot copy engine (phalanx.checkpoint.snapshot.copying): every task of a job runs once whichever thread
runs it, the finish runs once and only after the copy and the release, a failed or torn job never finishes, jobs
finish in order, and a waiting thread never depends on a background thread that cannot run."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

from phalanx.checkpoint.snapshot import copying
from phalanx.checkpoint.snapshot.copying import CHUNK, Copier, SlotWrite, TornSnapshot, chunks


def _job(n: int, log: list[str], copier: Copier | None = None, check: object = None, previous: SlotWrite | None = None,
         name: str = "job") -> tuple[SlotWrite, Counter[int]]:
    runs: Counter[int] = Counter()

    def task(i: int) -> None:
        runs[i] += 1

    def start() -> list[object]:
        log.append(f"{name} start")
        return [lambda i=i: task(i) for i in range(n)]

    return SlotWrite(start, lambda: log.append(f"{name} finish"), check, previous=previous, copier=copier), runs  # type: ignore[arg-type]


def test_each_task_runs_once_whichever_threads_run_them() -> None:
    copier = Copier()
    try:
        for _ in range(20):
            log: list[str] = []
            job, runs = _job(200, log, copier)
            copier.submit(job)
            job.copy()  # races the copier for the tasks
            assert sorted(runs) == list(range(200)) and set(runs.values()) == {1}
            assert "job finish" not in log  # not released yet
            job.complete()
            assert log == ["job start", "job finish"] and job.finished and job.error is None
    finally:
        copier.stop()


def test_a_failed_task_or_a_torn_copy_never_finishes_and_says_why() -> None:
    log: list[str] = []

    def broken() -> list[object]:
        def fail() -> None:
            raise OSError("no space")
        return [fail]

    job = SlotWrite(broken, lambda: log.append("finish"))  # type: ignore[arg-type]
    job.complete()
    assert isinstance(job.error, OSError) and job.finished and log == []

    def torn() -> None:
        raise TornSnapshot("changed")

    job, _ = _job(3, log, check=torn)
    job.complete()
    assert isinstance(job.error, TornSnapshot) and log == ["job start"]


def test_a_job_starts_only_after_the_one_before_it_finished() -> None:
    log: list[str] = []
    first, _ = _job(2, log, name="first")
    second, _ = _job(2, log, previous=first, name="second")
    second.complete()  # this thread finishes the first one first: the slot choice depends on it
    assert log == ["first start", "first finish", "second start", "second finish"]


def test_chunks_copy_everything_in_pieces_of_at_most_chunk_bytes() -> None:
    source = torch.arange(CHUNK // 4 * 2 + 5, dtype=torch.float32)
    destination = torch.zeros_like(source)
    tasks = chunks(destination, source)
    assert len(tasks) == 3
    for task in reversed(tasks):  # any order
        task()
    assert torch.equal(destination, source)
    raw = torch.zeros(source.nbytes, dtype=torch.uint8)  # a slot's bytes, from a staging buffer's
    for task in chunks(raw, source.view(torch.uint8)):
        task()
    assert torch.equal(raw.view(torch.float32), source)
    strided = torch.arange(12.0).reshape(3, 4).t()  # not contiguous: one task, torch's copy
    out = torch.zeros(4, 3)
    tasks = chunks(out, strided)
    assert len(tasks) == 1
    tasks[0]()
    assert torch.equal(out, strided)


def test_the_idle_class_probe_answers_for_this_process() -> None:
    assert isinstance(copying.idle_class_allowed(), bool)
    if not hasattr(copying.os, "SCHED_IDLE"):
        pytest.skip("no SCHED_IDLE on this platform")
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(copying.os.sched_getscheduler(0)))
    thread.start()
    thread.join()
    assert seen == [copying.os.SCHED_OTHER]  # the probe's thread was its own: nothing else changed


def test_what_the_copier_spends_at_normal_priority_is_charged_to_the_snapshot() -> None:
    # In the idle class the copier takes only idle cores: free. Taken out of it because the training waits for a
    # task it holds, it competes for the training's cores: its CPU time from then on is part of the cost.
    if not copying.idle_class_allowed():
        pytest.skip("this process may not take a thread out of SCHED_IDLE: the copier runs at normal priority here")
    copier = Copier()
    holding, release = threading.Event(), threading.Event()

    def held() -> None:
        holding.set()
        assert release.wait(30)
        end = time.thread_time() + 0.05
        while time.thread_time() < end:  # 50 ms of CPU, at normal priority by now
            pass

    job = SlotWrite(lambda: [held], lambda: None, copier=copier)  # type: ignore[arg-type,list-item]
    copier.submit(job)
    try:
        assert holding.wait(30)
        assert copier.charge() == 0.0  # in the idle class
        threading.Timer(0.1, release.set).start()
        job.copy()  # waits for the held task: the copier leaves the idle class
        assert copier.charge() >= 0.045
        assert copier.charge() < 0.01  # counted once
    finally:
        release.set()
        job.complete()
        copier.stop()
