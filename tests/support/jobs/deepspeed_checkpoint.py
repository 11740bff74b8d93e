"""DeepSpeed checkpoints saved and loaded (argv: mode, stage, world size).

Run by tests/strategies/test_deepspeed.py: test_checkpoint_round_trip_and_world_size_change,
test_zero3_save_refuses_incomplete_dirs_and_full_file_loads_into_plain_torch.
"""

import os
import sys
from typing import Any, cast

import torch
from deepspeed_mlp import CountingSGD, batches, flat, make_model, reference, train
from job_runner import report

import phalanx
from phalanx.strategies import DeepSpeedStrategy

mode, stage, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
strategy = DeepSpeedStrategy(stage=stage) if world > 1 else DeepSpeedStrategy(stage=stage, state_dict_type="full")
fabric = phalanx.Fabric(accelerator="cpu", devices=world, strategy=strategy)
fabric.launch()
model = make_model()
model, opt = fabric.setup(model, CountingSGD(model.parameters(), lr=0.1, momentum=0.9))
X, Y = batches(4)
state = {"model": model, "optimizer": opt, "step": 0}
out: dict[str, Any] = {}
if mode == "save":
    train(fabric, model, opt, X, Y, range(2), world)
    state["step"] = 2
    fabric.save("ckpt", state)
    cast(DeepSpeedStrategy, fabric.strategy).state_dict_type = "full"
    fabric.save("full.pt", state)
    train(fabric, model, opt, X, Y, range(2, 4), world)
    # a save killed before its meta file was written: load must refuse the directory
    if fabric.global_rank == 0:
        os.system("cp -r ckpt broken && rm broken/phalanx_meta.pt")
    fabric.barrier()
    try:
        fabric.load("broken", state)
    except Exception as err:
        out["broken"] = f"{type(err).__name__}: {err}"
    if stage == 3:
        # ZeRO-3 pads each partition to ceil(numel / ranks) with never-written memory: rank 1's partition
        # of the 1-element last bias is all padding. Garbage there is not the model's weights...
        out["params"] = flat(fabric.strategy.module_state_dict(model.module))
        weight, *_, bias = model.module.parameters()
        with torch.no_grad():
            if fabric.global_rank == 1:
                bias.ds_tensor.fill_(float("nan"))
            out["finite_despite_padding"] = fabric.strategy.weights_finite(model)
            # ...but a nan this rank really holds is, and every rank hears of it.
            if fabric.global_rank == 1:
                weight.ds_tensor[0] = float("nan")
            out["nan_on_rank1"] = fabric.strategy.weights_finite(model)
else:
    source = "ckpt" if mode == "load_sharded" else "full.pt"
    try:
        fabric.load(source, state)
    except Exception as err:
        out["error"] = f"{type(err).__name__}: {err}"
    else:
        assert state["step"] == 2
        train(fabric, model, opt, X, Y, range(2, 4), world)
out.setdefault("params", flat(fabric.strategy.module_state_dict(model.module)))
report(fabric, calls=CountingSGD.calls, reference=flat(reference(4, X, Y).state_dict()), **out)
