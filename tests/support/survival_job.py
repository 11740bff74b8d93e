"""The job behind the preemption and restart tests: a 2-rank Trainer fit that can be interrupted for real.

    python survival_job.py STRATEGY [--interrupt SIG|KILL --rank R --step N] [--in-save] [--twice]
        [--max-restarts K] [--snapshot] [--fresh | --ckpt-path PATH]

It resumes with ``ckpt_path="last"``, unless ``--fresh`` (``ckpt_path=None``: a preempted run in the folder is
still resumed) or ``--ckpt-path``; rank 0 reports the final weights and step, and every rank appends the (epoch,
sample index) pairs it trains on to ``seen<rank>.txt``, so a test can count them.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import torch
from job_runner import report
from torch.utils.data import Dataset
from trainer_support import Regressor, dataset, flat, quiet

import phalanx


class Indexed(Dataset[Any]):
    """The regression data, with each sample's index, so the samples trained on can be counted."""

    def __init__(self, n: int, dtype: torch.dtype) -> None:
        self.data, self.dtype = dataset(n), dtype

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        x, y = self.data[i]
        return x.to(self.dtype), y.to(self.dtype), torch.tensor(i)


class Tracked(Regressor):
    """Appends each (epoch, sample) it trains on to ``seen<rank>.txt``: the record spans every attempt."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__(optimizer="adam")
        self.data_dtype = dtype
        self.to(dtype)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        with open(f"seen{self.trainer.global_rank}.txt", "a") as fh:
            fh.writelines(f"{self.trainer.current_epoch} {int(i)}\n" for i in idx)
        return super().training_step((x, y), batch_idx)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(Indexed(48, self.data_dtype), batch_size=3, shuffle=True)


class Interrupt:
    """At optimizer step ``step`` on ``rank``: send this process ``sig`` (a real signal, handled like a
    scheduler's; "KILL": SIGKILL, on the first attempt only).
    ``in_save``: send it while that step's periodic checkpoint is being written instead. ``twice``: send it
    again while the preemption checkpoint is being written."""

    def __init__(self, sig: str, rank: int, step: int, in_save: bool = False, twice: bool = False) -> None:
        self.sig, self.rank, self.step, self.in_save, self.twice = sig, rank, step, in_save, twice

    def _due(self, trainer: Any) -> bool:
        return trainer.global_rank == self.rank and trainer.global_step == self.step and not trainer.in_window

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._due(trainer) or self.in_save:
            return
        if self.sig == "KILL":
            if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not os.path.exists("killed"):
                open("killed", "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        elif not os.path.exists("signalled"):
            open("signalled", "w").close()
            os.kill(os.getpid(), getattr(signal, self.sig))

    def on_train_start(self, trainer: Any, module: Any) -> None:
        if trainer.ckpt_path and trainer.is_global_zero:  # where it resumed, to check what the terminal said
            report(rank=0, resumed=[trainer.ckpt_path, trainer.global_step, trainer.current_epoch])

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        if trainer.global_rank != self.rank:
            return
        if self.in_save and self._due(trainer) and not os.path.exists("signalled"):
            open("signalled", "w").close()
            os.kill(os.getpid(), getattr(signal, self.sig))
        elif self.twice and os.path.exists("signalled") and not os.path.exists("twice"):
            open("twice", "w").close()
            os.kill(os.getpid(), getattr(signal, self.sig))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("strategy")
    p.add_argument("--interrupt", default=None)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--snapshot", action="store_true")
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--in-save", action="store_true")
    p.add_argument("--twice", action="store_true")
    args = p.parse_args()
    strategy: Any = args.strategy
    if strategy.startswith("deepspeed_stage_"):
        from phalanx.strategies import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(stage=int(strategy[-1]))
    callbacks: list[Any] = [phalanx.callbacks.ModelCheckpoint(save_last=True, every_n_train_steps=4)]
    if args.snapshot:
        callbacks.append(phalanx.callbacks.Snapshot(every_n_train_steps=1))
    if args.interrupt:
        callbacks.append(Interrupt(args.interrupt, args.rank, args.step, args.in_save, args.twice))
    phalanx.seed_everything(7, verbose=False)
    trainer = phalanx.Trainer(**quiet(
        devices=2, strategy=strategy, max_epochs=args.epochs, enable_checkpointing=True, default_root_dir="run",
        max_restarts=args.max_restarts, callbacks=callbacks, deterministic=True,
    ))
    model = Tracked(torch.float32 if args.strategy.startswith("deepspeed") else torch.float64)  # ZeRO-3: no fp64
    trainer.fit(model, ckpt_path=args.ckpt_path or (None if args.fresh else "last"))
    weights = flat(model)  # every rank: sharded parameters are gathered
    if trainer.is_global_zero:
        report(rank=0, weights=weights, step=trainer.global_step, ckpt_path=trainer.ckpt_path)


if __name__ == "__main__":
    main()
