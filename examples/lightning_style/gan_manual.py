"""A Lightning-style GAN with manual optimization: two optimizers, ``self.optimizers()``,
``self.manual_backward``, ``self.toggle_optimizer``, ``self.lr_schedulers()``.

Only the import line differs from a Lightning script. Random stand-in data (points on a circle).

    python examples/lightning_style/gan_manual.py --devices 2 --max_epochs 1
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx as L


class GAN(L.LightningModule):
    def __init__(self, latent_dim: int = 4, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(latent_dim, 32), nn.ReLU(), nn.Linear(32, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], self.hparams.latent_dim)
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)

        self.toggle_optimizer(opt_g)
        g_loss = bce(self.discriminator(self(z)), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        d_loss = (bce(self.discriminator(real), ones) + bce(self.discriminator(self(z).detach()), zeros)) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def on_train_epoch_end(self) -> None:
        for scheduler in self.lr_schedulers():
            scheduler.step()

    def configure_optimizers(self) -> tuple[list[torch.optim.Optimizer], list[object]]:
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=(0.5, 0.999))
        schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.95) for o in (opt_g, opt_d)]
        return [opt_g, opt_d], schedulers


def circle(n: int = 1024) -> TensorDataset:
    angle = torch.rand(n, generator=torch.Generator().manual_seed(0)) * 2 * math.pi
    return TensorDataset(torch.stack([angle.cos(), angle.sin()], dim=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max_epochs", type=int, default=2)
    parser.add_argument("--root", default="runs/lightning_style_gan")
    args = parser.parse_args()

    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, max_epochs=args.max_epochs,
                        default_root_dir=args.root, enable_progress_bar=False, log_every_n_steps=8,
                        # both networks are updated by one of two optimizers each step: DDP must allow it
                        strategy="ddp_find_unused_parameters_true" if args.devices > 1 else "auto")
    model = GAN()
    trainer.fit(model, DataLoader(circle(), batch_size=64, shuffle=True))
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics
        print(f"RESULT g_loss={float(metrics['g_loss']):.4f} d_loss={float(metrics['d_loss']):.4f} "
              f"steps={trainer.global_step}")


if __name__ == "__main__":
    main()
