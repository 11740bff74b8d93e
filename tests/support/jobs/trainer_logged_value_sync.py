"""Logged values synced over ranks, read or left quiet (argv[1]: quiet|read).

Run by tests/trainer/test_trainer_guards.py: test_step_metrics_sync_only_where_consumed_yet_identical_everywhere.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from job_runner import report
from trainer_support import Regressor, loader, quiet

import phalanx
from phalanx.callbacks import ModelCheckpoint
from phalanx.loggers import CSVLogger

mode = sys.argv[1]


class Logs(Regressor):
    # Regressor's per-batch hooks are user code that may read callback_metrics (phalanx syncs before
    # them); this module keeps Module's defaults, so nothing but the consumers below syncs.
    on_before_optimizer_step = phalanx.Module.on_before_optimizer_step
    optimizer_step = phalanx.Module.optimizer_step

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.current_epoch == 0:  # epoch 1 logs nothing: the baseline of collectives per epoch
            self.log("local", loss * (1 + self.trainer.global_rank))  # differs per rank: rank 0's value is published
            self.log("avg", loss, sync_dist=True, prog_bar=True)
        return loss


class Count:
    def __init__(self) -> None:
        self.per_epoch: list[Any] = []

    def on_train_epoch_start(self, trainer: phalanx.Trainer, module: Any) -> None:
        self.start = trainer.fabric.strategy.collectives_issued()

    def on_train_epoch_end(self, trainer: phalanx.Trainer, module: Any) -> None:
        self.per_epoch.append(trainer.fabric.strategy.collectives_issued() - self.start)


class Reader:
    '''Reads callback_metrics every batch: on every rank, and on rank 0 alone (which must not hang).'''
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_train_batch_end(self, trainer: phalanx.Trainer, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.is_global_zero:
            float(trainer.callback_metrics.get("local", float("nan")))
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items()})


count = Count()
callbacks: list[Any] = [count]
if mode == "read":
    reader = Reader()
    callbacks += [reader, ModelCheckpoint(dirpath="ckpt", monitor="avg", every_n_train_steps=4, save_top_k=2)]
trainer = phalanx.Trainer(devices=2, strategy="ddp", max_epochs=2, log_every_n_steps=4, callbacks=callbacks,
                          **quiet(logger=CSVLogger("logs"), enable_checkpointing=mode == "read"))
trainer.fit(Logs(sync_dist=False), loader(128, 4))
out = {"per_epoch": count.per_epoch, "logged": trainer.logged_metrics, "bar": trainer.progress_bar_metrics}
if mode == "read":
    best = trainer.checkpoint_callback.best_k_models
    out.update(seen=reader.seen, best={k.split("/")[-1]: v for k, v in best.items()})
report(trainer.fabric, **out)
