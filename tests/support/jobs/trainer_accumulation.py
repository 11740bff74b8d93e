"""Gradient accumulation in a Trainer fit on the strategy in argv[1].

Run by tests/trainer/test_trainer_dist.py: test_accumulation_counts_and_parameters.
"""

import sys

from job_runner import report
from trainer_support import Regressor, flat, loader, quiet

import phalanx

strategy = sys.argv[1]
trainer = phalanx.Trainer(devices=2, strategy=strategy, max_epochs=2, accumulate_grad_batches=4, **quiet())
model = Regressor()
trainer.fit(model, loader(40, 2))
report(trainer.fabric, params=flat(model), counts=model.counts, opt_steps=model.opt.steps,
       global_step=trainer.global_step)
