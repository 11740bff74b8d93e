"""FSDP sharding strategies and meshes on argv[2] ranks, one case after another (argv[1]: the cases as JSON).

Every case trains 4 Adam steps on 8 samples split over the ranks, clipping by the global norm (2, inf, 1, 2), with
the optimizer built before setup; the hybrid cases then round-trip a sharded and a full checkpoint. Run by
tests/strategies/test_fsdp_hybrid.py.
"""

import glob
import json
import sys
from typing import Any, cast

import torch
from fsdp_models import Block, Net, full, full_params, make_data, make_model
from job_runner import report
from torch.distributed.device_mesh import init_device_mesh

import phalanx
from phalanx.strategies import FSDPStrategy


def decode(key: Any, value: Any) -> Any:
    """JSON's lists back into what FSDPStrategy takes: a mesh shape is a tuple, a policy a set of classes."""
    if key.endswith("_policy"):
        return {Block} if value == ["Block"] else value
    return tuple(value) if key == "device_mesh" and isinstance(value, list) else value


CASES = [(name, {k: decode(k, v) for k, v in kwargs.items()}, precision)
         for name, kwargs, precision in json.loads(sys.argv[1])]
DEVICES = int(sys.argv[2])
x, y = make_data()
ce = torch.nn.functional.cross_entropy
NORM_TYPES = (2.0, float("inf"), 1.0, 2.0)

def opt_state(model: Any, opt: Any) -> Any:
    return torch.cat([full(opt.state[p][k]) for p in model.parameters() for k in ("exp_avg", "exp_avg_sq", "step")])

def build(fabric: phalanx.Fabric) -> Any:
    model = make_model()
    return fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))

fabric = None  # the mesh-object case (never the first) reports through the previous case's Fabric
for name, kwargs, precision in CASES:
    if kwargs.get("device_mesh") == "MESH_OBJECT":  # a DeviceMesh built in this process (a group exists now)
        try:
            FSDPStrategy(device_mesh=init_device_mesh("cpu", (2, 1)))
        except phalanx.errors.MisconfigurationError as err:
            report(fabric, unnamed_mesh=str(err))
        kwargs = {**kwargs, "device_mesh": init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))}
    fabric = phalanx.Fabric(accelerator="cpu", devices=DEVICES, strategy=FSDPStrategy(**kwargs), precision=precision)
    fabric.launch()
    r, n = fabric.global_rank, 8 // DEVICES
    mesh = cast(FSDPStrategy, fabric.strategy).mesh
    model, opt = build(fabric)
    norms, unreduced = [], []
    for step, i in enumerate(range(0, 32, 8)):
        opt.zero_grad()
        for micro in range(2):  # accumulate: the first backward skips the reduction of the gradients
            lo, half = i + n * r + micro * n // 2, n // 2
            with fabric.no_backward_sync(model, enabled=micro == 0):
                fabric.backward(ce(model(x[lo : lo + half]), y[lo : lo + half]) / 2)
            if micro == 0:  # no reduce-scatter nor all-reduce ran: no sharded gradient exists yet
                unreduced.append(all(p.grad is None for p in model.parameters()))
        norm = fabric.clip_gradients(model, opt, max_norm=0.25, norm_type=NORM_TYPES[step])
        assert norm is not None
        norms.append(float(norm))
        opt.step()
    weight = model.inp.weight
    report(fabric, **{name: full_params(model), name + ":norms": norms, name + ":unreduced": unreduced,
                      name + ":mesh": list(mesh.shape),
                      name + ":placements": [str(p) for p in weight.placements],
                      name + ":local_rows": weight.to_local().shape[0],
                      name + ":sampler": fabric.strategy.distributed_sampler_kwargs()})
    if name.startswith("hybrid") or name == "no_shard":
        # Replicas created from different random streams (ranks seeded differently, with empty_init too) are made
        # equal at setup: verify_in_sync compares every tensor a rank holds whole.
        in_sync: list[bool | str] = []
        for empty_init in (False, True):
            torch.manual_seed(100 + r)
            with fabric.init_module(empty_init=empty_init):
                other: Any = Net()
            other = fabric.setup_module(other)
            try:
                fabric.verify_in_sync(other)
                in_sync.append(True)
            except Exception as err:
                in_sync.append(str(err)[:200])
        report(fabric, **{name + ":in_sync": in_sync})
    # Sharded checkpoints saved on another mesh load here (DCP reshards between 1-D and 2-D meshes).
    for saved in sorted(glob.glob("ckpt-hybrid*")):
        if saved != f"ckpt-{name}" and not saved.endswith(".pt"):
            fresh_model, fresh_opt = build(fabric)
            fabric.load(saved, {"model": fresh_model, "optimizer": fresh_opt})
            report(fabric, **{f"{name}<-{saved}": full_params(fresh_model)})
    if name.startswith("hybrid"):
        params, state = full_params(model), opt_state(model, opt)
        for path in (f"ckpt-{name}", f"ckpt-{name}.pt"):
            cast(FSDPStrategy, fabric.strategy).state_dict_type = "full" if path.endswith(".pt") else "sharded"
            fabric.save(path, {"model": model, "optimizer": opt, "step": 4})
            fresh_model, fresh_opt = build(fabric)
            fresh = {"model": fresh_model, "optimizer": fresh_opt, "step": 0}
            fabric.load(path, fresh)
            report(fabric, **{path: bool(torch.equal(full_params(fresh_model), params)
                                         and torch.equal(opt_state(fresh_model, fresh_opt), state)
                                         and fresh["step"] == 4)})
