"""A fit named argv[1] (``first`` or ``second``) in the default_root_dir argv[2], as a user's script would run it:
2 ranks, max_restarts=2, a CSV logger, a checkpoint every 2 steps and a snapshot every step. The first holds
step 2 until the second has tried (run by tests/trainer/test_survival.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from job_runner import report
from trainer_support import Regressor, loader, quiet

import phalanx
from phalanx.loggers import CSVLogger

name, root = sys.argv[1], sys.argv[2]


class Pace:  # the first run holds step 2 until the second one has tried
    def on_train_batch_end(self, trainer: phalanx.Trainer, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        Path(f"{name}-at-{trainer.global_step}").touch()
        deadline = time.monotonic() + 120
        while name == "first" and trainer.global_step == 2 and not Path("second-done").exists():
            assert time.monotonic() < deadline, "the second run never finished"
            time.sleep(0.05)


callbacks = [phalanx.callbacks.ModelCheckpoint(save_last=True, every_n_train_steps=2),
             phalanx.callbacks.Snapshot(every_n_train_steps=1), Pace()]
trainer = phalanx.Trainer(**quiet(devices=2, strategy="ddp", max_steps=6, default_root_dir=root, max_restarts=2,
                                  logger=CSVLogger(root, name="csv"), log_every_n_steps=1, callbacks=callbacks))
trainer.fit(Regressor(), loader(48, 6))
if trainer.is_global_zero:
    report(rank=0, folder=str(phalanx.checkpoint.snapshot.default_dir(root)))
