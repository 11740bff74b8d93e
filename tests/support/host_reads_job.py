"""The job behind tests/utils/test_late_reads.py: steady-state steps of a Trainer fit, then of a Fabric loop on the
same Fabric, counting the host reads of device values phalanx's own code makes (:mod:`host_reads`).

    PHALANX_DEFER_HOST_READS=1 python host_reads_job.py STRATEGY DEVICES [trainer|fabric|both] [cpu|cuda]

The fit uses what users combine: ``self.log`` on step and epoch with ``prog_bar`` and ``sync_dist``, a progress
bar, a CSV logger every ``LOG_EVERY`` steps, ModelCheckpoint, LearningRateMonitor, gradient clipping,
accumulation, a step-interval scheduler, ``Snapshot("auto")`` and the preemption check. The Fabric loop:
``backward`` with ``no_backward_sync`` accumulation, ``clip_gradients``, ``stop_requested``, ``save_snapshot``
(auto). Each rank reports the reads counted between step ``FIRST`` and ``LAST`` of each, outside checkpoint
writes (a checkpoint is a read boundary). DeepSpeed trains one engine per job: it runs each part in a job of its own
(with the Fabric loop on a plain Fabric). On ``cuda`` each rank also reports the synchronizations torch's sync
debug mode sees in the same steps (:class:`host_reads.DeviceSyncs`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

import torch
from host_reads import DeviceSyncs, HostReads
from job_runner import report
from torch import nn
from trainer_support import Regressor, loader

import phalanx
from phalanx.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, Snapshot
from phalanx.loggers import CSVLogger

FIRST, LAST, LOG_EVERY = 12, 52, 10


class Count(Callback):
    """Counts from the end of optimizer step FIRST to the end of step LAST."""

    def __init__(self, counter: HostReads, syncs: DeviceSyncs | None) -> None:
        self.counter, self.syncs = counter, syncs

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.in_window:
            return
        if self.syncs is not None:
            self.syncs.tick()
        if trainer.global_step in (FIRST, LAST):
            self.counter.active = trainer.global_step == FIRST
            if self.syncs is not None:
                self.syncs.active = self.counter.active


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


def fit(strategy: str, devices: int, counter: HostReads, syncs: DeviceSyncs | None) -> phalanx.Trainer:
    trainer = phalanx.Trainer(
        accelerator="cuda" if syncs is not None else "cpu", devices=devices, strategy=strategy,
        max_steps=LAST + 4, log_every_n_steps=LOG_EVERY,
        accumulate_grad_batches=2, gradient_clip_val=1.0, num_sanity_val_steps=0, enable_model_summary=False,
        default_root_dir="root", logger=CSVLogger("logs"),
        callbacks=[Count(counter, syncs), ModelCheckpoint("checkpoints", monitor="train_loss"), LearningRateMonitor(),
                   Snapshot(dirpath="snapshots")])
    module = Regressor(optimizer="adam")
    pause_in(trainer.fabric.strategy, "save_checkpoint", counter)
    with counter, syncs if syncs is not None else contextlib.nullcontext():
        trainer.fit(module, loader(2 * 2 * devices * (LAST + 8), 2))
    return trainer


def fabric_loop(fabric: phalanx.Fabric, counter: HostReads, syncs: DeviceSyncs | None) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    if fabric.strategy.name == "deepspeed":  # one engine from the model and its optimizer together
        model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    else:  # sharded strategies build the optimizer on the set-up (sharded) parameters
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
    with counter, syncs if syncs is not None else contextlib.nullcontext():
        for step in range(1, LAST + 5):
            counter.active = FIRST < step <= LAST
            if syncs is not None:
                syncs.tick()
                syncs.active = counter.active
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
        if syncs is not None:
            syncs.active = False


def main() -> None:
    strategy, devices = sys.argv[1], int(sys.argv[2])
    part, accelerator = (sys.argv[3:] + ["both", "cpu"][len(sys.argv) - 3:])[:2]
    torch.set_num_threads(1)
    trainer_reads, fabric_reads = HostReads(), HostReads()
    trainer_syncs, fabric_syncs = (DeviceSyncs(), DeviceSyncs()) if accelerator == "cuda" else (None, None)
    if part == "fabric":
        fabric = phalanx.Fabric(accelerator=accelerator, devices=devices, strategy=strategy)
        fabric.launch()
    else:
        trainer = fit(strategy, devices, trainer_reads, trainer_syncs)
        fabric = trainer.fabric
        report(fabric, in_trainer=dict(trainer_reads.reads), steps=trainer.global_step,
               **({"syncs_trainer": dict(trainer_syncs.syncs)} if trainer_syncs is not None else {}))
    if part != "trainer":
        fabric_loop(fabric, fabric_reads, fabric_syncs)
        report(fabric, in_fabric=dict(fabric_reads.reads),
               **({"syncs_fabric": dict(fabric_syncs.syncs)} if fabric_syncs is not None else {}))


if __name__ == "__main__":
    main()
