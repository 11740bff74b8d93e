"""A Trainer fit run in full, killed, or resumed (argv: strategy, full|kill|resume).

Run by tests/checkpoint/test_checkpoint_layer.py:
test_trainer_with_directory_checkpoints_rotates_and_resumes_bit_identical.
"""

import sys

import torch
from job_runner import report
from trainer_support import KillAt, Regressor, flat, loader, quiet

import phalanx
from phalanx.callbacks import ModelCheckpoint

strategy, mode = sys.argv[1], sys.argv[2]


phalanx.seed_everything(5)
ckpt = ModelCheckpoint(dirpath="ckpt", every_n_train_steps=2, save_top_k=1, save_last=True)
trainer = phalanx.Trainer(devices=2, strategy=strategy, max_epochs=3, accumulate_grad_batches=2,
                          callbacks=[KillAt(7, active=mode == "kill"), ckpt], deterministic=True,
                          **quiet(enable_checkpointing=True))
# deterministic=True also fills every torch.empty with NaN; DeepSpeed allocates its 5e8-element gradient
# buckets that way on every step (~10 s per batch here). The kernels stay deterministic without it.
torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]  # a flag torch's stubs lack
model = Regressor(optimizer="adam", lr=0.01, dropout=0.3)  # dropout: each rank's RNG stream matters
trainer.fit(model, loader(48, 3, shuffle=True), ckpt_path="last" if mode == "resume" else None)
report(trainer.fabric, params=flat(model), step=trainer.global_step, resumed_from=trainer.ckpt_path,
       loss=float(trainer.callback_metrics["train_loss_epoch"]), best=ckpt.best_model_path)
