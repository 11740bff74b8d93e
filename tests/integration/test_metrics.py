"""torchmetrics with the Trainer: Metric objects logged (Lightning's semantics), exact and identical
on every rank, untouched by the LR finder (seed 002's class of bug), and restored across resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchmetrics")  # metric_models imports it: a mark cannot skip a module that fails to import

from interrupts import Interrupt, StopAt
from job_runner import JOBS, run_job
from metric_models import Classifier, loader, metric_report
from run_if import run_if
from trainer_support import flat, quiet

import phalanx
from phalanx.loggers import Logger
from phalanx.tuner.lr_find import Tuner
from phalanx.utils.errors import MisconfigurationError


def _fit(style: str, lr_find: bool, **trainer_kwargs: Any) -> tuple[Any, Classifier]:
    phalanx.seed_everything(3)
    trainer = phalanx.Trainer(max_epochs=2, **quiet(**trainer_kwargs))
    model = Classifier(style)
    if lr_find:
        states = [getattr(model.train_acc, name) for name in model.train_acc._defaults]
        counts = model.batch_sizes
        Tuner(trainer).lr_find(model, train_dataloaders=loader(64, 8, shuffle=True), num_training=12,
                               min_lr=1e-4, max_lr=1.0, update_attr=False)
        # Nothing of the search is left: metric state (same tensors, same device), counters, attributes.
        assert model.train_acc._update_count == 0 and model.train_acc._forward_cache is None
        assert all(getattr(model.train_acc, n) is s for n, s in zip(model.train_acc._defaults, states))
        assert all(int(s.sum()) == 0 for s in states)
        assert model.samples_seen == 0 and model.batch_sizes == [] and model.batch_sizes is counts
    trainer.fit(model, loader(64, 8, shuffle=True), loader(37, 8))
    return trainer, model


@pytest.mark.parametrize("style", ["manual", "object"])
def test_lr_find_leaves_metric_state_and_attributes_untouched(style: str) -> None:
    """Seed 002's class of bug with a real metrics library: the search's training steps update the
    Metric (and plain attributes); before the fix their state leaked into epoch 0 of the fit."""
    plain_trainer, plain_model = _fit(style, lr_find=False)
    tuned_trainer, tuned_model = _fit(style, lr_find=True)
    assert torch.equal(flat(tuned_model), flat(plain_model))
    plain, tuned = metric_report(plain_trainer, plain_model), metric_report(tuned_trainer, tuned_model)
    assert tuned == plain
    assert plain["samples_seen"] == 128 and plain["n_batches"] == 16


def test_snapshot_restores_every_kind_of_module_state() -> None:
    from phalanx.core.module_state import ModuleRestorePoint

    model = Classifier()
    model.generator = torch.Generator().manual_seed(5)  # type: ignore[assignment]
    model.table = {"a": [torch.ones(2)], "n": 1}  # type: ignore[assignment]
    model.register_buffer("scratch", torch.zeros(3), persistent=False)
    before = (model.generator.get_state().clone(), torch.randn(3, generator=model.generator))
    model.generator.set_state(before[0])
    buffer = model.scratch
    snapshot = ModuleRestorePoint(model)
    model.train_acc(torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0]))
    model.val_metrics(torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0]))
    model.scratch.add_(7)
    model.table["a"][0].add_(1)
    model.table["n"] = 2
    model.extra = 3  # type: ignore[assignment]
    model.samples_seen = 10
    model.eval()
    torch.randn(5, generator=model.generator)
    with torch.no_grad():
        model.net[0].weight.mul_(2)
    snapshot.restore()
    assert model.train_acc._update_count == 0 and model.val_metrics["recall"]._update_count == 0
    assert int(model.train_acc.tp.sum()) == 0 and model.train_acc._forward_cache is None
    assert model.scratch is buffer and int(model.scratch.sum()) == 0
    assert torch.equal(model.table["a"][0], torch.ones(2))
    assert model.table["n"] == 1 and not hasattr(model, "extra") and model.samples_seen == 0 and model.training
    assert torch.equal(torch.randn(3, generator=model.generator), before[1])
    assert torch.equal(model.net[0].weight, Classifier().net[0].weight)


# ---------------------------------------------------------------------- Metric objects logged
class Rows(Logger):
    def __init__(self) -> None:
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


def test_logged_metric_objects_follow_lightning_semantics() -> None:
    """on_step: the metric's forward value (this batch); on_epoch: compute() over the epoch, then
    reset(); a MetricCollection through log_dict; sync_dist/reduce_fx do not reduce a second time."""
    rows = Rows()
    trainer, model = _fit("object", lr_find=False, logger=rows, log_every_n_steps=1)
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert {"train_acc_step", "train_acc_epoch", "train_acc", "val_acc", "val_f1", "val_recall", "val_seen"} <= set(m)
    assert m["val_seen"] == 37  # SumMetric logged with sync_dist=True, reduce_fx="sum": counted once
    # Epoch values are the metric over every sample; recompute them from the final weights.
    x, y = loader(37, 37).dataset.tensors
    with torch.no_grad():
        pred = model(x).argmax(-1)
    assert m["val_acc"] == pytest.approx(float((pred == y).double().mean()), abs=1e-7)  # float32 in torchmetrics
    assert round(m["val_acc"] * 37) == int((pred == y).sum())
    # Metrics were reset at each epoch end.
    for metric in (model.train_acc, model.val_acc, model.val_metrics["recall"], model.val_seen):
        assert metric._update_count == 0
    # Step values: the accuracy of each training batch, as its forward returned it.
    step_rows = [row for _, row in rows.rows if "train_acc_step" in row]
    assert len(step_rows) == 16
    assert all(v in {k / 8 for k in range(9)} for v in (r["train_acc_step"] for r in step_rows))
    epoch_rows = [row for _, row in rows.rows if "train_acc_epoch" in row]
    assert len(epoch_rows) == 2 and epoch_rows[-1]["train_acc_epoch"] == m["train_acc_epoch"]


def test_logging_metric_objects_errors() -> None:
    from torchmetrics.classification import MulticlassAccuracy

    class Bad(Classifier):
        def __init__(self, what: str) -> None:
            super().__init__()
            self.what = what
            self.stray = {"acc": MulticlassAccuracy(num_classes=3)}  # a plain dict: not a submodule

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self(x)
            if self.what == "stray":
                self.stray["acc"](logits, y)
                self.log("acc", self.stray["acc"])
            elif self.what == "update":
                self.train_acc.update(logits, y)
                self.log("acc", self.train_acc, on_step=True)
            elif self.what == "mixed":
                self.log("acc", self.train_acc if batch_idx else 0.5, on_epoch=True, on_step=False)
            return torch.nn.functional.cross_entropy(logits, y)

    cases = {
        "stray": "is not a submodule of the Module",
        "update": "logs the value of the metric's last forward call",
        "mixed": "log one Metric object",
    }
    for what, message in cases.items():
        trainer = phalanx.Trainer(max_epochs=1, **quiet())
        with pytest.raises(MisconfigurationError, match=message):
            trainer.fit(Bad(what), loader(16, 4))


# ---------------------------------------------------------------------- 2 ranks
DDP_JOB = JOBS / "metrics_synced.py"


# FSDP is slow-marked here: tests/integration/test_combinations.py runs Metric objects through the LR finder, a fit
# and a resume on FSDP in CI; this job adds the comparison with the untuned run (one more job).
STRATEGIES = ["ddp", pytest.param("fsdp", marks=[pytest.mark.slow, run_if(fsdp=True)])]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_metric_objects_exact_identical_and_untouched_by_lr_find(tmp_path: Path, strategy: str) -> None:
    job = run_job(DDP_JOB, tmp_path, args=(strategy,), timeout=250).check()
    # The same fit on one process over the concatenated batches (2 ranks x 4 = 8 per step).
    trainer, model = _fit("object", lr_find=False)
    single = metric_report(trainer, model)
    plain, tuned = ({rank: job.reports[rank][mode] for rank in (0, 1)} for mode in ("plain", "lr_find"))
    for run in (plain, tuned):
        r0, r1 = run[0], run[1]
        assert r0["metrics"] == r1["metrics"]  # identical on every rank
        assert r0["state_devices"] == [r0["device"]]
        assert r0["update_count"] == 0 and r0["samples_seen"] == r1["samples_seen"] == 64
        torch.testing.assert_close(torch.tensor(r0["params"], dtype=torch.float64), flat(model), rtol=0, atol=1e-10)
        assert set(r0["metrics"]) == set(single["metrics"])
        for key in ("train_acc_epoch", "train_acc", "val_acc", "val_f1", "val_seen", "train_loss_epoch"):
            assert r0["metrics"][key] == pytest.approx(single["metrics"][key], abs=1e-9), key
        assert r0["metrics"]["val_seen"] == 37  # 19 + 18 samples: none scored twice, none reduced twice
    assert tuned[0]["metrics"] == plain[0]["metrics"]
    assert tuned[0]["params"] == plain[0]["params"]


# ---------------------------------------------------------------------- resume
def _resumable_fit(tmp: Path, style: str, stop_at: int | None = None, ckpt_path: str | None = None) -> Any:
    from phalanx.callbacks import ModelCheckpoint

    phalanx.seed_everything(11)
    callbacks: list[Any] = [ModelCheckpoint(dirpath=tmp, every_n_train_steps=3, save_last=True, save_top_k=0)]
    if stop_at is not None:
        callbacks.insert(0, StopAt(stop_at))
    trainer = phalanx.Trainer(max_epochs=2, callbacks=callbacks, **quiet(enable_checkpointing=True))
    model = Classifier(style, dropout=0.2)
    trainer.fit(model, loader(64, 4, shuffle=True), loader(21, 5), ckpt_path=ckpt_path)
    return trainer, model


def _plain(value: Any) -> bool:
    """Only what torch.load(weights_only=True) accepts without allow-listing: tensors, numbers, strings."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, (torch.Tensor, int, float, str, bool, type(None)))


@pytest.mark.parametrize("style", ["manual", "object"])
def test_metric_state_survives_resume_mid_epoch(tmp_path: Path, style: str) -> None:
    full_trainer, full_model = _resumable_fit(tmp_path / "full", style)
    with pytest.raises(Interrupt):
        # 16 steps per epoch; the last checkpoint is at step 18, 2 batches into the last epoch.
        _resumable_fit(tmp_path / "cut", style, stop_at=20)
    last = torch.load(tmp_path / "cut" / "last.ckpt", weights_only=False)
    resumed_trainer, resumed_model = _resumable_fit(tmp_path / "cut", style, ckpt_path="last")
    assert torch.equal(flat(resumed_model), flat(full_model))
    full = {k: float(v) for k, v in full_trainer.callback_metrics.items()}
    assert {k: float(v) for k, v in resumed_trainer.callback_metrics.items()} == full
    assert full["train_seen"] == 64 and full["train_acc"] > 0.5
    # The per-rank section holds the metric state as plain tensors and ints (weights_only-loadable).
    saved = last["rank_states"][0]["metrics"]
    assert saved["train_acc"]["update_count"] == 2
    assert _plain(saved) and _plain(last["rank_states"][0]["results"])


@pytest.mark.parametrize("style", ["manual", "object"])
def test_metric_state_survives_a_restart_from_a_per_step_snapshot(tmp_path: Path, style: str) -> None:
    from phalanx.callbacks import Snapshot
    from phalanx.checkpoint import snapshot
    from phalanx.checkpoint.snapshot import RankSnapshots

    def fit(tmp: Path, stop_at: int | None = None, ckpt_path: Any = None) -> Any:
        phalanx.seed_everything(11)
        callbacks: list[Any] = [Snapshot(every_n_train_steps=1, dirpath=tmp / "snapshots")]
        if stop_at is not None:
            callbacks.insert(0, StopAt(stop_at))  # before the Snapshot: the newest one is of the step before
        trainer = phalanx.Trainer(max_epochs=2, callbacks=callbacks, **quiet())
        model = Classifier(style, dropout=0.2)
        trainer.fit(model, loader(64, 4, shuffle=True), loader(21, 5), ckpt_path=ckpt_path)
        return trainer, model

    full_trainer, full_model = fit(tmp_path / "full")
    with pytest.raises(Interrupt):
        fit(tmp_path / "cut", stop_at=20)  # 16 steps per epoch: the snapshot of step 19 is 3 batches into epoch 2
    folder = (tmp_path / "cut" / "snapshots").absolute()
    assert max(snapshot.complete_steps(folder)) == 19
    saved, _ = RankSnapshots(folder, 0, 1).read(19)
    metrics = saved["rank_states"][0]["metrics"]  # the torchmetrics state, in the snapshot's data region
    assert metrics["train_acc"]["update_count"] == 3 and metrics["train_seen"]["update_count"] == 3
    resumed_trainer, resumed_model = fit(tmp_path / "cut", ckpt_path=snapshot.reference(folder, 19))
    assert torch.equal(flat(resumed_model), flat(full_model))
    full = {k: float(v) for k, v in full_trainer.callback_metrics.items()}
    assert {k: float(v) for k, v in resumed_trainer.callback_metrics.items()} == full
    assert full["train_seen"] == 64
    assert not folder.exists()  # the resumed fit finished: its snapshots are gone


RESUME_JOB = JOBS / "metrics_resume.py"


@pytest.mark.slow  # three 2-rank jobs; the single-process resume test above covers the same path in CI
@pytest.mark.timeout(400)
def test_ddp_killed_mid_epoch_resumes_with_the_same_metric_objects(tmp_path: Path) -> None:
    for name in ("full", "cut"):
        (tmp_path / name).mkdir()
    full = run_job(RESUME_JOB, tmp_path / "full", args=("full",), timeout=200).check()
    killed = run_job(RESUME_JOB, tmp_path / "cut", args=("kill",), timeout=200)
    assert killed.returncode == 17, killed.output[-3000:]
    resumed = run_job(RESUME_JOB, tmp_path / "cut", args=("resume",), timeout=200).check()
    for rank in (0, 1):  # 8 steps per epoch: killed at step 13, resumed from step 12 (4 batches into epoch 1)
        assert resumed.reports[rank]["params"] == full.reports[rank]["params"]
        assert resumed.reports[rank]["metrics"] == full.reports[rank]["metrics"]
        assert full.reports[rank]["metrics"]["train_seen"] == 64
