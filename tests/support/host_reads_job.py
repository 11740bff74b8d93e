"""The job behind tests/utils/test_late_reads.py: steady-state steps of a Trainer fit, then of a Fabric loop on the
same Fabric, counting the host reads of device values phalanx's own code makes (:mod:`host_reads`).

    PHALANX_DEFER_HOST_READS=1 python host_reads_job.py STRATEGY DEVICES [trainer|fabric|both]

The fit uses what users combine: ``self.log`` on step and epoch with ``prog_bar`` and ``sync_dist``, a progress
bar, a CSV logger every ``LOG_EVERY`` steps, ModelCheckpoint, LearningRateMonitor, gradient clipping,
accumulation, a step-interval scheduler, ``Snapshot("auto")`` and the preemption check. The Fabric loop:
``backward`` with ``no_backward_sync`` accumulation, ``clip_gradients``, ``stop_requested``, ``save_snapshot``
(auto). Each rank reports the reads counted between step ``FIRST`` and ``LAST`` of each, outside checkpoint
writes (a checkpoint is a read boundary). DeepSpeed trains one engine per job: it runs each part in a job of its own
(with the Fabric loop on a plain Fabric).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from host_reads import HostReads
from mp import report
from torch import nn
from trainer_support import Regressor, loader

import phalanx
from phalanx.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, Snapshot
from phalanx.loggers import CSVLogger

FIRST, LAST, LOG_EVERY = 12, 52, 10


class Count(Callback):
    """Counts from the end of optimizer step FIRST to the end of step LAST."""

    def __init__(self, counter: HostReads) -> None:
        self.counter = counter

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.in_window:
            return
        if trainer.global_step == FIRST:
            self.counter.active = True
        elif trainer.global_step == LAST:
            self.counter.active = False


def pause_in(obj: Any, name: str, counter: HostReads) -> None:
    """Reads inside ``obj.name`` (a checkpoint write) are not counted."""
    method = getattr(obj, name)

    @functools.wraps(method)
    def paused(*args: Any, **kwargs: Any) -> Any:
        active, counter.active = counter.active, False
        try:
            return method(*args, **kwargs)
        finally:
            counter.active = active

    setattr(obj, name, paused)


def fit(strategy: str, devices: int, counter: HostReads) -> phalanx.Trainer:
    trainer = phalanx.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=LAST + 4, log_every_n_steps=LOG_EVERY,
        accumulate_grad_batches=2, gradient_clip_val=1.0, num_sanity_val_steps=0, enable_model_summary=False,
        default_root_dir="root", logger=CSVLogger("logs"),
        callbacks=[Count(counter), ModelCheckpoint("checkpoints", monitor="train_loss"), LearningRateMonitor(),
                   Snapshot(dirpath="snapshots")])
    module = Regressor(optimizer="adam")
    pause_in(trainer.fabric.strategy, "save_checkpoint", counter)
    with counter:
        trainer.fit(module, loader(2 * 2 * devices * (LAST + 8), 2))
    return trainer


def fabric_loop(fabric: phalanx.Fabric, counter: HostReads) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    if fabric.strategy.name == "deepspeed":  # one engine from the model and its optimizer together
        model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    else:  # sharded strategies build the optimizer on the set-up (sharded) parameters
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
    with counter:
        for step in range(1, LAST + 5):
            counter.active = FIRST < step <= LAST
            for micro in range(2):
                x = torch.randn(4, 6, device=fabric.device)
                with fabric.no_backward_sync(model, enabled=micro == 0):
                    # model=: the fit's model is set up on this Fabric too and takes no part in this loop
                    fabric.backward(nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)) / 2, model=model)
            fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad()
            fabric.save_snapshot({"model": model, "optimizer": optimizer, "step": step}, step, "fabric-snapshots")
            if fabric.stop_requested():
                break
        counter.active = False


def main() -> None:
    strategy, devices, part = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "both"
    torch.set_num_threads(1)
    trainer_reads, fabric_reads = HostReads(), HostReads()
    if part == "fabric":
        fabric = phalanx.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
        fabric.launch()
    else:
        trainer = fit(strategy, devices, trainer_reads)
        fabric = trainer.fabric
        report(fabric, in_trainer=dict(trainer_reads.reads), steps=trainer.global_step)
    if part != "trainer":
        fabric_loop(fabric, fabric_reads)
        report(fabric, in_fabric=dict(fabric_reads.reads))


if __name__ == "__main__":
    main()
