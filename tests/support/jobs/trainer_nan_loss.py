"""A nan loss on one rank in a Trainer fit.

Run by tests/trainer/test_trainer_guards.py: test_non_finite_loss_on_one_rank_ends_the_ddp_job.
"""

from torch.utils.data import DataLoader, TensorDataset
from trainer_support import Regressor, dataset, quiet

import phalanx

x, y = dataset(48).tensors
x = x.clone()
x[9, 0] = float("nan")  # rank 1's 5th sample: its batch 1
trainer = phalanx.Trainer(devices=2, strategy="ddp", max_epochs=2, **quiet())
trainer.fit(Regressor(), DataLoader(TensorDataset(x, y), batch_size=4))
