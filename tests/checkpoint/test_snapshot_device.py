"""Snapshots of device tensors (phalanx.checkpoint.snapshot.device). On a CPU, with the device emulated
(:class:`HostEngine`: the side stream is a queue that runs when a stream wait, a query or the test says; floating
tensors are "on the device"): a one-copy snapshot is written by the queue alone and restores exactly; a kill after
any queued copy leaves every slot complete or not counted, the previous snapshot kept; a tensor changed during the
copy drops that snapshot; the slots are set up and registered in the background before the first "auto" snapshot
and unregistered before their mappings go; a refused registration falls back to two copies and says why, once.
The CUDA half (``gpu`` mark): the same on a GPU, without a host synchronization."""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.checkpoint import snapshot
from phalanx.checkpoint.snapshot import device, slots
from phalanx.checkpoint.snapshot.cadence import Cadence, Cost
from phalanx.checkpoint.snapshot.writer import RankSnapshots


class HostEngine:
    """The device emulated on the host. Copies queue and run in order, reading their sources when they run (as a
    copy engine does): when the host looks (a stream wait, a query: a fast device), or with ``lazy`` only when a
    synchronization or the test runs them. An event is a position in the queue. Registering a buffer is recorded
    (or refused with ``refuse``)."""

    def __init__(self, refuse: str | None = None, lazy: bool = False) -> None:
        self.queue: list[Callable[[], object]] = []
        self.ran = 0
        self.refuse, self.lazy = refuse, lazy
        self.registered: dict[int, int] = {}  # address -> bytes
        self.log: list[tuple[str, int]] = []
        self.magic, self.zero = torch.tensor(list(slots.MAGIC), dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
        self._lock = threading.RLock()  # the two-copy path's gate runs the queue on the background thread

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.is_floating_point()

    def pin(self, buffer: torch.Tensor) -> Callable[[], None]:
        if self.refuse is not None:
            raise device.Refused(self.refuse)
        ptr = buffer.data_ptr()
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = buffer.numel()
        self.log.append(("register", ptr))
        return functools.partial(self._unpin, ptr)

    def _unpin(self, ptr: int) -> None:
        del self.registered[ptr]
        self.log.append(("unregister", ptr))

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def begin(self) -> int:
        return self.mark()

    def mark(self) -> int:
        with self._lock:
            return len(self.queue)

    def copy(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        with self._lock:
            self.queue += [functools.partial(_copy, t, s) for t, s in zip(targets, sources, strict=True)]

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(host)
        self.copy([out], [host])
        return out

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def stamp(self) -> int:
        return self.mark()

    def hold(self, event: int) -> tuple[int, int]:
        if not self.lazy:
            self.run(event)  # the training "stream" is this thread: it goes on once the copy has run
        return event, event

    def query(self, event: int) -> bool:
        if not self.lazy:
            self.run()
        return self.ran >= event

    def synchronize(self, event: int) -> None:
        self.run(event)

    @staticmethod
    def seconds(start: int, end: int) -> float:
        return 0.0

    def run(self, upto: int | None = None, each: Callable[[], None] | None = None) -> None:
        with self._lock:
            while self.ran < (len(self.queue) if upto is None else upto):
                self.queue[self.ran]()
                self.ran += 1
                if each is not None:
                    each()


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    with torch.no_grad():
        target.copy_(source)


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostEngine]:
    emulated = HostEngine()
    monkeypatch.setattr(device, "engine_for", lambda tensors: emulated)
    yield emulated


def _state(step: int) -> dict[str, Any]:
    """A state with "device" tensors (floating), host tensors (RNG-like) and plain values; new tensors each step."""
    return {"weights": {"a": torch.full((3000,), float(step)), "b": torch.arange(7, dtype=torch.float64) * step},
            "rng": torch.tensor([step, -step], dtype=torch.int64), "flag": torch.tensor(step % 2 == 0),
            "step": step}


def _write(snapshots: RankSnapshots, step: int) -> Cost:
    return snapshots.write(step, _state(step), {"strategy": "emulated"}, lambda kind, obj, module: obj)


def _check(folder: Path, step: int) -> None:
    saved, extra = RankSnapshots(folder, 0, 1).read(step)
    expected = _state(step)
    assert extra == {"strategy": "emulated"} and saved["step"] == step
    assert torch.equal(saved["weights"]["a"], expected["weights"]["a"])
    assert torch.equal(saved["weights"]["b"], expected["weights"]["b"])
    assert torch.equal(saved["rng"], expected["rng"]) and torch.equal(saved["flag"], expected["flag"])


def test_a_one_copy_snapshot_is_written_by_the_device_alone_and_restores_exactly(tmp_path: Path,
                                                                                engine: HostEngine) -> None:
    engine.lazy = True
    snapshots = RankSnapshots(tmp_path, 0, 1)
    cost = _write(snapshots, 1)
    assert snapshots.path == "one copy" and cost.one_time  # the slot was mapped (and registered) by this write
    assert snapshot.complete_steps(tmp_path) == {}
    snapshots.poll()
    assert not cost.final
    snapshots.wait()  # releases (queues the commit) and runs the queue
    assert cost.final and not cost.failed and sorted(snapshot.complete_steps(tmp_path)) == [1]
    _check(tmp_path, 1)
    assert len(engine.registered) == 1
    snapshots.close()
    assert engine.registered == {}  # unregistered before the mapping goes


def test_a_kill_after_any_queued_copy_leaves_complete_snapshots_only(tmp_path: Path, engine: HostEngine) -> None:
    # Four snapshots queued back to back (the host never waits between them); the queue then runs one copy at a
    # time, and after each one (where a kill -9 could land) every slot that counts holds exactly its step, and
    # from the first commit on one always counts.
    engine.lazy = True
    snapshots = RankSnapshots(tmp_path, 0, 1, keep=2)
    for step in range(1, 5):
        _write(snapshots, step)
        snapshots._before_step()  # the optimizer is about to step: the commit is queued
    assert engine.ran == 0
    seen: list[list[int]] = []

    def after_each_copy() -> None:
        complete = sorted(snapshot.complete_steps(tmp_path))
        for step in complete:
            _check(tmp_path, step)
        seen.append(complete)

    engine.run(each=after_each_copy)
    first = next(i for i, steps in enumerate(seen) if steps)
    assert all(seen[first:]), "a moment with no complete snapshot"
    assert [steps for i, steps in enumerate(seen) if i == 0 or steps != seen[i - 1]] == [
        [], [1], [1, 2], [2], [2, 3], [3], [3, 4]]  # a slot stops counting only while the other one counts
    snapshots.close()


def test_a_tensor_changed_during_the_device_copy_drops_that_snapshot(tmp_path: Path, engine: HostEngine) -> None:
    fabric = phalanx.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Linear(4, 4))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.lazy = True
    fabric.save_snapshot({"model": model, "optimizer": optimizer}, 1, tmp_path, every_n_steps=1)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # in place, outside optimizer.step(), before the copy ran
    with pytest.warns(UserWarning, match=r"Rank 0's snapshot was dropped: a parameter or optimizer state .* changed "
                                         r"in place outside optimizer.step\(\)"):
        fabric.save_snapshot({"model": model, "optimizer": optimizer}, 2, tmp_path, every_n_steps=1)
    engine.run()
    assert sorted(snapshot.complete_steps(tmp_path)) == [2]  # step 1 never counted
    fabric.remove_snapshots(tmp_path)


def test_auto_sets_the_slots_up_in_the_background_and_no_snapshot_pays_for_it(
        tmp_path: Path, engine: HostEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    costs: list[Cost] = []
    taken = Cadence.taken

    def record(self: Cadence, step: int, agree: Any = None, cost: Cost | None = None) -> str | None:
        if cost is not None:
            costs.append(cost)
        return taken(self, step, agree, cost)

    monkeypatch.setattr(Cadence, "taken", record)
    fabric = phalanx.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 8)))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
    weights: dict[int, list[torch.Tensor]] = {}
    for step in range(1, 41):
        fabric.backward(model(torch.randn(4, 8)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        weights[step] = [t.clone() for t in model.state_dict().values()]
        fabric.save_snapshot({"model": model, "optimizer": optimizer, "step": step}, step, tmp_path,
                             max_overhead=0.9)  # often, whatever this machine's timings
    entry = fabric._snapshots._folders[tmp_path]
    assert entry.writer is not None and entry.writer.path == "one copy" and entry.writer.setup_seconds > 0
    assert len(engine.registered) == 2  # every slot, before the first snapshot
    assert costs and costs[0] is not None and not any(c.one_time for c in costs)
    latest = fabric.latest_checkpoint(tmp_path)
    assert latest is not None
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": None}
    fabric.load(latest, state)
    assert latest == snapshot.reference(tmp_path, state["step"]) and len(costs) >= 3
    assert all(torch.equal(a, b) for a, b in zip(weights[state["step"]], model.state_dict().values(), strict=True))
    fabric.remove_snapshots(tmp_path)
    assert engine.registered == {} and not tmp_path.exists()


def test_a_larger_mapping_is_registered_only_after_the_smaller_one_was_unregistered(
        tmp_path: Path, engine: HostEngine) -> None:
    snapshots = RankSnapshots(tmp_path, 0, 1, keep=1)
    big = {"w": torch.zeros(1 << 16)}
    for step, state in enumerate([{"w": torch.zeros(16)}, big], start=1):
        snapshots.write(step, state, {}, lambda kind, obj, module: obj)
        snapshots.wait()
    kinds = [kind for kind, _ in engine.log]
    assert kinds == ["register", "unregister", "register"]
    assert engine.log[1][1] == engine.log[0][1]  # the first mapping's registration went first
    saved, _ = RankSnapshots(tmp_path, 0, 1, keep=1).read(2)
    assert torch.equal(saved["w"], big["w"])
    snapshots.close()
    assert engine.registered == {}


def test_a_registered_mapping_is_unregistered_when_its_slot_goes_and_at_exit(tmp_path: Path) -> None:
    # However the writer's use of a slot ends (closed, dropped after an exception, the interpreter exiting), its
    # registration is undone while the mapping is still there.
    undone: list[int] = []

    def pin(buffer: torch.Tensor) -> Callable[[], None]:
        return functools.partial(undone.append, buffer.data_ptr())

    slot = slots.Slot(tmp_path / "r00000-k0.data")
    slot.map(1 << 16, pin)
    assert slot.pinned and slot.buffer is not None
    address, finalizer = slot.buffer.data_ptr(), slot._unpin
    assert finalizer is not None and finalizer.atexit  # also at exit, before the modules go
    del slot
    gc.collect()
    assert undone == [address]


def test_a_refused_registration_falls_back_to_two_copies_and_says_why_once(tmp_path: Path,
                                                                          engine: HostEngine) -> None:
    engine.refuse = "cudaHostRegister refused 1 MiB: operation not permitted"
    snapshots = RankSnapshots(tmp_path, 0, 1)
    with pytest.warns(UserWarning, match=r"take two copies on rank 0 .* not one: cudaHostRegister refused 1 MiB: "
                                         r"operation not permitted"):
        _write(snapshots, 1)
    assert snapshots.path == "two copies"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        for step in (2, 3):
            _write(snapshots, step)
            snapshots._before_step()
    snapshots.wait()
    assert sorted(snapshot.complete_steps(tmp_path)) == [2, 3]
    _check(tmp_path, 3)
    snapshots.close()


def test_registration_refused_by_cuda_is_a_reason_not_an_error_on_a_machine_without_one() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert device.engine_for([torch.zeros(3)]) is None  # a host state takes the host path


# ---------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
def test_a_gpu_snapshot_is_one_copy_into_registered_memory_without_a_host_wait(tmp_path: Path) -> None:
    fabric = phalanx.Fabric(accelerator="cuda", devices=1)
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(64, 1024), nn.BatchNorm1d(1024), nn.ReLU(),
                                              nn.Linear(1024, 8)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    x = torch.randn(32, 64, device="cuda")

    def step() -> None:
        fabric.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()

    step()
    fabric.save_snapshot({"model": model, "optimizer": optimizer, "rng": torch.get_rng_state()}, 1, tmp_path,
                         every_n_steps=1)  # maps and registers the first slot
    step()
    fabric.save_snapshot({"model": model, "optimizer": optimizer, "rng": torch.get_rng_state()}, 2, tmp_path,
                         every_n_steps=1)
    step()
    entry = fabric._snapshots._folders[tmp_path]
    assert entry.writer is not None and entry.writer.path == "one copy"
    assert all(slot.pinned for slot in entry.writer._slots)
    expected = [t.detach().clone() for t in model.state_dict().values()]
    rng = torch.get_rng_state()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host wait for the device raises
    try:
        fabric.save_snapshot({"model": model, "optimizer": optimizer, "rng": rng}, 3, tmp_path, every_n_steps=1)
        for _ in range(3):
            step()  # the first waits for the copy on the device, not on the host
            entry.writer.poll()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    after = [t.detach().clone() for t in model.state_dict().values()]
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "rng": None}
    fabric.load(snapshot.reference(tmp_path, 3), state)
    assert not all(torch.equal(a, b) for a, b in zip(expected, after, strict=True))  # the steps went on
    assert all(torch.equal(a, b) for a, b in zip(expected, model.state_dict().values(), strict=True))
    assert torch.equal(state["rng"], rng)
    cadence = entry.cadence
    assert cadence.copy_seconds is not None and cadence.copy_seconds > 0
    slots_ = entry.writer._slots
    fabric.remove_snapshots(tmp_path)
    assert not any(slot.pinned for slot in slots_)


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_a_process_that_dies_of_an_exception_unregisters_its_slots_at_exit(tmp_path: Path) -> None:
    program = f"""
import torch, phalanx
from phalanx.checkpoint.snapshot import device
unregister = device._unregister
def said(*args):
    unregister(*args)
    print("unregistered", flush=True)
device._unregister = said
fabric = phalanx.Fabric(accelerator="cuda", devices=1)
model = fabric.setup_module(torch.nn.Linear(256, 256))
fabric.save_snapshot({{"model": model}}, 1, {str(tmp_path)!r}, every_n_steps=1)
raise RuntimeError("the training failed")
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": str(Path(phalanx.__file__).parents[1])})
    assert done.returncode == 1 and "the training failed" in done.stderr
    assert done.stdout.count("unregistered") == 1, done.stdout + done.stderr
    assert "CUDA error" not in done.stderr

