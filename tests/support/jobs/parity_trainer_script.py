"""A Trainer script written for Lightning, run with phalanx or with Lightning (argv[2]); its losses, validation
loss, steps and learning rate are printed as JSON (run by tests/integration/test_parity.py)."""

import importlib
import json
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L: Any = importlib.import_module(sys.argv[2])  # phalanx, or lightning for the numbers to match

g = torch.Generator().manual_seed(0)
x = torch.randn(64, 8, generator=g)
data = TensorDataset(x, (x @ torch.randn(8, 1, generator=g)).squeeze(1))


class Model(L.LightningModule):  # type: ignore[misc]  # Lightning's or phalanx's, chosen at run time
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(42)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.losses: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(1), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(1), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


model = Model()
trainer = L.Trainer(accelerator="cpu", max_epochs=3, accumulate_grad_batches=2, gradient_clip_val=0.5,
                    enable_progress_bar=False, default_root_dir=sys.argv[1])
trainer.fit(model, DataLoader(data, batch_size=8), DataLoader(data, batch_size=16))
print(json.dumps({"losses": model.losses, "val_loss": float(trainer.callback_metrics["val_loss"]),
                  "steps": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"]}))
