"""A Trainer fit with ModelParallelStrategy.

Run by tests/strategies/test_model_parallel.py: test_two_by_two_trainer_fit_equals_single_process.
"""

import torch
from job_runner import report
from model_parallel_models import LitNet, full_params, make_data, parallelize_lit
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.strategies import ModelParallelStrategy

torch.set_num_threads(1)
phalanx.seed_everything(7)
trainer = phalanx.Trainer(accelerator="cpu", devices=4, strategy=ModelParallelStrategy(parallelize_lit, 2, 2),
                          max_epochs=2, enable_progress_bar=False, enable_checkpointing=False, logger=False)
model = LitNet()
x, y = make_data()
trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
            DataLoader(TensorDataset(x[:20], y[:20]), batch_size=4))
report(trainer.fabric, params=full_params(model.net), steps=trainer.global_step,
       metrics={k: float(v) for k, v in trainer.callback_metrics.items()})
