"""2-rank DDP jobs (real processes, gloo): equivalence with single-process training, gradient sync on
every call path, accumulation, collectives and checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from job_runner import JOBS, REPO, SUPPORT, run_job
from torch import nn

pytestmark = pytest.mark.timeout(240)

MODELS = SUPPORT / "ddp_models.py"  # the ``models`` fixture (conftest.py); the jobs import it too


def test_ddp_training_equals_single_process(tmp_path: Path, models: dict[str, object]) -> None:
    job = run_job(
        JOBS / "ddp_training.py",
        tmp_path,
    ).check()
    # Reference: one process, batches of 8 = the union of both ranks' batches of 4.
    model = models["make_model"]()  # type: ignore[operator]
    x, y = models["make_data"]()  # type: ignore[operator]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        for i in range(0, 32, 8):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i : i + 8]), y[i : i + 8]).backward()
            opt.step()
    expected = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    for rank in (0, 1):
        got = torch.tensor(job.reports[rank]["params"], dtype=torch.float64)
        assert torch.allclose(got, expected, atol=1e-6), (rank, (got - expected).abs().max())


DISTILL_JOB = JOBS / "ddp_distillation.py"


def test_distillation_call_paths_sync_gradients(tmp_path: Path, models: dict[str, object]) -> None:
    job = run_job(DISTILL_JOB, tmp_path).check()
    # Reference: the student's gradient on the concatenated batch (both ranks' 8 samples).
    model = models["Distill"]()  # type: ignore[operator]
    x, _ = models["make_data"]()  # type: ignore[operator]
    model.distill(x[:16]).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model["student"].parameters()]).double()
    for name in ("attribute", "item", "teacher_with_grad", "custom_method", "stale_reference"):
        g0 = torch.tensor(job.reports[0]["grads"][name], dtype=torch.float64)
        g1 = torch.tensor(job.reports[1]["grads"][name], dtype=torch.float64)
        assert torch.equal(g0, g1), f"{name}: gradients differ across ranks"
        assert torch.allclose(g0, expected, atol=1e-6), (name, (g0 - expected).abs().max())
    # Direct submodule calls are made correct, and the user is told once that overlap is lost.
    assert job.stderr.count("were computed without going through its DDP forward") == 1


def test_verify_in_sync_names_the_first_differing_parameter(tmp_path: Path, models: dict[str, object]) -> None:
    job = run_job(
        JOBS / "ddp_verify_in_sync.py",
        tmp_path,
    ).check()
    for rank in (0, 1):
        expected = "parameters differ across ranks: first differing tensor is '2.bias'"
        assert job.reports[rank]["error"].startswith(expected)


def test_accumulation_with_no_backward_sync(tmp_path: Path, models: dict[str, object]) -> None:
    job = run_job(
        JOBS / "ddp_accumulation_with_no_backward_sync.py",
        tmp_path,
    ).check()
    model = models["make_model"]()  # type: ignore[operator]
    x, y = models["make_data"]()  # type: ignore[operator]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        window = slice(step * 16, step * 16 + 16)
        torch.nn.functional.cross_entropy(model(x[window]), y[window]).backward()
        opt.step()
    expected = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    for rank in (0, 1):
        assert torch.allclose(torch.tensor(job.reports[rank]["params"], dtype=torch.float64), expected, atol=1e-6)
        assert "optimizer.step() was called while the gradients of Sequential are local" in job.reports[rank]["error"]


def test_collectives(tmp_path: Path) -> None:
    job = run_job(
        JOBS / "ddp_collectives.py",
        tmp_path,
    ).check()
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["mean"] == [1.5, 3.0] and rep["sum"] == [3.0, 6.0] and rep["max"] == [2.0, 4.0]
        assert rep["scalar"] == 9.0
        assert rep["gathered"] == [[1.0, 2.0], [2.0, 4.0]] and rep["nested"] == {"a": [[0.0], [1.0]]}
        assert rep["broadcast"] == {"from": 1, "data": [1, 1]}
        assert rep["ranks"] == [rank, rank, 0, 2, rank == 0]


def test_ddp_checkpoint_round_trip(tmp_path: Path, models: dict[str, object]) -> None:
    job = run_job(
        JOBS / "ddp_checkpoint_round_trip.py",
        tmp_path,
    ).check()
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["params"] == rep["loaded"] and rep["step"] == 3 and rep["same_opt"]
        assert rep["files"] == ["a.ckpt"]


@pytest.mark.slow  # CI: test_launch_matrix's launch_fn cells run fabric.launch(fn) and read its result
def test_launch_function_returns_rank_zero_result(tmp_path: Path) -> None:
    job = run_job(
        JOBS / "ddp_launch_function_returns_rank_zero_result.py",
        tmp_path,
    ).check()
    assert "result 21.0" in job.stdout


def test_phalanx_run_cli(tmp_path: Path) -> None:
    job = run_job(
        JOBS / "ddp_phalanx_run_cli.py",
        tmp_path,
        command=[sys.executable, "-m", "phalanx.cli", "run", "--devices", "2", "--precision", "bf16-mixed"],
    ).check()
    assert job.reports[0] == job.reports[1] == {"world": 2, "precision": "bf16-mixed", "strategy": "ddp"}


@pytest.mark.slow
def test_main_example_runs(tmp_path: Path) -> None:
    job = run_job(
        (REPO / "examples" / "fabric_digits.py").read_text(),
        tmp_path,
        args=("--epochs", "15", "--out", str(tmp_path / "out")),
        timeout=200,
    ).check()
    accuracy = float(job.stdout.split("validation accuracy ")[1].split("%")[0])
    assert accuracy >= 95.0, job.stdout
    ckpt = torch.load(tmp_path / "out" / "last.ckpt", weights_only=False)
    assert ckpt["epoch"] == 15 and isinstance(nn.Linear(1, 1).load_state_dict, object)


def test_clip_gradients_and_init_module(tmp_path: Path, models: dict[str, object]) -> None:
    job = run_job(
        JOBS / "ddp_clip_gradients_and_init_module.py",
        tmp_path,
    ).check()
    model = models["make_model"]()  # type: ignore[operator]
    x, y = models["make_data"]()  # type: ignore[operator]
    torch.nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item()
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["norm"] == pytest.approx(expected, rel=1e-5)  # the norm of the averaged gradient
        assert rep["clipped"] == pytest.approx(0.01, rel=1e-4)
        assert rep["created_dtype"] == "torch.float64"
