"""The non-finite loss check read late, as on a GPU (phalanx.trainer.loss_check, under
``PHALANX_DEFER_HOST_READS=1``): the run stops a few steps after a nan loss, naming it; with an optimizer that takes
torch's ``found_inf`` the weights never take a non-finite step, and with any optimizer no checkpoint or snapshot
holds its effect. Read at once (the CPU default) the check stops before the step (test_trainer_guards.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from trainer_support import Regressor, dataset, flat, quiet

import phalanx
from phalanx.callbacks import ModelCheckpoint, Snapshot
from phalanx.fabric.anomaly import NonFiniteError
from phalanx.trainer.loss_check import ROWS
from phalanx.utils.errors import PhalanxWarning
from phalanx.utils.late_reads import DEFER_VARIABLE

pytestmark = pytest.mark.timeout(120)


class Fused(Regressor):
    """Adam with the fused implementation, which skips a step on the device where ``found_inf`` is set."""

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr, fused=True)


def _poisoned_from(n: int, first_bad: int, batch: int) -> DataLoader[Any]:
    """Every batch from ``first_bad`` on has a nan input (so every later loss is nan too)."""
    x, y = dataset(n).tensors
    x = x.clone()
    x[first_bad * batch:, 0] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=batch)


@pytest.fixture(autouse=True)
def _late(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEFER_VARIABLE, "1")


def test_a_fused_optimizer_never_takes_a_non_finite_step(tmp_path: Path) -> None:
    trainer = phalanx.Trainer(max_epochs=1, log_every_n_steps=50, **quiet(default_root_dir=tmp_path))
    model = Fused()
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(model, _poisoned_from(4 * 40, 6, 4))  # batch 6 is global step 7's
    message = str(info.value)
    assert message.startswith("The training loss was nan at epoch 0, global step 7 (batch 6). Losses are read a few "
                              "steps late, so that the device never waits for them: the run stops at the first "
                              "check after it. Where the optimizer skips on found_inf"), message
    assert 7 < trainer.global_step <= 7 + ROWS + 2  # late, but within a buffer and a poll or two
    # Every step from 7 on was skipped on the device: the weights are those after step 6, and Adam counted 6 steps.
    reference = phalanx.Trainer(max_steps=6, **quiet(default_root_dir=tmp_path / "ref"))
    ref_model = Fused()
    reference.fit(ref_model, _poisoned_from(4 * 40, 6, 4))
    assert torch.equal(flat(model), flat(ref_model))
    assert all(int(s["step"]) == 6 for s in trainer_optimizer(model).state.values())


def trainer_optimizer(model: Regressor) -> torch.optim.Optimizer:
    optimizer = model.trainer.optimizers[0] if model._trainer is not None else None
    if optimizer is None:  # torn down: the module keeps no reference; find it through the parameters' state
        raise AssertionError("the optimizer is gone")
    return optimizer  # type: ignore[no-any-return]


def test_no_checkpoint_or_snapshot_holds_a_non_finite_step(tmp_path: Path) -> None:
    # A plain Adam takes the steps until the check stops the run: the checkpoint due at step 10 finds the weights
    # non-finite and is not written, and the snapshots taken since the nan are removed with the rest.
    snapshots = tmp_path / "snapshots"
    checkpoint = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=10, save_last=True)
    trainer = phalanx.Trainer(max_epochs=1, log_every_n_steps=50, **quiet(
        default_root_dir=tmp_path, enable_checkpointing=True,
        callbacks=[checkpoint, Snapshot(every_n_train_steps=1, dirpath=snapshots)]))
    with pytest.raises(NonFiniteError, match=r"The training loss was nan at epoch 0, global step 8 \(batch 7\)"), \
            pytest.warns(PhalanxWarning, match=r"weights hold inf/nan at epoch 0, step 10; no checkpoint is written"):
        trainer.fit(Regressor(optimizer="adam"), _poisoned_from(4 * 40, 7, 4))
    assert 8 < trainer.global_step <= 8 + ROWS + 2
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())
    assert not snapshots.exists()


def test_the_end_of_the_fit_reads_every_pending_loss(tmp_path: Path) -> None:
    # The fit ends at step 9, before the losses of steps 1-9 would be sent to the host: its end reads them.
    trainer = phalanx.Trainer(max_steps=9, log_every_n_steps=50, **quiet(default_root_dir=tmp_path))
    with pytest.raises(NonFiniteError, match=r"The training loss was nan at epoch 0, global step 7 \(batch 6\)"):
        trainer.fit(Fused(), _poisoned_from(4 * 40, 6, 4))
    assert trainer.global_step == 9


@pytest.mark.gpu
def test_on_a_gpu_a_fused_optimizer_skips_the_non_finite_steps_on_the_device(tmp_path: Path) -> None:
    trainer = phalanx.Trainer(max_epochs=1, log_every_n_steps=50,
                              **quiet(accelerator="cuda", default_root_dir=tmp_path))
    model = Fused()
    with pytest.raises(NonFiniteError, match=r"The training loss was nan at epoch 0, global step 7 \(batch 6\)"):
        trainer.fit(model, _poisoned_from(4 * 40, 6, 4))
    reference = phalanx.Trainer(max_steps=6, **quiet(accelerator="cuda", default_root_dir=tmp_path / "ref"))
    ref_model = Fused()
    reference.fit(ref_model, _poisoned_from(4 * 40, 6, 4))
    assert torch.equal(flat(model), flat(ref_model))
