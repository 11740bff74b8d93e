"""A Trainer that launches its ranks at fit.

Run by tests/integration/test_porting_dist.py:
test_trainer_launches_at_fit_and_manual_optimization_under_ddp_equals_one_process.
"""

import os
from pathlib import Path

from job_runner import report
from porting_models import TwoOptimizers, data, flat
from torch.utils.data import DataLoader

import phalanx as L

trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
# Reached by the original process too: constructing the Trainer started nothing.
Path(f"constructed-{os.environ.get('RANK', 'parent')}").touch()
model = TwoOptimizers()
trainer.fit(model, DataLoader(data(24), batch_size=4))
report(trainer.fabric, params=flat(model), steps=trainer.global_step,
       metrics={k: float(v) for k, v in trainer.callback_metrics.items()})
