"""A 2-rank Trainer fit whose terminal a test reads: both ranks print a long line at every step, rank 0 says a
notice while its tqdm bar is drawn, snapshots are taken ("auto": their cadence is said), rank 1 is killed once
mid-fit (``max_restarts=1``: one restart) and once more after the fit, when no restart is left (the job's exit
code is then the killed rank's, 137).

Run by tests/distributed/test_terminal.py: test_two_ranks_write_whole_lines_and_nothing_is_glued_to_a_bar.
"""

import os
import signal
from typing import Any

import torch
from trainer_support import Regressor, loader, quiet

import phalanx
from phalanx.callbacks import Snapshot, TQDMProgressBar
from phalanx.utils import diagnostics

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
KILL_AT, NOTICE_AT = 12, 40


class Talker(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step, rank = self.trainer.global_step, self.global_rank
        print(f"rank {rank} says step {step} {'.' * 100} end of rank {rank}'s line")
        if rank == 0 and step == NOTICE_AT:
            diagnostics.notice(f"a notice while the bar is drawn (step {step})")
        if rank == 1 and ATTEMPT == 0 and step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


phalanx.seed_everything(3)
trainer = phalanx.Trainer(devices=2, strategy="ddp", max_epochs=2, max_restarts=1,
                          callbacks=[TQDMProgressBar(), Snapshot()],
                          **quiet(enable_progress_bar=True, enable_model_summary=True))
trainer.fit(Talker(), loader(240, 2))
print(f"rank {trainer.global_rank} finished at step {trainer.global_step}")
if trainer.global_rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # no restart left: the job ends with this rank's code
