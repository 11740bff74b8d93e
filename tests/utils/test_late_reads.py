"""No host read of a device value in the steady-state step (phalanx.utils.late_reads and its users).

On a CPU-only machine the proof is a count: with ``PHALANX_DEFER_HOST_READS=1`` the code that reads CPU values at
once but defers them on a GPU takes its GPU path, and :class:`host_reads.HostReads` counts the reads phalanx's own
files make (``item``, ``float``, ``bool``, ``int``, ``tolist``, ``numpy``, ``cpu``). A Trainer fit with everything
users combine, and a Fabric loop, on every strategy (tests/support/host_reads_job.py), may read once per
``log_every_n_steps`` (the loggers' batch) and nowhere else. On a GPU, ``bench/gpu_check.sh`` counts the real
synchronizations with torch's sync debug mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from host_reads import HostReads
from job_runner import SUPPORT, run_job
from run_if import run_if

from phalanx.distributed.preemption import AGREEMENT_LAG, PreemptionSignals
from phalanx.trainer.loss_check import LossCheck
from phalanx.utils.late_reads import DEFER_VARIABLE, LateRead, defers_host_reads

JOB = SUPPORT / "host_reads_job.py"
FIRST, LAST, LOG_EVERY = 12, 52, 10  # as in the job


def test_a_late_read_on_the_cpu_is_the_value_itself() -> None:
    values = torch.tensor([1.5, float("nan")])
    read = LateRead(values)
    assert read.ready()
    assert read.values()[0] == 1.5 and read.values()[1] != read.values()[1]


def test_the_switch_sends_cpu_values_down_the_late_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEFER_VARIABLE, raising=False)
    assert not defers_host_reads(torch.device("cpu"))
    assert defers_host_reads(torch.device("cuda", 0))
    monkeypatch.setenv(DEFER_VARIABLE, "1")
    assert defers_host_reads(torch.device("cpu"))


@pytest.mark.parametrize("defer", [False, True], ids=["read-at-once", "read-late"])
def test_the_counter_sees_a_read_phalanx_makes(monkeypatch: pytest.MonkeyPatch, defer: bool) -> None:
    # The loss check reads each window's loss at once on a CPU: the counter must see that read (so it can see
    # any), and none once the check takes its late path.
    monkeypatch.setenv(DEFER_VARIABLE, "1" if defer else "0")
    check = LossCheck(torch.device("cpu"), rows=4, rank=None)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    counter = HostReads()
    counter.active = True
    with counter:
        for step in range(10):
            check.window([(step, torch.tensor(1.0))], 0, step, optimizer)
    if defer:
        assert counter.reads == {}
    else:
        assert counter.reads == {f"trainer/loss_check.py:{_line('value = losses[0][1].item()')} (item)": 10}


def _line(text: str) -> int:
    source = (Path(__file__).parents[2] / "src" / "phalanx" / "trainer" / "loss_check.py").read_text().splitlines()
    return next(i for i, line in enumerate(source, 1) if text in line)


def test_the_preemption_agreement_read_late_answers_at_the_same_call_on_every_rank() -> None:
    # Two ranks; rank 1 is signalled before its 5th call. Each call starts an agreement (a max over ranks) and
    # reads the one started AGREEMENT_LAG calls earlier: both stop at call 5 + AGREEMENT_LAG, with rank 1 named.
    ranks = [PreemptionSignals(["SIGTERM"]), PreemptionSignals(["SIGTERM"])]
    started: dict[int, list[list[int]]] = {}

    class Agreement(LateRead):
        def __init__(self, call: int) -> None:
            super().__init__(torch.zeros(2))
            self.call = call

        def values(self) -> list[int]:
            both = started[self.call]
            return [max(a, b) for a, b in zip(*both)]

    stops: list[list[int]] = [[], []]
    for call in range(1, 12):
        if call == 5:
            ranks[1]._on_signal(15, None)
        for rank, signals in enumerate(ranks):
            def start(mine: list[int], call: int = call) -> LateRead:
                started.setdefault(call, []).append(mine)
                return Agreement(call)

            stop = signals.agree_late(rank, 2, start)
            if stop is not None:
                stops[rank].append(call)
                assert stop.describe() == "SIGTERM on rank 1"
    assert stops[0] == stops[1] and stops[0][0] == 5 + AGREEMENT_LAG


def _reads(tmp_path: Path, strategy: str, devices: int, part: str = "both",
           accelerator: str = "cpu") -> dict[int, dict[str, dict[str, int]]]:
    job = run_job(JOB, tmp_path, args=(strategy, str(devices), part, accelerator), timeout=240,
                  env={DEFER_VARIABLE: "1", "OMP_NUM_THREADS": "1"}).check()
    return {rank: {k: v for k, v in report.items() if k.startswith(("in_", "syncs_"))}
            for rank, report in job.reports.items()}


def _assert_steady(reports: dict[int, dict[str, dict[str, int]]], devices: int) -> None:
    assert sorted(reports) == list(range(devices))
    for reads in reports.values():
        if "in_trainer" in reads:
            trainer = reads["in_trainer"]
            # One batched read per logger flush (steps 20, 30, 40, 50), nothing else.
            assert sum(trainer.values()) <= (LAST - FIRST) // LOG_EVERY, trainer
            assert all(where.startswith("trainer/logger_connector.py") for where in trainer), trainer
        if "in_fabric" in reads:
            assert reads["in_fabric"] == {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("strategy", "devices"), [("auto", 1), ("ddp", 2), ("fsdp", 2)])
def test_no_host_read_in_the_steady_state_step(tmp_path: Path, strategy: str, devices: int) -> None:
    _assert_steady(_reads(tmp_path, strategy, devices), devices)


@pytest.mark.timeout(600)
@run_if(deepspeed=True)
@pytest.mark.parametrize("part", ["trainer", pytest.param("fabric", marks=pytest.mark.slow)])  # Fabric: ddp/fsdp above
def test_no_host_read_in_the_steady_state_step_under_deepspeed(tmp_path: Path, part: str) -> None:
    _assert_steady(_reads(tmp_path, "deepspeed", 2, part), 2)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_no_device_synchronization_in_the_steady_state_step_on_a_gpu(tmp_path: Path) -> None:
    # The same job on a GPU, where torch's sync debug mode sees every synchronization, torch's own included.
    reports = _reads(tmp_path, "auto", 1, "both", "cuda")
    _assert_steady(reports, 1)
    syncs = reports[0]
    assert sum(syncs["syncs_trainer"].values()) <= (LAST - FIRST) // LOG_EVERY, syncs
    assert syncs["syncs_fabric"] == {}, syncs


@pytest.mark.gpu
def test_a_late_read_on_a_gpu_arrives_without_a_wait() -> None:
    values = torch.tensor([1.0, float("inf")], device="cuda") * 2
    torch.cuda.set_sync_debug_mode("error")
    try:
        read = LateRead(values)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert read.values() == [2.0, float("inf")] and read.ready()
