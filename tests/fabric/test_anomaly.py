"""A nan/inf loss in a Fabric loop is never silent: a warning names the rank and the backward call within a
few steps, with no per-step device synchronisation; ``warn_nonfinite_loss=False`` turns it off."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from job_runner import JOBS, run_job
from torch import nn

from phalanx import Fabric
from phalanx.errors import PhalanxWarning
from phalanx.fabric.anomaly import LOSS_CHECK_EVERY, LossWatch
from phalanx.utils.late_reads import LateRead

pytestmark = pytest.mark.timeout(240)


def train(fabric: Fabric, steps: int, bad_step: int | None) -> list[warnings.WarningMessage]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen: list[warnings.WarningMessage] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, steps + 1):
            x = torch.randn(4, 3)
            if step == bad_step:
                x[0, 0] = float("inf")
            fabric.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        fabric.teardown()
    seen = [w for w in caught if issubclass(w.category, PhalanxWarning)]
    return seen


def test_nonfinite_loss_warns_naming_rank_and_call() -> None:
    found = train(Fabric(accelerator="cpu", devices=1), steps=8, bad_step=3)
    assert len(found) == 1, [str(w.message) for w in found]
    message = str(found[0].message)
    assert message.startswith("rank 0: the loss passed to fabric.backward is nan/inf at backward call #3")
    assert "warn_nonfinite_loss=False" in message and "detect_anomaly=True" in message


def test_reported_within_a_few_steps() -> None:
    """Losses that are not CPU scalars (a GPU's) are checked together every LOSS_CHECK_EVERY calls."""
    watch = LossWatch(lambda: 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch.record(torch.tensor([float("nan"), 1.0]))
        for _ in range(LOSS_CHECK_EVERY - 1):
            assert not caught
            watch.record(torch.ones(2))
    assert len(caught) == 1 and "backward call #1" in str(caught[0].message)


def test_a_short_run_is_checked_at_teardown() -> None:
    found = train(Fabric(accelerator="cpu", devices=1), steps=2, bad_step=2)
    assert len(found) == 1 and "backward call #2" in str(found[0].message)


def test_finite_losses_and_opt_outs_say_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert train(Fabric(accelerator="cpu", devices=1), steps=9, bad_step=None) == []
    assert train(Fabric(accelerator="cpu", devices=1, warn_nonfinite_loss=False), steps=9, bad_step=2) == []
    monkeypatch.setenv("PHALANX_WARN_NONFINITE_LOSS", "0")
    assert train(Fabric(accelerator="cpu", devices=1), steps=9, bad_step=2) == []


def test_no_host_read_on_the_per_step_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between checks, recording a loss that is not a CPU scalar (a GPU's) reads nothing from its device (no
    .item(), bool(), .tolist()): a GPU is never waited for in the loop."""
    watch = LossWatch(lambda: 0, every=LOSS_CHECK_EVERY)
    losses = [torch.full((2,), float(i)) for i in range(LOSS_CHECK_EVERY - 1)]

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the per-step path read a value from the device")

    for name in ("item", "tolist", "__bool__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for loss in losses:
        watch.record(loss)
    monkeypatch.undo()
    watch.flush()
    assert not watch.reported


class _Event:
    """A CUDA event that has not been reached yet, until ``done``."""

    def __init__(self) -> None:
        self.done = False
        self.synchronized = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized = True


def test_device_results_are_read_only_once_ready() -> None:
    """On a GPU the check's result is read at a later check, once its event says it arrived; never waited for
    in the loop (only at teardown)."""
    watch = LossWatch(lambda: 0, every=2)
    event = _Event()
    read = LateRead(torch.tensor([0.5, float("inf")]))
    read._event = event  # as a copy to pinned memory on a GPU is: on its way until the event says so
    watch._inflight.append((read, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch._poll(block=False)
        assert not caught and not event.synchronized  # not there yet: the loop goes on
        event.done = True
        watch._poll(block=False)
    assert len(caught) == 1 and "backward call #2" in str(caught[0].message)


@pytest.mark.gpu
def test_gpu_loop_never_synchronizes_and_still_reports() -> None:
    fabric = Fabric(accelerator="cuda", devices=1)
    model = nn.Linear(3, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    xs = [torch.randn(4, 3, device="cuda") for _ in range(12)]
    xs[4][0, 0] = float("nan")
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("error")  # any device sync in the loop raises
        try:
            for x in xs:
                fabric.backward(model(x).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        fabric.teardown()
    found = [str(w.message) for w in caught if issubclass(w.category, PhalanxWarning)]
    assert len(found) == 1 and "rank 0: the loss passed to fabric.backward is nan/inf at backward call #5" in found[0]


JOB = JOBS / "loss_watch.py"


def test_two_ranks(tmp_path: Path) -> None:
    job = run_job(JOB, tmp_path).check()
    for rank in (0, 1):
        assert job.reports[rank]["rng_untouched"] is True
        refused = job.reports[rank]["unmanaged"]
        assert refused is not None and "this job runs 2 processes" in refused
        assert job.reports[rank]["steps"] == 8
    assert "rank 1: the loss passed to fabric.backward is nan/inf at backward call #3" in job.stderr
    # Rank 0's own loss was finite at call #3; the averaged nan gradients reach its weights at the step after.
    assert "rank 0: the loss passed to fabric.backward is nan/inf at backward call #3" not in job.stderr
    assert "rank 0: the loss passed to fabric.backward is nan/inf at backward call #4" in job.stderr
