"""torchmetrics Metric objects synced over ranks, on the strategy in argv[1].

Run by tests/integration/test_metrics.py: test_two_ranks_metric_objects_exact_identical_and_untouched_by_lr_find.
"""

import sys

from job_runner import report
from metric_models import Classifier, loader, metric_report
from trainer_support import flat, quiet

import phalanx
from phalanx.tuner.lr_find import Tuner

strategy = sys.argv[1]
out = {}
for mode in ("plain", "lr_find"):  # one process set for both runs: two ranks' start-up is most of a job
    phalanx.seed_everything(3)
    trainer = phalanx.Trainer(devices=2, strategy=strategy, max_epochs=2, **quiet())
    model = Classifier("object")
    if mode == "lr_find":
        Tuner(trainer).lr_find(model, train_dataloaders=loader(64, 4, shuffle=True), num_training=12, min_lr=1e-4,
                               max_lr=1.0, update_attr=False)
    trainer.fit(model, loader(64, 4, shuffle=True), loader(37, 8))
    out[mode] = dict(params=flat(model), **metric_report(trainer, model))
report(trainer.fabric, **out)
