"""Per-rank snapshots in shared memory (phalanx.checkpoint.snapshot.writer), in one process: exact round trips
(tensors that change shape between snapshots included), a slot being rewritten never counts, a tensor changed
during the background copy drops that snapshot, the optimizer never steps before the copy and never waits for a
copier that cannot run, opening one runs no code, and a full /dev/shm turns snapshots off with a message. The
copy engine alone is tests/checkpoint/test_snapshot_copying.py, the cadence test_snapshot_cadence.py, device
tensors (one copy into a registered slot; CUDA itself under the gpu mark) test_snapshot_device.py; the
multi-process paths (DDP, FSDP shards, kill -9 and restart) are in tests/trainer/test_survival.py and
tests/fabric/test_preemption.py."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import JOBS
from torch import nn

import phalanx
from phalanx import checkpoint
from phalanx.checkpoint import snapshot
from phalanx.checkpoint.snapshot import copying, slots, writer
from phalanx.utils.errors import CheckpointError, MisconfigurationError


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "snapshots"  # tmp_path rather than /dev/shm: the same code, cleaned up by pytest


def _setup(seed: int = 0) -> tuple[phalanx.Fabric, Any, Any]:
    torch.manual_seed(seed)
    fabric = phalanx.Fabric(accelerator="cpu", devices=1)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer


def _step(fabric: phalanx.Fabric, model: Any, optimizer: Any) -> None:
    loss = model(torch.randn(5, 6)).square().mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def _weights(model: Any, optimizer: Any) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    for per_param in optimizer.state_dict()["state"].values():
        out += [t.clone() for t in per_param.values()]
    return out


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": [self.n] * 3}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def test_a_snapshot_restores_every_entry_exactly_and_training_continues_identically(folder: Path) -> None:
    fabric, model, optimizer = _setup()
    counter = Counter()
    for step in range(1, 4):
        _step(fabric, model, optimizer)
        counter.n = step
        ref = fabric.save_snapshot({"model": model, "optimizer": optimizer, "counter": counter, "step": step,
                                    "note": ("plain", 1.5, None)}, step, folder, every_n_steps=1)
        assert ref == snapshot.reference(folder.absolute(), step)
    saved = _weights(model, optimizer)
    torch.manual_seed(1)
    _step(fabric, model, optimizer)
    expected_next = _weights(model, optimizer)

    latest = fabric.latest_checkpoint(folder)
    assert latest == snapshot.reference(folder.absolute(), 3)
    assert sorted(snapshot.complete_steps(folder.absolute())) == [2, 3]  # keep=2
    _step(fabric, model, optimizer)  # move away, then back
    counter.n = -1
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "counter": counter, "step": None}
    rest = fabric.load(latest, state)
    assert rest == {"note": ("plain", 1.5, None)}
    assert state["step"] == 3 and counter.n == 3
    assert all(torch.equal(a, b) for a, b in zip(saved, _weights(model, optimizer), strict=True))
    torch.manual_seed(1)
    _step(fabric, model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(expected_next, _weights(model, optimizer), strict=True))
    fabric.remove_snapshots(folder)
    assert not folder.exists()


def test_a_fresh_optimizer_is_restored_from_a_snapshot(folder: Path) -> None:
    # A restarted process has an optimizer without state: load_state_dict must create it, not copy into it.
    fabric, model, optimizer = _setup()
    _step(fabric, model, optimizer)
    fabric.save_snapshot({"model": model, "optimizer": optimizer}, 1, folder, overlap=False, every_n_steps=1)
    expected = _weights(model, optimizer)
    fabric2, model2, optimizer2 = _setup(seed=5)
    fabric2.load(snapshot.reference(folder.absolute(), 1), {"model": model2, "optimizer": optimizer2})
    assert all(torch.equal(a, b) for a, b in zip(expected, _weights(model2, optimizer2), strict=True))


def test_tensors_that_change_shape_between_snapshots_read_back_exactly(folder: Path) -> None:
    # Step values accumulated during an epoch grow by one per step, with other tensors after them: each write
    # keeps the slot's layout up to the first tensor that changed and lays out the rest again, which must land
    # where a reader lays out the whole table. (Odd sizes: each tensor ends off the alignment.)
    fabric, model, optimizer = _setup()
    for step in range(1, 7):
        _step(fabric, model, optimizer)
        values = torch.arange(step * 3, dtype=torch.float64) + step
        after = {"flags": torch.arange(step % 3 + 1, dtype=torch.uint8), "rng": torch.get_rng_state()}
        fabric.save_snapshot({"model": model, "optimizer": optimizer, "values": values, "after": after}, step, folder,
                             every_n_steps=1)
        state: dict[str, Any] = {"values": None, "after": None}
        fabric.load(snapshot.reference(folder.absolute(), step), state)
        assert torch.equal(state["values"], values)
        assert all(torch.equal(state["after"][k], v) for k, v in after.items())


def test_a_slot_being_rewritten_never_counts(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fabric, model, optimizer = _setup()
    for step in (1, 2):
        _step(fabric, model, optimizer)
        fabric.save_snapshot({"model": model, "optimizer": optimizer}, step, folder, overlap=False, every_n_steps=1)
    at_two = _weights(model, optimizer)
    _step(fabric, model, optimizer)
    copies = writer._copies

    def dies_mid_copy(slot: Any, sources: list[torch.Tensor]) -> list[Any]:
        first = copies(slot, sources)[0]  # part of step 3 is in the slot that held step 1

        def killed() -> None:
            raise OSError("killed")

        return [first, killed]

    monkeypatch.setattr(writer, "_copies", dies_mid_copy)
    with pytest.warns(UserWarning, match=r"writing the one of step 3 failed \(OSError: killed\)"):
        assert fabric.save_snapshot({"model": model, "optimizer": optimizer}, 3, folder, overlap=False,
                                    every_n_steps=1) is None
    monkeypatch.undo()
    assert sorted(snapshot.complete_steps(folder.absolute())) == [2]  # step 1 is gone, step 3 never counted
    fabric.load(fabric.latest_checkpoint(folder), {"model": model, "optimizer": optimizer})
    assert all(torch.equal(a, b) for a, b in zip(at_two, _weights(model, optimizer), strict=True))


def _frozen_copier(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Copy in the background even the small tensors here, with a copier that runs nothing until the event is set
    (a background thread that gets no CPU: every core busy)."""
    monkeypatch.setattr(writer, "OVERLAP_BYTES", 0)
    thaw = threading.Event()
    work = copying.SlotWrite.work

    def frozen(self: copying.SlotWrite) -> None:
        assert thaw.wait(30)
        work(self)

    monkeypatch.setattr(copying.SlotWrite, "work", frozen)
    return thaw


def test_the_optimizer_never_waits_for_a_copier_that_cannot_run(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The step must not go on before the copy (it changes what is copied), and must not wait for a thread that
    # gets no CPU either: it copies what the copier has not started itself.
    fabric, model, optimizer = _setup()
    _step(fabric, model, optimizer)
    expected = _weights(model, optimizer)
    thaw = _frozen_copier(monkeypatch)
    try:
        fabric.save_snapshot({"model": model, "optimizer": optimizer}, 1, folder, every_n_steps=1)  # returns at once
        assert snapshot.complete_steps(folder.absolute()) == {}
        _step(fabric, model, optimizer)  # optimizer.step() copies first: the copier is frozen
        assert not thaw.is_set()
        # The copy was taken before the step changed the weights; what finishes it (the metadata, the header) is
        # done by whoever gets there first: here the load, on this thread.
        fabric.load(snapshot.reference(folder.absolute(), 1), {"model": model, "optimizer": optimizer})
        assert all(torch.equal(a, b) for a, b in zip(expected, _weights(model, optimizer), strict=True))
    finally:
        thaw.set()


def test_the_copier_runs_in_the_idle_class_and_leaves_it_while_waited_for() -> None:
    if not copying.idle_class_allowed():
        pytest.skip("this process may not take a thread out of SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE < 20): "
                    "the copier runs at normal priority here")
    copier = copying.Copier()
    holding, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def held() -> None:  # a copy task the copier holds while the training thread waits for it
        seen.append(os.sched_getscheduler(0))
        holding.set()
        assert release.wait(30)

    job = copying.SlotWrite(lambda: [held], lambda: None, copier=copier)
    copier.submit(job)
    try:
        assert holding.wait(30)
        assert seen == [os.SCHED_IDLE]  # copying while nobody waits: only idle cores
        assert copier._tid is not None
        threading.Timer(0.2, lambda: (seen.append(os.sched_getscheduler(copier._tid)), release.set())).start()
        job.copy()  # waits for the task the copier holds: it leaves the idle class meanwhile
        assert seen[1] == os.SCHED_OTHER
    finally:
        release.set()
        job.complete()
        copier.stop()


def test_a_parameter_changed_during_the_copy_drops_that_snapshot(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fabric, model, optimizer = _setup()
    _step(fabric, model, optimizer)
    fabric.save_snapshot({"model": model, "optimizer": optimizer}, 1, folder, overlap=False, every_n_steps=1)
    thaw = _frozen_copier(monkeypatch)
    try:
        fabric.save_snapshot({"model": model, "optimizer": optimizer}, 2, folder, every_n_steps=1)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # in place, outside optimizer.step(), before the copy is done
        with pytest.warns(UserWarning, match=r"Rank 0's snapshot was dropped: a parameter or optimizer state .* "
                                             r"changed in place outside optimizer.step\(\)"):
            fabric.save_snapshot({"model": model, "optimizer": optimizer}, 3, folder, every_n_steps=1)
    finally:
        thaw.set()
    # Step 2 never counted; step 3 was copied before the call returned (overlap is off from then on).
    assert sorted(snapshot.complete_steps(folder.absolute())) == [1, 3]


def test_a_snapshot_holds_plain_values_only_and_opening_one_runs_no_code(folder: Path) -> None:
    fabric, model, _ = _setup()
    with pytest.raises(CheckpointError, match=r"tensors and plain Python values only .* holds a pathlib.PosixPath"):
        fabric.save_snapshot({"model": model, "where": Path("x")}, 1, folder, every_n_steps=1)
    fabric.save_snapshot({"model": model}, 2, folder, overlap=False, every_n_steps=1)
    data = folder.absolute() / slots.data_name(0, 0)
    header = slots.read_header(data)
    assert header is not None and header.step == 2
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.system, (f"touch {folder / 'pwned'}",)

    # The metadata as a snapshot lays it out ([head length | head | one pickle per entry | extra]), with a
    # malicious pickle as the model's entry, put where the real metadata was.
    head = pickle.dumps({"version": slots.VERSION, "table": [], "keys": ["model"]})
    evil = len(head).to_bytes(8, "little") + head + pickle.dumps(Evil()) + pickle.dumps({})
    with open(data, "r+b") as fh:
        fh.seek(64)
        fh.write(evil)
        fh.seek(0)
        raw = bytearray(fh.read(64))
        raw[40:48] = len(evil).to_bytes(8, "little")  # the metadata length field
        fh.seek(0)
        fh.write(raw)
    with pytest.raises(CheckpointError, match=r"metadata .* cannot be read: .*names posix.system"):
        fabric.load(snapshot.reference(folder.absolute(), 2), {"model": model})
    assert not (folder / "pwned").exists()


def test_no_room_in_shared_memory_turns_snapshots_off_with_a_message(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fabric, model, optimizer = _setup()

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(slots.os, "posix_fallocate", full)
    with pytest.warns(UserWarning, match=r"Snapshots in .* are off on rank 0: writing the one of step 1 failed "
                                         r"\(OSError: \[Errno 28\] No space left on device\)"):
        assert fabric.save_snapshot({"model": model, "optimizer": optimizer}, 1, folder, overlap=False,
                                    every_n_steps=1) is None
    assert fabric.save_snapshot({"model": model, "optimizer": optimizer}, 2, folder, overlap=False,
                                every_n_steps=1) is None
    assert snapshot.complete_steps(folder.absolute()) == {}


def test_a_second_run_writing_the_same_folder_is_refused_and_takes_nothing_of_the_first(folder: Path) -> None:
    # Two runs in one snapshot folder (one default_root_dir) would overwrite and delete each other's snapshots,
    # and a restart of one could resume the other's state. The claim is a flock per rank: two Fabrics of this
    # process hold two open files, so they conflict exactly as two processes do.
    fabric, model, optimizer = _setup()
    other, model2, optimizer2 = _setup(seed=5)
    _step(fabric, model, optimizer)
    ref = fabric.save_snapshot({"model": model, "optimizer": optimizer}, 1, folder, overlap=False, every_n_steps=1)
    expected = _weights(model, optimizer)
    refusal = (rf"Another Trainer or Fabric of this process \(pid {os.getpid()}\), still running or never torn down, "
               rf"is writing rank 0's snapshots in "
               rf"{re.escape(str(folder.absolute()))}: two runs are using one snapshot folder at the same time.*"
               r"Trainer\(default_root_dir=\.\.\.\) or Snapshot\(dirpath=\.\.\.\)")
    with pytest.raises(MisconfigurationError, match=refusal):
        other.save_snapshot({"model": model2, "optimizer": optimizer2}, 7, folder, overlap=False, every_n_steps=1)
    other.remove_snapshots(folder)  # the refused run ends normally: it deletes nothing of the first one's
    other._snapshots.end(failed=False)
    assert fabric.latest_checkpoint(folder) == ref
    fabric.load(ref, {"model": model2, "optimizer": optimizer2})
    assert all(torch.equal(a, b) for a, b in zip(expected, _weights(model2, optimizer2), strict=True))

    fabric.close_snapshots(folder)  # the first run stops unfinished: its snapshot stays, the folder is free
    assert other.latest_checkpoint(folder) == ref
    assert other.save_snapshot({"model": model2, "optimizer": optimizer2}, 2, folder, overlap=False,
                               every_n_steps=1) is not None
    other.remove_snapshots(folder)  # the rerun finishes: the folder is gone
    assert not folder.exists()


def test_a_rank_killed_with_9_lets_go_of_its_folder(folder: Path) -> None:
    # What a restarted attempt relies on: the kernel drops the claim of a process that ends without cleaning up.
    holder = subprocess.Popen(
        [sys.executable, str(JOBS / "snapshot_folder_holder.py"), str(folder)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(phalanx.__file__).parents[1])})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(MisconfigurationError, match=rf"Another process \(pid {holder.pid}\)"):
            slots.FolderClaim(folder, 0)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    slots.FolderClaim(folder, 0).release(remove=True)


def test_a_snapshot_of_another_world_size_is_refused_with_the_way_out(folder: Path) -> None:
    fabric, model, _ = _setup()
    fabric.save_snapshot({"model": model}, 4, folder, overlap=False, every_n_steps=1)
    # A restart or "last" of a 2-rank job does not even pick it; loading it by name is refused.
    assert checkpoint.latest([folder.absolute()], world_size=2) is None
    assert checkpoint.latest([folder.absolute()], world_size=1) == snapshot.reference(folder.absolute(), 4)
    reader = writer.RankSnapshots(folder.absolute(), rank=0, world_size=2)
    with pytest.raises(CheckpointError, match=r"written by 1 ranks and this job has 2: a snapshot resumes the same "
                                              r"topology only\. Resume from a disk checkpoint"):
        reader.read(4)


def test_the_per_step_rng_capture_follows_every_change_of_numpys_generator() -> None:
    # RngCapture reuses NumPy's state while its words are untouched; a call that only consumes the cached
    # Gaussian leaves the words alone, so a cached Gaussian always means reading the state again.
    import numpy as np

    from phalanx.utils.seed import RngCapture, capture_rng_state, restore_rng_state

    capture = RngCapture()
    np.random.seed(3)
    for use in (lambda: None, lambda: np.random.rand(3), lambda: np.random.standard_normal(),
                lambda: np.random.standard_normal(), lambda: None, lambda: np.random.set_state(np.random.get_state())):
        use()
        state = capture()
        full = capture_rng_state()
        assert state["numpy"]["pos"] == full["numpy"]["pos"]
        assert state["numpy"]["has_gauss"] == full["numpy"]["has_gauss"]
        assert state["numpy"]["cached_gaussian"] == full["numpy"]["cached_gaussian"]
        assert torch.equal(state["numpy"]["keys"], full["numpy"]["keys"])
        expected = (np.random.standard_normal(4), np.random.rand(2))
        restore_rng_state(state)
        again = (np.random.standard_normal(4), np.random.rand(2))
        assert all(np.array_equal(a, b) for a, b in zip(expected, again, strict=True))
        restore_rng_state(state)
