"""2-rank Trainer jobs (real processes, gloo): DDP == single process, accumulation on every strategy,
exact validation over uneven shards, and the LR finder leaving no trace before a DDP fit."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from job_runner import JOBS, run_job
from run_if import run_if
from trainer_support import Regressor, flat, loader, quiet

import phalanx

pytestmark = pytest.mark.timeout(240)

FIT_JOB = JOBS / "trainer_fit.py"


def test_ddp_fit_equals_single_process_fit(tmp_path: Path) -> None:
    job = run_job(FIT_JOB, tmp_path).check()
    # The same run on one process with the concatenated batches (2 ranks x 4 = 8 per step).
    phalanx.seed_everything(7)
    trainer = phalanx.Trainer(devices=1, max_epochs=2, **quiet())
    model = Regressor(optimizer="adam", lr=0.01)
    trainer.fit(model, loader(64, 8, shuffle=True), loader(37, 8))
    reference = flat(model)
    for rank in (0, 1):
        report = job.reports[rank]
        assert report["steps"] == trainer.global_step == 16
        torch.testing.assert_close(torch.tensor(report["params"], dtype=torch.float64), reference, rtol=0, atol=1e-10)
    # callback_metrics are identical on every rank and equal the single-process values (exact epoch
    # means over all samples, the validation set split 19/18 without padding).
    assert job.reports[0]["metrics"] == job.reports[1]["metrics"]
    single = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert set(job.reports[0]["metrics"]) == set(single)
    for key in ("train_loss_epoch", "val_mae", "val_abs_sum", "val_max"):
        assert job.reports[0]["metrics"][key] == pytest.approx(single[key], rel=1e-12), key
    # And the validation numbers are the exact ones, computed directly over the 37 samples.
    x, y = loader(37, 37).dataset.tensors
    with torch.no_grad():
        err = (model(x) - y).abs()
    assert single["val_mae"] == pytest.approx(float(err.mean()), rel=1e-12)
    assert single["val_abs_sum"] == pytest.approx(float(err.sum()), rel=1e-12)
    assert single["val_max"] == pytest.approx(float(err.max()), rel=1e-12)
    # trainer.test(other_model) after fit tested the other model, on every sample once, and left both alone.
    other = Regressor()
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(0.25)
        expected = float((other(x) - y).abs().mean())
    for rank in (0, 1):
        report = job.reports[rank]
        assert report["other_test"] == pytest.approx(expected, rel=1e-6)
        assert report["other_params"] == flat(other).tolist() and report["same_params"] == report["params"]


ACCUM_JOB = JOBS / "trainer_accumulation.py"


def _manual_accumulation_reference() -> torch.Tensor:
    """Large-batch SGD by hand: each window's update uses the mean loss over all its samples."""
    torch.manual_seed(0)
    model = Regressor()
    x, y = loader(40, 40).dataset.tensors
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.97**s)
    for _epoch in range(2):
        for start, size in ((0, 16), (16, 16), (32, 8)):  # 10 batches of 4 -> windows of 4, 4 and 2 batches
            opt.zero_grad()
            nn_loss = torch.nn.functional.mse_loss(model(x[start : start + size]), y[start : start + size])
            nn_loss.backward()
            opt.step()
            sched.step()
    return flat(model)


# FSDP's accumulation in CI: test_combinations[fsdp-bf16-mixed] (counts, hooks and a resume); here in slow.
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=[run_if(fsdp=True), pytest.mark.slow])])
def test_accumulation_counts_and_parameters(tmp_path: Path, strategy: str) -> None:
    job = run_job(ACCUM_JOB, tmp_path, args=(strategy,)).check()
    trainer = phalanx.Trainer(devices=1, max_epochs=2, accumulate_grad_batches=4, **quiet())
    model = Regressor()
    trainer.fit(model, loader(40, 4))
    expected_counts = {"before_step": 6, "optimizer_step": 6, "scheduler": 6, "train_batches": 20}
    assert model.counts == expected_counts
    assert model.opt.steps == 6 and trainer.global_step == 6
    reference = _manual_accumulation_reference()
    torch.testing.assert_close(flat(model), reference, rtol=0, atol=1e-12)
    for rank in (0, 1):
        report = job.reports[rank]
        assert report["counts"] == expected_counts, (strategy, rank)
        assert report["opt_steps"] == 6 and report["global_step"] == 6
        torch.testing.assert_close(torch.tensor(report["params"], dtype=torch.float64), reference, rtol=0, atol=1e-10)


LR_FIND_JOB = JOBS / "trainer_lr_find.py"


@run_if(executable="phalanx")
def test_lr_finder_then_ddp_fit_via_phalanx_run(tmp_path: Path) -> None:
    exe = shutil.which("phalanx") or str(Path(sys.executable).with_name("phalanx"))
    job = run_job(LR_FIND_JOB, tmp_path, command=[exe, "run", "--devices", "2", "--strategy", "ddp"]).check()
    r0, r1 = job.reports[0], job.reports[1]
    assert r0["world"] == 2
    for r in (r0, r1):
        assert all(r["probe_equal"].values()), r["probe_equal"]
        assert r["probe_points"] >= 3
        assert r["suggestion"] is not None and r["lr"] == r["suggestion"] == r0["suggestion"]
        assert r["opt_lr"] == r["lr"]  # the fit's optimizer was rebuilt with the suggestion
        assert r["devices"] == [r["device"]]  # accumulators on fabric.device after the search
    assert r0["val_mae"] == r1["val_mae"]
    assert (tmp_path / "lr_find.png").stat().st_size > 1000
    # Probe fits on every rank, in step: the same learning rates, scores and verdict, and no trace.
    assert len(r0["probe_lrs"]) >= 2 and r0["probe_suggestion"] in r0["probe_lrs"]
    for key in ("probe_lrs", "probe_scores", "probe_suggestion"):
        assert r1[key] == r0[key]
    assert all(r[key] for r in (r0, r1) for key in ("probe_model_same", "probe_rng_same"))
    assert Path(r0["best"]).is_file()


SEED_JOB = JOBS / "trainer_seed.py"


def test_ranks_seeded_differently_still_shard_one_permutation(tmp_path: Path) -> None:
    """The samplers' seed is rank 0's torch seed, broadcast (no environment variable): every sample is
    read exactly once per epoch, and the order is the one rank 0's seed gives."""
    from phalanx.trainer.loaders import TrainSampler

    reps = run_job(SEED_JOB, tmp_path).check().reports
    permutation = torch.randperm(16, generator=torch.Generator().manual_seed(100)).tolist()  # DistributedSampler's
    for rank in (0, 1):
        assert reps[rank]["fabric_order"] == permutation[rank::2]
        assert reps[rank]["trainer_order"] == list(TrainSampler(16, 2, rank, shuffle=True, seed=100))
    assert sorted(reps[0]["trainer_order"] + reps[1]["trainer_order"]) == list(range(16))


SECOND_FABRIC_JOB = JOBS / "trainer_second_fabric.py"


def test_a_second_fabric_in_the_same_processes_takes_the_group_over(tmp_path: Path) -> None:
    """A script that builds a second Trainer or Fabric after the first (fit, then a new Trainer that
    resumes or tests) reuses the process group instead of failing with "already initialized"; the
    first one then refuses collectives, saying which Fabric to use; different settings are refused."""
    job = run_job(SECOND_FABRIC_JOB, tmp_path).check()
    for rank in (0, 1):
        got = job.reports[rank]
        assert (got["one"], got["two"], got["three"]) == (1.0, 3.0, 2.0)
        assert got["stale"].startswith("This Fabric's process group was taken over by a Fabric (or Trainer) created")
        assert "guard_timeout: 15.0 then 3.0" in got["differs"], got["differs"]
