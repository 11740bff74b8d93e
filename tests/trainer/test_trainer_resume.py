"""Exact resume: a fit interrupted mid-epoch and resumed from its last checkpoint ends bit-identical
to the fit that never stopped (model, optimizer, scheduler, data position, RNG of every rank,
partial epoch metrics, callback state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from interrupts import Interrupt, StopAt
from job_runner import JOBS, run_job
from trainer_support import Regressor, flat, loader, quiet

import phalanx
from phalanx.callbacks import EarlyStopping, ModelCheckpoint
from phalanx.utils.errors import CheckpointError, MisconfigurationError

pytestmark = pytest.mark.timeout(240)


def _fit(tmp: Path, stop_at: int | None = None, ckpt_path: str | None = None) -> tuple[Any, Any]:
    phalanx.seed_everything(11)
    callbacks: list[Any] = [
        ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=3, save_last=True, save_top_k=2),
        EarlyStopping("val_mae", patience=50),
    ]
    if stop_at is not None:
        callbacks.insert(0, StopAt(stop_at))
    trainer = phalanx.Trainer(max_epochs=3, accumulate_grad_batches=2, val_check_interval=4, callbacks=callbacks,
                              deterministic=True, **quiet(enable_checkpointing=True))
    model = Regressor(optimizer="adam", lr=0.01, dropout=0.2)
    trainer.fit(model, loader(60, 4, shuffle=True), loader(21, 5), ckpt_path=ckpt_path)
    return trainer, model


def test_interrupted_fit_resumes_bit_identical(tmp_path: Path) -> None:
    full_trainer, full_model = _fit(tmp_path / "full")
    with pytest.raises(Interrupt):
        _fit(tmp_path / "cut", stop_at=7)  # checkpoints at steps 3 and 6, mid-epoch 0 (8 steps per epoch)
    last = torch.load(tmp_path / "cut" / "ckpt" / "last.ckpt", weights_only=True)
    assert last["loops"]["global_step"] == 6 and last["loops"]["batches_done"] == 12
    resumed_trainer, resumed_model = _fit(tmp_path / "cut", ckpt_path="last")
    assert resumed_trainer.global_step == full_trainer.global_step == 24
    assert torch.equal(flat(resumed_model), flat(full_model))
    full_opt, resumed_opt = full_trainer.optimizer.state_dict(), resumed_trainer.optimizer.state_dict()
    for key in full_opt["state"]:
        for name, value in full_opt["state"][key].items():
            assert torch.equal(value, resumed_opt["state"][key][name]), name
    # Epoch metrics include the batches before the interruption (accumulators were restored).
    for key, value in full_trainer.callback_metrics.items():
        assert float(resumed_trainer.callback_metrics[key]) == float(value), key
    es_full, es_resumed = full_trainer.callbacks[0], resumed_trainer.callbacks[0]
    assert isinstance(es_full, EarlyStopping) and isinstance(es_resumed, EarlyStopping)
    assert es_resumed.state_dict() == es_full.state_dict()


def test_resume_from_epoch_end_checkpoint(tmp_path: Path) -> None:
    trainer = phalanx.Trainer(max_epochs=1, **quiet())
    model = Regressor()
    trainer.fit(model, loader(24, 4))
    trainer.save_checkpoint(tmp_path / "e1.ckpt")
    more = phalanx.Trainer(max_epochs=2, **quiet())
    model2 = Regressor()
    more.fit(model2, loader(24, 4), ckpt_path=tmp_path / "e1.ckpt")
    straight = phalanx.Trainer(max_epochs=2, **quiet())
    model3 = Regressor()
    straight.fit(model3, loader(24, 4))
    assert more.current_epoch == 2 and more.global_step == 12
    assert torch.equal(flat(model2), flat(model3))


def test_resume_errors(tmp_path: Path) -> None:
    trainer = phalanx.Trainer(max_epochs=1, **quiet())
    model = Regressor()
    trainer.fit(model, loader(8, 4))
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    with pytest.raises(CheckpointError, match=r"Cannot resume training"):
        phalanx.Trainer(max_epochs=2, **quiet()).fit(Regressor(), loader(8, 4), ckpt_path=tmp_path / "weights.ckpt")
    # A path that does not exist: the checkpoints that do are named, so the right one is one copy away.
    with pytest.raises(MisconfigurationError) as missing:
        phalanx.Trainer(max_epochs=2, **quiet()).fit(Regressor(), loader(8, 4), ckpt_path=tmp_path / "nope.ckpt")
    assert str(missing.value) == (f"ckpt_path {tmp_path / 'nope.ckpt'} does not exist. The checkpoints that do, newest "
                                  f"first: {tmp_path / 'weights.ckpt'}.")
    # "last" without any checkpoint starts from scratch, and says so.
    fresh = phalanx.Trainer(max_epochs=1, **quiet(enable_checkpointing=True, default_root_dir=tmp_path / "r"))
    fresh.fit(Regressor(), loader(8, 4), ckpt_path="last")
    assert fresh.global_step == 2


def test_saving_inside_an_accumulation_window_is_refused(tmp_path: Path) -> None:
    class SaveEveryBatch:
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            trainer.save_checkpoint(tmp_path / "x.ckpt")

    trainer = phalanx.Trainer(max_epochs=1, accumulate_grad_batches=2, callbacks=[SaveEveryBatch()], **quiet())
    with pytest.raises(MisconfigurationError, match=r"inside a gradient-accumulation window"):
        trainer.fit(Regressor(), loader(16, 4))


DDP_JOB = JOBS / "trainer_ddp_kill_resume.py"


@pytest.mark.slow  # three 2-rank jobs; the single-process test above covers the same path in CI
def test_ddp_killed_mid_epoch_resumes_bit_identical(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    full = run_job(DDP_JOB, tmp_path / "full", args=("full",)).check()
    cut_dir = tmp_path / "cut"
    cut_dir.mkdir()
    killed = run_job(DDP_JOB, cut_dir, args=("kill",))
    assert killed.returncode == 17, killed.output[-3000:]
    assert (cut_dir / "ckpt" / "last.ckpt").is_file()
    resumed = run_job(DDP_JOB, cut_dir, args=("resume",)).check()
    for rank in (0, 1):
        assert resumed.reports[rank]["step"] == full.reports[rank]["step"] == 12
        assert resumed.reports[rank]["params"] == full.reports[rank]["params"]  # bit-identical
        assert resumed.reports[rank]["loss"] == full.reports[rank]["loss"]
