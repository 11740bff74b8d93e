"""Handwritten digits with phalanx.Trainer: 2 processes (DDP on CPU), an LR range test before
training, the best checkpoint kept, CSV and TensorBoard logs, a progress bar.

Data: scikit-learn's bundled digits (1797 8x8 images, no download).

    python examples/train_digits.py                 # re-runs itself in 2 processes
    phalanx run --devices 2 examples/train_digits.py
    python examples/train_digits.py                 # again after a preemption (exit code 75): resumes where it stopped
    python examples/train_digits.py --resume        # go on from the newest checkpoint in --out
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.callbacks import LearningRateFinder, ModelCheckpoint, Snapshot
from phalanx.loggers import CSVLogger, TensorBoardLogger


class DigitsClassifier(phalanx.Module):
    def __init__(self, hidden: int = 128, lr: float = 1e-3, epochs: int = 12) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr  # the LearningRateFinder replaces it before training starts
        self.epochs = epochs
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        # on_epoch + sync_dist: the epoch value is the exact mean over every sample of every rank.
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=1e-4)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.epochs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


class PrintEpoch:
    """Any object with hook methods is a callback; this one prints one line per epoch."""

    def on_train_epoch_end(self, trainer: phalanx.Trainer, module: phalanx.Module) -> None:
        m = trainer.callback_metrics
        trainer.print(
            f"epoch {trainer.current_epoch:2d}  train loss {float(m['train_loss_epoch']):.4f}  "
            f"val loss {float(m['val_loss']):.4f}  val acc {float(m['val_acc']):.2%}"
        )


def digits_datasets(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train a digits classifier with phalanx.Trainer on --devices processes (DDP on CPU).")
    parser.add_argument("--devices", type=int, default=2, help="processes to train on (DDP; default %(default)s)")
    parser.add_argument("--epochs", type=int, default=12, help="epochs to train for (default %(default)s)")
    parser.add_argument("--out", default="runs/train_digits",
                        help="the run's root folder: checkpoints, CSV and TensorBoard logs, the LR finder's plot, "
                             "and the launcher's logs (phalanx_logs/) go under it; one run at a time may use it "
                             "(default %(default)s)")
    parser.add_argument("--no-progress-bar", action="store_true", help="no progress bar (the line per epoch stays)")
    parser.add_argument("--max-restarts", type=int, default=2,
                        help="restart the processes up to this many times after one dies (kill -9, out of memory); "
                             "each restart resumes from the snapshot of the last step; an error a restart cannot "
                             "fix is not restarted (default %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in --out (ckpt_path='last'); after a preemption "
                             "(exit code 75) the same command resumes without it")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    out = Path(args.out)

    phalanx.seed_everything(42)
    finder = LearningRateFinder(min_lr=1e-5, max_lr=1.0, num_training_steps=60, plot_path=out / "lr_find.png")
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_acc", mode="max", save_last=True)
    trainer = phalanx.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp",
        max_epochs=args.epochs,
        callbacks=[finder, checkpoint, Snapshot(), PrintEpoch()],
        max_restarts=args.max_restarts,
        logger=[CSVLogger(out, name="csv"), TensorBoardLogger(out, name="tensorboard")],
        enable_progress_bar=not args.no_progress_bar,
        log_every_n_steps=10,
        default_root_dir=out,
    )  # with devices=2, the first trainer call (fit below) re-runs the script in 2 processes

    train_set, val_set = digits_datasets()
    model = DigitsClassifier(epochs=args.epochs)
    trainer.fit(
        model,
        train_dataloaders=DataLoader(train_set, batch_size=32, shuffle=True),
        # 360 images split 180/180 across the ranks; every image is scored exactly once.
        val_dataloaders=DataLoader(val_set, batch_size=128),
        # None: train from scratch, unless the run in --out was preempted (then resume it, and say so).
        ckpt_path="last" if args.resume else None,
    )

    if "val_acc" not in trainer.callback_metrics:  # --resume over a run that had finished: nothing was trained
        trainer.print(f"the run in {out} is finished ({trainer.current_epoch} of {args.epochs} epochs, step "
                      f"{trainer.global_step}); nothing to train. Best checkpoint: {checkpoint.best_model_path}")
        return
    accuracy = float(trainer.callback_metrics["val_acc"])
    trainer.print(f"learning rate from the LR finder: {model.lr:.3g} (plot: {out / 'lr_find.png'})")
    trainer.print(f"best checkpoint: {checkpoint.best_model_path}")
    trainer.print(f"final validation accuracy {accuracy:.2%} on {len(val_set)} held-out images")
    if accuracy < 0.95:
        raise SystemExit(f"validation accuracy {accuracy:.2%} is below the expected 95%")


if __name__ == "__main__":
    main()
