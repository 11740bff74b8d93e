"""A DDP fit run in full, killed, or resumed (argv[1]: full|kill|resume).

Run by tests/trainer/test_trainer_resume.py: test_ddp_killed_mid_epoch_resumes_bit_identical.
"""

import sys

from job_runner import report
from trainer_support import KillAt, Regressor, flat, loader, quiet

import phalanx
from phalanx.callbacks import ModelCheckpoint

mode = sys.argv[1]


phalanx.seed_everything(5)
ckpt = ModelCheckpoint(dirpath="ckpt", every_n_train_steps=2, save_last=True, save_top_k=0)
trainer = phalanx.Trainer(devices=2, strategy="ddp", max_epochs=3, accumulate_grad_batches=2,
                          callbacks=[KillAt(7, active=mode == "kill"), ckpt], deterministic=True,
                          **quiet(enable_checkpointing=True))
model = Regressor(optimizer="adam", lr=0.01, dropout=0.3)  # dropout: each rank's RNG stream matters
trainer.fit(model, loader(48, 3, shuffle=True), ckpt_path="last" if mode == "resume" else None)
report(trainer.fabric, params=flat(model), step=trainer.global_step,
       loss=float(trainer.callback_metrics["train_loss_epoch"]))
