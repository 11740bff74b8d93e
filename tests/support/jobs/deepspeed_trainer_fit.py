"""A Trainer fit on the strategy in argv[1].

Run by tests/strategies/test_deepspeed.py: test_trainer_accumulation_matches_ddp.
"""

import sys

from job_runner import report
from trainer_support import Regressor, flat, loader, quiet

import phalanx

trainer = phalanx.Trainer(devices=2, strategy=sys.argv[1], max_epochs=1, accumulate_grad_batches=4, **quiet())
model = Regressor()
trainer.fit(model, loader(40, 2))
report(trainer.fabric, params=flat(model), counts=model.counts, opt_steps=model.opt.steps,
       global_step=trainer.global_step)
