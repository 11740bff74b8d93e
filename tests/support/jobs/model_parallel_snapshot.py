"""Snapshots of a model-parallel run.

Run by tests/strategies/test_model_parallel.py: test_tensor_parallel_shards_round_trip_through_a_per_rank_snapshot.
"""

import torch
from job_runner import report
from model_parallel_models import full_params, make_model, one_more_step, opt_state, parallelize

import phalanx
from phalanx.strategies import ModelParallelStrategy

torch.set_num_threads(1)
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(parallelize, 1, 2))
fabric.launch()
m = make_model()
model, opt = fabric.setup(m, torch.optim.Adam(m.parameters(), lr=0.01))
for _ in range(2):
    one_more_step(fabric, model, opt)
ref = fabric.save_snapshot({"model": model, "optimizer": opt, "step": 2}, 2, "snapshots", every_n_steps=1)
saved_params, saved_opt = full_params(model), opt_state(model, opt)
one_more_step(fabric, model, opt)
expected_next = full_params(model)
one_more_step(fabric, model, opt)  # away from the snapshot, then back
latest = fabric.latest_checkpoint("snapshots")
assert latest is not None
state = {"model": model, "optimizer": opt, "step": None}
fabric.load(latest, state)
restored = torch.equal(full_params(model), saved_params) and torch.equal(opt_state(model, opt), saved_opt)
one_more_step(fabric, model, opt)
report(fabric, restored=restored, step=state["step"], same_next=torch.equal(full_params(model), expected_next),
       latest=str(latest), ref=str(ref))
fabric.remove_snapshots("snapshots")
