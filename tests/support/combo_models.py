"""The module and job of the combination tier (tests/integration/test_combinations.py); the job scripts import
this module, which holds no tests itself.

One job runs, on one strategy and precision, what a user combines in a real project: the LR finder
before ``fit`` (on DeepSpeed it searches on a scratch copy with an engine of its own), a fit with
accumulation, a scheduler, dropout, ``sync_dist`` logging, torchmetrics Metric objects
logged on step and epoch, ModelCheckpoint (top-k by a monitored metric, plus last),
EarlyStopping that actually stops the run, then validate/test/predict; the same fit interrupted
mid-epoch and resumed from ``last`` by a new Trainer. Everything is float32, so ``bf16-mixed`` runs
its matmuls in bfloat16 (autocast leaves float64 alone).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from interrupts import Interrupt, StopAt
from job_runner import report
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanAbsoluteError, MeanSquaredError

import phalanx
from phalanx.callbacks import EarlyStopping, ModelCheckpoint
from phalanx.tuner.lr_find import Tuner

SAMPLES = 64  # 8 batches of 4 per rank on 2 ranks: 4 optimizer steps per epoch with accumulation 2
BATCH = 4
INTERRUPT_AT = 5  # the last checkpoint before it is at step 4 (every_n_train_steps=2), mid-epoch 1


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) - x[:, 4:].prod(1, keepdim=True)).tanh()
    return TensorDataset(x, y)


def loader(n: int, seed: int, shuffle: bool = False) -> DataLoader[Any]:
    return DataLoader(data(n, seed), batch_size=BATCH, shuffle=shuffle)


class ComboModule(phalanx.Module):
    def __init__(self, lr: float = 0.02) -> None:
        super().__init__()
        torch.manual_seed(4321)  # the same initial weights in every process and every Trainer
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 1))
        self.lr = lr
        self.train_mse = MeanSquaredError()
        self.val_mae = MeanAbsoluteError()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        pred = self(x).float()
        loss = nn.functional.mse_loss(pred, y)
        self.train_mse(pred.detach(), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("train_mse", self.train_mse, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        pred = self(x).float()
        self.val_mae(pred, y)
        self.log("val_mae", self.val_mae, on_epoch=True)
        self.log("val_loss", nn.functional.mse_loss(pred, y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x).float(), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out: torch.Tensor = self(batch[0]).float()
        return out

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def flat(module: nn.Module) -> list[float]:
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in module.parameters()]
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in full]).tolist()


def metric_state(module: ComboModule) -> list[float]:
    states = [module.train_mse.sum_squared_error, module.train_mse.total, module.val_mae.sum_abs_error,
              module.val_mae.total]
    return [float(s) for s in states]


def make_trainer(strategy: str, precision: str, devices: int, root: Path, extra: list[Any]) -> phalanx.Trainer:
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", monitor="val_loss", save_top_k=1, save_last=True,
                           every_n_train_steps=2)
    # patience=3 with an unreachable min_delta: the first validation sets the best, the next three
    # do not improve on it, so the run stops at the fourth validation (step 8, end of epoch 1 of 3).
    stop = EarlyStopping("val_loss", min_delta=100.0, patience=3)
    return phalanx.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, precision=precision, max_epochs=3,
        accumulate_grad_batches=2, val_check_interval=4, callbacks=[*extra, ckpt, stop], logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
    )


def summary(trainer: phalanx.Trainer, module: ComboModule) -> dict[str, Any]:
    ckpt = trainer.checkpoint_callback
    return {
        "params": flat(module),
        "step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "metrics": {k: float(v) for k, v in sorted(trainer.callback_metrics.items())},
        "best_score": None if ckpt.best_model_score is None else float(ckpt.best_model_score),
        "best": Path(ckpt.best_model_path).name,
        "lr": [g["lr"] for g in trainer.optimizers[0].param_groups],
        "stopped_epoch": trainer.early_stopping_callback.stopped_epoch,
    }


def main() -> None:
    strategy, precision = sys.argv[1], sys.argv[2]
    devices = 1 if strategy == "single" else 2
    strategy = "auto" if strategy == "single" else strategy
    train, val = loader(SAMPLES * devices // 2, 0, shuffle=True), loader(32, 1)

    # Uninterrupted, after the LR finder: the finder must leave no trace (weights, metric state, RNG); its
    # suggestion is not applied (update_attr=False), so the fit below and the resumed one train at the same lr.
    phalanx.seed_everything(3)
    trainer = make_trainer(strategy, precision, devices, Path("full"), [])
    module = ComboModule()
    before = (flat(module), metric_state(module), torch.get_rng_state())
    points = len(Tuner(trainer).lr_find(module, train, num_training=12, early_stop_threshold=None,
                                  update_attr=False).results["lr"])
    untouched = (flat(module) == before[0] and metric_state(module) == before[1]
                 and torch.equal(torch.get_rng_state(), before[2]))
    trainer.fit(module, train, val)
    full = summary(trainer, module)
    full["lr_find_untouched"] = untouched
    full["lr_find_points"] = points
    full["validate"] = trainer.validate(module, val, verbose=False)
    full["test"] = trainer.test(module, loader(24, 2), verbose=False)
    preds = trainer.predict(module, loader(12, 3))
    full["predict"] = [float(p.sum()) for p in preds]

    # Interrupted mid-epoch on every rank, then resumed from `last` by a new Trainer.
    phalanx.seed_everything(3)
    cut = make_trainer(strategy, precision, devices, Path("cut"), [StopAt(INTERRUPT_AT)])
    try:
        cut.fit(ComboModule(), train, val)
        raise AssertionError("the fit was not interrupted")
    except Interrupt:
        pass
    interrupted_at = cut.global_step
    phalanx.seed_everything(99)  # resuming must not depend on the seed of the new process
    resumed_trainer = make_trainer(strategy, precision, devices, Path("cut"), [])
    resumed_module = ComboModule()
    resumed_trainer.fit(resumed_module, train, val, ckpt_path="last")
    resumed = summary(resumed_trainer, resumed_module)
    resumed["resumed_from"] = Path(resumed_trainer.ckpt_path or "").name
    resumed["interrupted_at"] = interrupted_at
    resumed["validate"] = resumed_trainer.validate(resumed_module, val, verbose=False)
    report(trainer.fabric, full=full, resumed=resumed)


if __name__ == "__main__":
    main()
