"""A DeepSpeed snapshot taken, then restored into the live engine and trained again (argv: stage, precision).

Run by tests/strategies/test_deepspeed.py::test_snapshot_restores_the_zero_partitions_exactly.
"""

import sys
from pathlib import Path
from typing import Any, cast

import torch
from deepspeed_mlp import batches, flat, make_model, train
from job_runner import report

import phalanx
from phalanx.checkpoint import snapshot
from phalanx.strategies import DeepSpeedStrategy

stage, precision = int(sys.argv[1]), sys.argv[2]
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=DeepSpeedStrategy(stage=stage), precision=precision)
fabric.launch()
model = make_model()
model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
X, Y = batches(6)
folder = Path("snapshots").absolute()
state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}


inner = cast(torch.nn.Module, model.module)


def full() -> dict[str, Any]:
    optimizer = fabric.strategy.optimizer_state_dict(inner, opt.optimizer)
    moments = [v for s in optimizer["state"].values() for k, v in sorted(s.items()) if k != "step"]
    return {"params": flat(fabric.strategy.module_state_dict(inner)).tolist(),
            "moments": torch.cat([m.reshape(-1).double() for m in moments]).tolist(),
            "lr": [g["lr"] for g in opt.param_groups]}


train(fabric, model, opt, X, Y, range(3))
state["step"] = 3
ref = fabric.save_snapshot(state, 3, folder, every_n_steps=1)
assert ref is not None
at_snapshot = full()
train(fabric, model, opt, X, Y, range(3, 6))
uninterrupted = full()
state["step"] = -1
fabric.load(ref, state)
restored = full()
train(fabric, model, opt, X, Y, range(3, 6))
resumed = full()
fabric.barrier()  # every rank's copy is complete once its next optimizer step ran
complete = sorted(snapshot.complete_steps(folder))
files = sorted(p.name for p in folder.iterdir() if p.suffix == ".ckpt")
fabric.barrier()  # a rank that ends removes its part of the folder
report(fabric, at_snapshot=at_snapshot, uninterrupted=uninterrupted, restored=restored, resumed=resumed,
       step=state["step"], complete=complete, files=files)
