"""Evaluation of an FSDP model, ported.

Run by tests/integration/test_porting_dist.py:
test_fsdp_evaluates_between_training_steps_with_the_default_inference_mode.
"""

from job_runner import report
from trainer_support import Regressor, loader

import phalanx

trainer = phalanx.Trainer(accelerator="cpu", devices=2, strategy="fsdp", max_epochs=2, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = Regressor(optimizer="adam", lr=0.01)
trainer.fit(model, loader(32, 4), loader(16, 4))  # sanity check + validation every epoch, inference_mode=True
report(trainer.fabric, steps=trainer.global_step, val=trainer.validate(model, loader(16, 4), verbose=False))
