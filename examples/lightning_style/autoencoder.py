"""A Lightning-style autoencoder: LightningModule + LightningDataModule + Trainer + callbacks.

Written against Lightning's names; only the import line differs from a Lightning script (the test
suite runs this same file under Lightning too, with ``import lightning as L``). Random stand-in
data, no download.

    python examples/lightning_style/autoencoder.py --devices 2 --max_epochs 1
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx as L
from phalanx.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint


class LitAutoEncoder(L.LightningModule):
    def __init__(self, hidden_dim: int = 16, learning_rate: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, hidden_dim))
        self.decoder = nn.Sequential(nn.Linear(hidden_dim, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def _loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x, _ = batch
        return nn.functional.mse_loss(self(x), x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True, prog_bar=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.encoder(batch[0])

    def configure_optimizers(self) -> dict[str, object]:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


class RandomDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        basis = torch.randn(8, 32, generator=g)
        x = torch.randn(512, 8, generator=g) @ basis  # low-rank data: an autoencoder can learn it
        self.train_set = TensorDataset(x[:384], torch.zeros(384))
        self.val_set = TensorDataset(x[384:448], torch.zeros(64))
        self.test_set = TensorDataset(x[448:], torch.zeros(64))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=32)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=32)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max_epochs", type=int, default=3)
    parser.add_argument("--root", default="runs/lightning_style_autoencoder")
    args = parser.parse_args()

    L.seed_everything(42)
    model = LitAutoEncoder()
    datamodule = RandomDataModule()
    checkpoint = ModelCheckpoint(monitor="val_loss", mode="min", save_last=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_epochs=args.max_epochs, default_root_dir=args.root,
        callbacks=[checkpoint, EarlyStopping(monitor="val_loss", patience=3), LearningRateMonitor("epoch")],
        enable_progress_bar=False, log_every_n_steps=5,
    )
    trainer.fit(model, datamodule=datamodule)
    result = trainer.test(model, datamodule=datamodule)
    predictions = trainer.predict(model, datamodule=datamodule)
    best = LitAutoEncoder.load_from_checkpoint(checkpoint.best_model_path)
    if trainer.is_global_zero:
        print(f"RESULT test_loss={result[0]['test_loss']:.6f} steps={trainer.global_step} "
              f"predictions={sum(len(p) for p in predictions)} best_hidden={best.hparams.hidden_dim}")


if __name__ == "__main__":
    main()
