"""A 2-rank DDP Trainer fit in which rank 1 (argv[1] ``rank1``), or both ranks (``both``), raise at batch 2, on
every attempt under ``max_restarts`` argv[2] (default 0).

Run by tests/distributed/test_failure_output.py.
"""

import sys
from typing import Any

from trainer_support import Regressor, loader, quiet

import phalanx

WHO = sys.argv[1]
MAX_RESTARTS = int(sys.argv[2]) if len(sys.argv) > 2 else 0


class Crashing(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        print(f"rank {self.global_rank} batch {batch_idx}", flush=True)
        if batch_idx == 2 and (WHO == "both" or self.global_rank == 1):
            raise ValueError(f"bad batch at step {batch_idx}")  # the line the summary names
        return super().training_step(batch, batch_idx)


phalanx.Trainer(devices=2, strategy="ddp", max_epochs=1, max_restarts=MAX_RESTARTS, **quiet()).fit(Crashing(),
                                                                                                   loader(32, 4))
