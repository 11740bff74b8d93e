"""A 2-rank Trainer fit (run by tests/trainer/test_trainer_dist.py: test_ddp_fit_equals_single_process_fit)."""

import torch
from job_runner import report
from trainer_support import Regressor, flat, loader, quiet

import phalanx

phalanx.seed_everything(7)
trainer = phalanx.Trainer(devices=2, strategy="ddp", max_epochs=2, **quiet())
model = Regressor(optimizer="adam", lr=0.01)
trainer.fit(model, loader(64, 4, shuffle=True), loader(37, 8))
report(trainer.fabric, params=flat(model), metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
       steps=trainer.global_step)
# Lightning's trainer.test(other_model) after fit: the same processes and group, another model.
other = Regressor()
with torch.no_grad():
    for p in other.parameters():
        p.fill_(0.25)
tested = trainer.test(other, loader(37, 8))
report(trainer.fabric, other_test=tested[0]["test_mae"], other_params=flat(other), same_params=flat(model))
