"""A fit resumed at another global batch size.

Run by tests/trainer/test_resume_other_batch.py: test_ddp_checkpoint_resumes_on_one_process_and_with_a_smaller_batch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from job_runner import report
from survival_job import Indexed
from torch.utils.data import DataLoader
from trainer_support import Regressor, quiet

import phalanx

messages: list[str] = []
mode = "first"


class Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("The checkpoint was written with"):
            messages.append(record.getMessage())


class Seen(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y, idx = batch
        with open(f"seen_{mode}_{self.trainer.global_rank}.txt", "a") as fh:
            fh.writelines(f"{self.trainer.current_epoch} {int(i)} {batch_idx}\n" for i in idx)
        return super().training_step((x, y), batch_idx)


class SaveAt:
    def on_train_batch_end(self, trainer: phalanx.Trainer, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == 5 and not trainer.in_window:
            trainer.save_checkpoint("mid.ckpt")


logging.getLogger("phalanx").addHandler(Keep())
# The first run: 2 ranks x batch 4, stopped after step 5 (its checkpoint is written then), at sample 40.
phalanx.seed_everything(3, verbose=False)
trainer = phalanx.Trainer(**quiet(devices=2, strategy="ddp", max_steps=5, callbacks=[SaveAt()]))
trainer.fit(Seen(optimizer="adam"), DataLoader(Indexed(51, torch.float64), batch_size=4, shuffle=True))
# Resumed in the same processes with 2 ranks x batch 3.
mode = "resume"
phalanx.seed_everything(3, verbose=False)
trainer = phalanx.Trainer(**quiet(devices=2, strategy="ddp", max_epochs=2))
trainer.fit(Seen(optimizer="adam"), DataLoader(Indexed(51, torch.float64), batch_size=3, shuffle=True),
            ckpt_path="mid.ckpt")
report(trainer.fabric, step=trainer.global_step, messages=messages)
