"""A fit named argv[1] (``first`` or ``second``) that snapshots every step into the folder of default_root_dir
argv[2]; the first holds step 2 until the second has tried (run by tests/trainer/test_survival.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from job_runner import report
from trainer_support import Regressor, loader, quiet

import phalanx

name, root = sys.argv[1], sys.argv[2]


class Pace:  # the first run holds step 2 until the second one has tried
    def on_train_batch_end(self, trainer: phalanx.Trainer, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        Path(f"{name}-at-{trainer.global_step}").touch()
        deadline = time.monotonic() + 120
        while name == "first" and trainer.global_step == 2 and not Path("second-done").exists():
            assert time.monotonic() < deadline, "the second run never finished"
            time.sleep(0.05)


snapshot = phalanx.callbacks.Snapshot(every_n_train_steps=1)
trainer = phalanx.Trainer(**quiet(max_steps=6, default_root_dir=root, callbacks=[snapshot, Pace()]))
module = Regressor()
trainer.fit(module, loader(48, 6))
report(rank=0, folder=str(phalanx.checkpoint.snapshot.default_dir(root)))
