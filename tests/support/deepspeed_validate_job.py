"""The job of tests/strategies/test_deepspeed.py's ``validate(ckpt_path=...)`` test; job scripts import
this module, which holds no tests itself.

On two ranks, ``Trainer(strategy="deepspeed_stage_<N>")`` fits a Regressor, validates it and saves a
sharded (DeepSpeed engine) checkpoint. A new Trainer then validates a new, untrained Regressor with
``ckpt_path=`` that checkpoint: evaluation sets the module up without its optimizer, so no DeepSpeed
engine exists to read the ZeRO partitions. Each rank reports the three metrics, and whether the loaded
weights equal the fitted ones.
"""

from __future__ import annotations

import sys

import torch
from job_runner import report
from trainer_support import Regressor, flat, loader, quiet

import phalanx


def _full(trainer: phalanx.Trainer, module: torch.nn.Module) -> torch.Tensor:
    """The module's full weights in one vector (ZeRO-3's partitions gathered: call it on every rank)."""
    state = trainer.strategy.module_state_dict(module)
    return torch.cat([value.detach().reshape(-1).double().cpu() for value in state.values()])


def main() -> None:
    strategy = f"deepspeed_stage_{sys.argv[1]}"
    trainer = phalanx.Trainer(devices=2, strategy=strategy, max_epochs=2, **quiet())
    model = Regressor()
    trainer.fit(model, loader(32, 4))
    fitted = trainer.validate(model, loader(16, 4), verbose=False)[0]["val_mae"]
    weights = _full(trainer, model)
    trainer.save_checkpoint("fitted")
    layout = torch.load("fitted/phalanx_meta.pt", weights_only=True)["__phalanx__"]["layout"]
    evaluator = phalanx.Trainer(devices=2, strategy=strategy, **quiet())
    other = Regressor()
    untrained = flat(other)
    loaded = evaluator.validate(other, loader(16, 4), ckpt_path="fitted", verbose=False)[0]["val_mae"]
    report(evaluator.fabric, fitted=fitted, loaded=loaded, layout=layout,
           equal=bool(torch.equal(_full(evaluator, other), weights)), moved=not torch.equal(flat(other), untrained))
