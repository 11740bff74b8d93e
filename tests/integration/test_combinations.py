"""The combination tier: the Trainer's features together, on every strategy and precision.

Each case is one real job (2 ranks; 1 for "single") running tests/support/combo_models.py: LR finder (on
DeepSpeed on a scratch copy of the module, see phalanx.tuner.lr_find), then a
fit with accumulation, a step scheduler, dropout, ``sync_dist`` logging, torchmetrics Metric objects,
ModelCheckpoint (top-1 by val_loss + last, every 2 steps) and an EarlyStopping that stops the run
after 8 of its 12 steps, then validate/test/predict; then the same fit interrupted on every rank at
step 5 and resumed from ``last`` by a new Trainer in the same processes. The resumed fit must end
exactly where the uninterrupted one did: parameters, step, epoch, every callback metric, the best
checkpoint and its score, the learning rate, the early stop; the LR finder must leave no trace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from job_runner import JOBS, run_job
from run_if import run_if

JOB = JOBS / "combinations.py"


def _cases() -> list[Any]:
    cases: list[Any] = []
    for strategy in ("single", "ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"):
        marks = [run_if(module="torchmetrics", fsdp=strategy == "fsdp", deepspeed=strategy.startswith("deepspeed"))]
        for precision in ("32-true", "bf16-mixed"):
            slow = [pytest.mark.slow] if (strategy, precision) in SLOW else []
            cases.append(pytest.param(strategy, precision, marks=marks + slow, id=f"{strategy}-{precision}"))
    return cases


# The default tier runs ddp, fsdp and DeepSpeed ZeRO-2 (one process's path is theirs minus the collectives)
# in both precisions between them; the cases below repeat a path and run with PHALANX_TEST_ALL=1, keeping
# the 2-CPU CI box inside its 15-minute budget.
SLOW = {("single", "bf16-mixed"), ("ddp", "bf16-mixed"), ("fsdp", "32-true"), ("deepspeed_stage_2", "32-true"),
        ("deepspeed_stage_3", "bf16-mixed"), ("deepspeed_stage_3", "32-true"),
        ("single", "32-true")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("strategy", "precision"), _cases())
def test_trainer_features_combined_and_resumed_exactly(tmp_path: Path, strategy: str, precision: str) -> None:
    job = run_job(JOB, tmp_path, args=(strategy, precision), timeout=280).check()
    ranks = sorted(job.reports)
    assert ranks == ([0] if strategy == "single" else [0, 1]), job.output[-3000:]
    for rank in ranks:
        full, resumed = job.reports[rank]["full"], job.reports[rank]["resumed"]
        assert full["lr_find_untouched"], "the LR finder changed the module, its metric state or the RNG"
        assert full["lr_find_points"] == 12
        # EarlyStopping (patience 3, checked after each validation) stops at the 4th validation.
        assert full["step"] == 8 and full["epoch"] == 2 and full["stopped_epoch"] == 1, full
        assert resumed["interrupted_at"] == 5 and resumed["resumed_from"] == "last.ckpt"
        for key in ("params", "step", "epoch", "metrics", "best_score", "best", "lr", "stopped_epoch", "validate"):
            assert resumed[key] == full[key], f"{key}: resumed {str(resumed[key])[:300]} != {str(full[key])[:300]}"
        assert set(full["metrics"]) >= {"train_loss_step", "train_loss_epoch", "train_mse", "val_loss", "val_mae"}
        assert full["best"].startswith("epoch=") and full["best_score"] is not None
        assert len(full["test"]) == 1 and "test_loss" in full["test"][0]
        assert len(full["predict"]) == (3 if strategy == "single" else 2)  # 12 samples in batches of 4, sharded
    if len(ranks) == 2:  # every metric and every parameter identical on both ranks
        for key in ("params", "metrics", "validate", "test"):
            assert job.reports[0]["full"][key] == job.reports[1]["full"][key], key
