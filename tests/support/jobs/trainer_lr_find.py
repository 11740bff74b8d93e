"""The LR finder under phalanx run.

Run by tests/trainer/test_trainer_dist.py: test_lr_finder_then_ddp_fit_via_phalanx_run.
"""

from typing import Any

import torch
from job_runner import report
from trainer_support import Regressor, flat, loader, quiet

import phalanx
from phalanx.callbacks import LearningRateFinder, ModelCheckpoint
from phalanx.tuner.lr_find import Tuner
from phalanx.utils.seed import capture_rng_state


def same(a: Any, b: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


class Probe:
    '''Runs a search itself and checks that it changed nothing.'''
    def on_fit_start(self, trainer: phalanx.Trainer, module: Any) -> None:
        def state() -> Any:
            return {
                "params": flat(module), "opt": trainer.optimizer.state_dict(),
                "sched": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
                "rng": capture_rng_state()["torch"], "lr": module.lr,
                "counters": [trainer.global_step, trainer.current_epoch, trainer.batches_done, trainer.should_stop],
                "callbacks": [cb.state_dict() for cb in trainer.callbacks if hasattr(cb, "state_dict")],
                "metrics": dict(trainer.callback_metrics),
                "results": trainer.logger_connector.train_state_dict(host=True),
            }
        before = state()
        result = Tuner(trainer).lr_find(module, num_training=15, min_lr=1e-4, max_lr=1.0, update_attr=False)
        after = state()
        report(trainer.fabric, probe_equal={k: same(before[k], after[k]) for k in before}, probe_points=len(result.lrs))


# Standalone: the search runs its probe fits on every rank.
phalanx.seed_everything(3)
probed = Regressor(optimizer="sgd", lr=1e-3)
probed_before, rng_before = flat(probed), capture_rng_state()["torch"]
probe_trainer = phalanx.Trainer(max_epochs=1, **quiet())
found = Tuner(probe_trainer).lr_find(probed, train_dataloaders=loader(64, 4, shuffle=True), num_training=15,
                                     min_lr=1e-4, max_lr=0.1, update_attr=False)
report(probe_trainer.fabric, probe_lrs=found.probe_lrs, probe_scores=found.probe_scores,
       probe_suggestion=found.suggestion(), probe_model_same=bool(torch.equal(flat(probed), probed_before)),
       probe_rng_same=bool(torch.equal(capture_rng_state()["torch"], rng_before)))

phalanx.seed_everything(3)
finder = LearningRateFinder(num_training_steps=20, min_lr=1e-4, max_lr=1.0, plot_path="lr_find.png")
ckpt = ModelCheckpoint(dirpath="ckpts", monitor="val_mae", save_top_k=2)
trainer = phalanx.Trainer(max_epochs=2, callbacks=[Probe(), finder, ckpt], **quiet(enable_checkpointing=True))
model = Regressor(optimizer="adam", lr=1e-3, dropout=0.1)
trainer.fit(model, loader(64, 4, shuffle=True), loader(37, 8))
devices = {str(d) for d in trainer.logger_connector.devices()}
metric_devices = {str(v.device) for v in trainer.callback_metrics.values()}  # step and epoch values alike
report(trainer.fabric, lr=model.lr, suggestion=finder.lr, opt_lr=trainer.optimizer.param_groups[0]["initial_lr"],
       val_mae=float(trainer.callback_metrics["val_mae"]), devices=sorted(devices), device=str(trainer.device),
       metric_devices=sorted(metric_devices), world=trainer.world_size, best=ckpt.best_model_path)
