"""The Trainer as one replica group of a fault-tolerant job (``phalanx run --replica-groups N``): the model and data of
tests/support/replica_models.py, ``--steps`` optimizer steps, the default CSV logger, which each group writes into
its own folder (``replica_group_<i>``), and no checkpoint (a restarted group can only heal from a peer). A callback
appends one JSON line per step to ``$PHALANX_TEST_OUT/trace-g<group>-r<rank>.jsonl`` and writes ``start-...`` and
``final-...`` files as tests/support/jobs/replica_groups_fabric.py does.

Arguments: --steps N, --strategy, --kill-at STEP and --kill-group G (that group's rank 0 kills itself with SIGKILL at
that step, on its first attempt), --sleep S."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from replica_models import BATCH, LR, crc, dataset, full_loss, make_model, started
from torch import nn
from torch.utils.data import DataLoader

import phalanx as L


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9), "interval": "step"}}


class Trace(L.Callback):
    def __init__(self, out: Path, group: int, args: argparse.Namespace) -> None:
        self.out, self.group, self.args = out, group, args
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def on_train_start(self, trainer: Any, module: Any) -> None:
        (self.out / f"start-g{self.group}-r{trainer.global_rank}-a{self.attempt}.json").write_text(
            json.dumps({"time": started()}))

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if (trainer.global_step == self.args.kill_at and self.attempt == 0 and trainer.global_rank == 0
                and self.group == self.args.kill_group):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        with (self.out / f"trace-g{self.group}-r{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps({"pid": os.getpid(), "attempt": self.attempt, "step": trainer.global_step,
                                "time": time.time()}) + "\n")
        if self.args.sleep:
            time.sleep(self.args.sleep)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-group", type=int, default=1)
    args = parser.parse_args()
    out = Path(os.environ["PHALANX_TEST_OUT"])
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    torch.manual_seed(group)  # the groups start from different weights: torchft's init_sync gives them group 0's
    module = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy=args.strategy,
                        max_steps=args.steps, log_every_n_steps=10, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        gradient_clip_val=1.0,
                        callbacks=[Trace(out, group, args)])
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    groups = trainer.fabric.replica_groups
    (out / f"final-g{group}-r{trainer.global_rank}.json").write_text(json.dumps({
        "crc": crc(module.net), "loss": full_loss(module.net), "step": trainer.global_step, "pid": os.getpid(),
        "tally": groups.tally.state_dict() if groups is not None else None,
    }))


if __name__ == "__main__":
    main()
