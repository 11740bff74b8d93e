"""Trainer guards: a non-finite loss stops the run before the optimizer step (one bad batch used to
give NaN weights and exit 0), ``detect_anomaly``, loaders with no batches, and step metrics that are
synced across ranks only where something reads them, yet identical on every rank wherever read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import JOBS, run_job
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from trainer_support import Regressor, dataset, flat, loader, quiet

import phalanx
from phalanx.utils.errors import MisconfigurationError

pytestmark = pytest.mark.timeout(240)


def _poisoned(n: int, index: int) -> TensorDataset:
    x, y = dataset(n).tensors
    x = x.clone()
    x[index, 0] = float("nan")
    return TensorDataset(x, y)


@pytest.mark.parametrize(("accumulate", "message"), [
    (1, "The training loss is nan at epoch 0, global step 3, batch 3. The run stops here, before the optimizer "
        "steps on it (the weights are those after step 3)."),
    (2, "The training loss is nan at epoch 0, global step 1, batch 3 (1 of the window's 2 micro-batches)."),
])
def test_non_finite_loss_stops_the_run_before_the_optimizer_step(accumulate: int, message: str) -> None:
    from phalanx.fabric.anomaly import NonFiniteError

    trainer = phalanx.Trainer(max_epochs=3, accumulate_grad_batches=accumulate, **quiet())
    model = Regressor()
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(model, DataLoader(_poisoned(24, 13), batch_size=4))  # sample 13 is in batch 3
    assert str(info.value).startswith(message), str(info.value)
    # The weights are finite: exactly those of the steps before the bad batch's window.
    steps = trainer.global_step
    reference = phalanx.Trainer(max_steps=steps, accumulate_grad_batches=accumulate, **quiet())
    ref_model = Regressor()
    reference.fit(ref_model, loader(24, 4))
    assert reference.global_step == steps
    assert torch.equal(flat(model), flat(ref_model))


NAN_JOB = JOBS / "trainer_nan_loss.py"


def test_non_finite_loss_on_one_rank_ends_the_ddp_job(tmp_path: Path) -> None:
    job = run_job(NAN_JOB, tmp_path, timeout=150)
    assert job.returncode != 0
    assert "NonFiniteError: The training loss is nan at epoch 0, global step 1, batch 1 on rank 1." in job.output, (
        job.output[-4000:]
    )


def test_detect_anomaly_is_a_trainer_argument() -> None:
    """Trainer(detect_anomaly=True) runs Fabric's full check: a gradient goes non-finite while the loss
    stays finite (sqrt at 0 times 0), which only the gradient check sees."""
    from phalanx.fabric.anomaly import NonFiniteError

    class SqrtAtZero(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.offset = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(batch, batch_idx) + 0.0 * torch.sqrt(self.offset).sum()

    with pytest.raises(NonFiniteError, match=r"the gradient of parameter 'offset' has 1 nan"):
        phalanx.Trainer(max_epochs=1, detect_anomaly=True, **quiet()).fit(SqrtAtZero(), loader(8, 4))
    # Without it, the finite loss passes the default check; the nan gradient is stepped on, and the next
    # loss (through nan weights) stops the run.
    with pytest.raises(NonFiniteError, match=r"loss is nan at epoch 0, global step 1, batch 1\."):
        phalanx.Trainer(max_epochs=1, **quiet()).fit(SqrtAtZero(), loader(8, 4))


def test_loaders_without_batches_are_refused() -> None:
    empty = DataLoader(TensorDataset(torch.zeros(0, 6, dtype=torch.float64), torch.zeros(0, 1)), batch_size=4)
    small = DataLoader(dataset(3), batch_size=4, drop_last=True)

    class Nothing(IterableDataset[Any]):
        def __iter__(self) -> Any:
            return iter(())

    cases: list[tuple[dict[str, Any], tuple[Any, ...], str]] = [
        ({}, (empty,), r"The training dataloader yields 0 batches \(0 samples, batch_size=4, drop_last=False\)"),
        ({}, (small,), r"yields 0 batches \(3 samples, batch_size=4, drop_last=True\)"),
        ({"limit_train_batches": 0}, (loader(8, 4),), r"limit_train_batches=0\)"),
        ({}, (DataLoader(Nothing(), batch_size=4),), r"training dataloader yields 0 batches \(no length"),
        ({}, (loader(8, 4), empty), r"The validation dataloader yields 0 batches .*Trainer\(limit_val_batches=0\)\."),
    ]
    for kwargs, loaders, message in cases:
        trainer = phalanx.Trainer(max_epochs=3, **quiet(enable_checkpointing=True), **kwargs)
        with pytest.raises(MisconfigurationError, match=message):
            trainer.fit(Regressor(), *loaders)
        assert trainer.global_step == 0 and trainer.current_epoch == 0
    trainer = phalanx.Trainer(max_epochs=1, **quiet())
    trainer.fit(Regressor(), loader(8, 4))
    with pytest.raises(MisconfigurationError, match=r"The test dataloader yields 0 batches"):
        trainer.test(dataloaders=empty, verbose=False)


# ---------------------------------------------------------------------- step metrics: where they are synced
SYNC_JOB = JOBS / "trainer_logged_value_sync.py"


def test_step_metrics_sync_only_where_consumed_yet_identical_everywhere(tmp_path: Path) -> None:
    (tmp_path / "quiet").mkdir()
    (tmp_path / "read").mkdir()
    quiet_job = run_job(SYNC_JOB, tmp_path / "quiet", args=("quiet",)).check()
    read_job = run_job(SYNC_JOB, tmp_path / "read", args=("read",)).check()
    # 16 steps per epoch, logging every step: the logging epoch costs the 4 logger flushes
    # (log_every_n_steps=4) and the epoch-end reduction, not one all_gather per step.
    logging_epoch, silent_epoch = quiet_job.reports[0]["per_epoch"]
    assert logging_epoch - silent_epoch <= 16 // 4 + 2, quiet_job.reports[0]["per_epoch"]
    # Wherever callbacks read them, on every rank, the values are the same (rank 0's "local").
    r0, r1 = read_job.reports[0], read_job.reports[1]
    assert r0["seen"] == r1["seen"] and len(r0["seen"]) == 32
    assert r0["best"] == r1["best"] and len(r0["best"]) == 2
    assert quiet_job.reports[0]["logged"]["local"] == quiet_job.reports[1]["logged"]["local"]
