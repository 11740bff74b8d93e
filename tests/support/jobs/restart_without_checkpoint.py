"""A 2-rank DDP fit with max_restarts=1 whose rank 1 exits at step 2 of its first attempt, with nothing to resume from
(run by tests/trainer/test_survival.py)."""

from __future__ import annotations

import os
from typing import Any

from trainer_support import Regressor, loader, quiet

import phalanx


class Die:
    def on_train_batch_end(self, trainer: phalanx.Trainer, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == 2 and trainer.global_rank == 1 and not os.path.exists("died"):
            open("died", "w").close()
            os._exit(3)


trainer = phalanx.Trainer(**quiet(devices=2, strategy="ddp", max_steps=4, max_restarts=1, callbacks=[Die()]))
trainer.fit(Regressor(), loader(32, 4))
