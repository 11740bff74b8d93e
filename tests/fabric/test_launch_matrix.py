"""The combination tier's launch axis: every strategy, given as a string and as an object, through every
way a job starts, in 32-true and bf16-mixed.

``Fabric(strategy=FSDPStrategy(...)).launch(fn)`` once died before any rank started (a lambda on the
strategy could not be pickled into the new processes) while every combination test passed: they all
named their strategy with a string. Each cell here is (strategy, form, precision) run for real on two
CPU ranks (gloo) through one launch path:

* ``launch``: ``fabric.launch()``, the script re-runs itself in two processes;
* ``launch_fn``: ``fabric.launch(fn)``, the Fabric's arguments (the strategy object) and ``fn`` are
  pickled into two new processes; so is every later cell's strategy object, configured by a Fabric in
  the launching process and sent as one of fn's arguments;
* ``cli``: ``phalanx run --devices 2 job.py``;
* ``torchrun``: ``python -m torch.distributed.run --nproc-per-node 2 job.py``;
* ``trainer``: ``phalanx.Trainer(devices=2, strategy=...)`` with a small ``phalanx.Module``.

Each cell checks that the losses are finite and the same on every rank, that the full (gathered)
parameters are identical across ranks after training (and, in 32-true, equal to one process training
on the concatenated data-parallel batches), and an exact save/load round trip: ``fabric.save``, two
more steps, zeroed parameters, ``fabric.load`` restores the saved parameters bit for bit and the two
steps repeat bit for bit. Trainer: ``trainer.save_checkpoint``, then a new Trainer's
``fit(ckpt_path=...)`` restores a fresh module bit for bit (and trains no further: the fit had ended)
with the same validation loss, and a third Trainer's ``validate(ckpt_path=...)`` loads the weights alone.

Process start-up dominates, so one job runs several cells in the same processes: a later Fabric (or
Trainer) takes over the first one's process group at its ``launch()`` (docs/fabric.md, "A second
Fabric"). The CI tier runs one job per launch path: every strategy in both forms, and on every launch
path both forms and both precisions; the rest of the matrix is ``slow`` (``PHALANX_TEST_ALL=1``).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from job_runner import JOBS, run_job

from phalanx.strategies import available_strategies

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAS_FSDP = "fsdp" in available_strategies()
RUN_ALL = os.environ.get("PHALANX_TEST_ALL") == "1"

STRATEGIES = ("ddp", "fsdp", "model_parallel", "deepspeed_stage_2", "deepspeed_stage_3")
FORMS = ("str", "obj")
PRECISIONS = ("32-true", "bf16-mixed")
LAUNCHES = ("launch", "launch_fn", "cli", "torchrun", "trainer")

# ---------------------------------------------------------------------------------------------- the job
# argv: <launch path> <cell> [<cell> ...], a cell being "strategy,form,precision". Every cell runs in the
# same two processes, one after the other; each reports under its own key.
JOB = JOBS / "launch_matrix.py"


def _command(launch: str) -> list[str] | None:
    if launch == "cli":
        return [sys.executable, "-m", "phalanx.cli", "run", "--devices", "2"]
    if launch == "torchrun":
        # --standalone: a free port for the rendezvous (parallel test workers must not share 29500)
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return None


def _missing(cell: str) -> str | None:
    """Why ``cell`` cannot run here, or None."""
    name = cell.split(",")[0]
    if name in ("fsdp", "model_parallel") and not HAS_FSDP:
        return "FSDP2 on CPU needs torch >= 2.7"
    if name.startswith("deepspeed") and not HAS_DEEPSPEED:
        return "DeepSpeed is not installed"
    return None


def _check(job: Any, launch: str, cells: list[str]) -> None:
    """Assert every cell's results."""
    assert sorted(job.reports) == [0, 1], job.output[-4000:]
    if launch == "launch_fn":
        assert "result 0" in job.stdout, job.output[-4000:]  # fn's return value, from rank 0
    expected_class = {"ddp": "DDPStrategy", "fsdp": "FSDPStrategy", "model_parallel": "ModelParallelStrategy",
                      "deepspeed_stage_2": "DeepSpeedStrategy", "deepspeed_stage_3": "DeepSpeedStrategy"}
    for cell in cells:
        name, _, precision = cell.split(",")
        zero, one = (job.reports[rank].get(cell) for rank in (0, 1))
        assert zero is not None and one is not None, f"{cell}: a rank did not report\n{job.output[-4000:]}"
        errors = [report["error"] for report in (zero, one) if "error" in report]
        assert not errors, f"{cell} failed: {errors}\n{job.output[-6000:]}"
        assert zero["strategy"] == one["strategy"] == {
            "class": expected_class[name], "precision": precision, "world": 2,
            "mesh": [1, 2] if name == "model_parallel" else None,
        }, cell
        losses = zero["losses"]
        assert losses and all(math.isfinite(v) for v in losses), f"{cell}: losses {losses}"
        assert one["losses"] == losses, f"{cell}: losses differ across ranks: {losses} vs {one['losses']}"
        assert one["params"] == zero["params"], f"{cell}: parameters differ across ranks after training"
        assert all(math.isfinite(v) for v in zero["params"]), cell
        for report in (zero, one):
            assert report["restored_equal"], f"{cell}: the load did not restore the saved parameters exactly"
        if launch == "trainer":
            # 24 samples in batches of 4 per data-parallel replica; the resumed fit had nothing left to do
            assert zero["steps"] == one["resumed_steps"] == (6 if name == "model_parallel" else 3), cell
            for report in (zero, one):
                assert report["revalidate"] == report["validate"] == zero["validate"], cell
            weights = [report["weights_only"] for report in (zero, one)]
            errors = [w["error"] for w in weights if "error" in w]
            assert not errors, f"{cell}: validate(ckpt_path=...) failed: {errors}"
            assert all(w["equal"] and w["validate"] == zero["validate"] for w in weights), f"{cell}: {weights}"
            continue
        assert zero["shards"] == ({"num_replicas": 1, "rank": 0} if name == "model_parallel"
                                  else {"num_replicas": 2, "rank": 0}), cell
        for report in (zero, one):
            assert report["step"] == 3, cell
            # the optimizer state came back too: the two steps after the load repeat those after the save
            assert report["resumed"] == report["continued"], f"{cell}: {report['resumed']} != {report['continued']}"
        if precision == "32-true":  # the same run as one process on the concatenated data-parallel batches
            assert zero["ref_error"] < 1e-5 and one["ref_error"] < 1e-5, f"{cell}: {zero['ref_error']}"
            assert losses == pytest.approx(zero["ref_losses"], rel=1e-5, abs=1e-6), cell


def _run(tmp_path: Path, launch: str, cells: list[str], timeout: float) -> None:
    """Run the cells that can run here in one job; cells that cannot (a backend missing) are named in a
    skip once the others passed, so a missing DeepSpeed never hides the FSDP cells of the same job."""
    missing = [f"{cell} ({_missing(cell)})" for cell in cells if _missing(cell)]
    cells = [cell for cell in cells if not _missing(cell)]
    if not cells:
        pytest.skip("not run: " + "; ".join(missing))
    job = run_job(JOB, tmp_path, args=(launch, *cells), command=_command(launch), timeout=timeout).check()
    _check(job, launch, cells)
    if missing:
        pytest.skip(f"{len(cells)} cells passed; not run: " + "; ".join(missing))


# ------------------------------------------------------------------------------------------- the tiers
# CI: one job per launch path. Together every strategy in both forms, every launch path with both forms
# and both precisions. DeepSpeed's first cell in a process costs ~5-9 s (import, engine), so all four
# DeepSpeed cells share one job: launch(fn), where the objects are pickled. The regression (an FSDP or a
# ModelParallel object through launch(fn); their lambdas sat in __init__ and in bf16-mixed's plugin) is here.
CI_CELLS: dict[str, list[str]] = {
    "launch": ["ddp,obj,bf16-mixed", "fsdp,str,32-true", "model_parallel,str,bf16-mixed"],
    "launch_fn": ["fsdp,obj,bf16-mixed", "model_parallel,obj,bf16-mixed",
                  "deepspeed_stage_2,obj,32-true", "deepspeed_stage_3,obj,bf16-mixed",
                  "deepspeed_stage_2,str,bf16-mixed", "deepspeed_stage_3,str,32-true"],
    "cli": ["ddp,str,32-true", "fsdp,obj,bf16-mixed"],
    "torchrun": ["model_parallel,obj,32-true", "ddp,str,bf16-mixed"],
    "trainer": ["model_parallel,obj,bf16-mixed", "fsdp,str,32-true"],
}


def _all_cells() -> list[str]:
    return [f"{s},{f},{p}" for s in STRATEGIES for f in FORMS for p in PRECISIONS]


def _slow_groups() -> list[Any]:
    """The rest of the matrix: per launch path, one job for the torch strategies and one for DeepSpeed
    (a missing DeepSpeed skips only that one)."""
    params = []
    for launch in LAUNCHES:
        rest = [cell for cell in _all_cells() if cell not in CI_CELLS[launch]]
        for family, deepspeed in (("torch", False), ("deepspeed", True)):
            cells = [cell for cell in rest if cell.startswith("deepspeed") == deepspeed]
            if cells:
                params.append(pytest.param(launch, cells, id=f"{launch}-{family}"))
    return params


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launch", LAUNCHES)
def test_launch_path_ci_cells(tmp_path: Path, launch: str) -> None:
    _run(tmp_path, launch, CI_CELLS[launch], timeout=220)


@pytest.mark.slow
@pytest.mark.skipif(not RUN_ALL, reason="the full launch matrix runs with PHALANX_TEST_ALL=1")
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("launch", "cells"), _slow_groups())
def test_launch_path_full_matrix(tmp_path: Path, launch: str, cells: list[str]) -> None:
    _run(tmp_path, launch, cells, timeout=400)


def test_the_tiers_cover_the_matrix() -> None:
    """CI: every strategy in both forms; every launch path with both forms and both precisions. CI and slow
    together: the whole matrix on every launch path, each cell once."""
    assert set(CI_CELLS) == set(LAUNCHES)
    ci = [cell.split(",") for group in CI_CELLS.values() for cell in group]
    assert {(name, form) for name, form, _ in ci} == {(s, f) for s in STRATEGIES for f in FORMS}
    for launch, group in CI_CELLS.items():
        assert {cell.split(",")[1] for cell in group} == set(FORMS), launch
        assert {cell.split(",")[2] for cell in group} == set(PRECISIONS), launch
    slow: dict[str, list[str]] = {launch: [] for launch in LAUNCHES}
    for param in _slow_groups():
        launch, cells = param.values
        slow[launch] += cells
    for launch in LAUNCHES:
        assert sorted(slow[launch] + CI_CELLS[launch]) == sorted(_all_cells()), launch
