"""A fit with metrics run in full, killed, or resumed (argv[1]: full|kill|resume).

Run by tests/integration/test_metrics.py: test_ddp_killed_mid_epoch_resumes_with_the_same_metric_objects.
"""

import sys

from job_runner import report
from metric_models import Classifier, loader
from trainer_support import KillAt, flat, quiet

import phalanx
from phalanx.callbacks import ModelCheckpoint

mode = sys.argv[1]


phalanx.seed_everything(5)
ckpt = ModelCheckpoint(dirpath="ckpt", every_n_train_steps=3, save_last=True, save_top_k=0)
trainer = phalanx.Trainer(devices=2, strategy="ddp", max_epochs=2, callbacks=[KillAt(13, active=mode == "kill"), ckpt],
                          **quiet(enable_checkpointing=True))
model = Classifier("object", dropout=0.3)
trainer.fit(model, loader(64, 4, shuffle=True), loader(21, 5), ckpt_path="last" if mode == "resume" else None)
report(trainer.fabric, params=flat(model), metrics={k: float(v) for k, v in trainer.callback_metrics.items()})
