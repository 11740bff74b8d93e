"""Mistakes across 2 ranks under lockstep='strict' (a weighted sampler, a collective on rank 0 only, different
shapes, call sites), each caught; the ranks stay in step (run by tests/fabric/test_bad_input.py)."""

import time
from typing import Any

import torch
from job_runner import report
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2, lockstep="strict")
fabric.launch()
r = fabric.global_rank
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = fabric.setup(model, opt)
out: dict[str, Any] = {}

def case(name: str, fn: Any) -> None:
    start = time.monotonic()
    try:
        fn()
        out[name] = ("ok", "", 0.0)
    except Exception as err:
        out[name] = (type(err).__name__, str(err), time.monotonic() - start)

data = TensorDataset(torch.randn(12, 4), torch.randn(12, 1))
# torch's stub asks for a sequence of floats; a tensor of weights works the same.
weighted = DataLoader(data, sampler=WeightedRandomSampler(torch.ones(12), 12), batch_size=4)  # type: ignore[arg-type]
case("sampler", lambda: fabric.setup_dataloaders(weighted))
# A collective on rank 0 only; rank 1 goes straight on to the next one.
case("save", lambda: fabric.save("x.ckpt", {"model": model}) if r == 0 else fabric.all_gather(torch.zeros(1)))
case("barrier", lambda: fabric.barrier() if r == 0 else fabric.all_gather(torch.zeros(1)))
case("all_reduce", lambda: fabric.all_reduce(torch.ones(3)) if r == 0 else fabric.all_gather(torch.zeros(1)))
case("shapes", lambda: fabric.all_reduce(torch.ones(2 + r)))
if r == 0:  # the same collective from two different lines: only strict mode objects
    case("call_sites", lambda: fabric.barrier())
else:
    case("call_sites", lambda: fabric.barrier())

# Still in step: equal user-sharded loaders train for two epochs, and a loader read on rank 0
# alone (no collectives inside) is not mistaken for a desync.
own = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.randn(8, 4) + r, torch.randn(8, 1)),
                                          batch_size=4), use_distributed_sampler=False)
def train() -> None:
    for _ in range(2):
        for x, y in own:
            fabric.backward((model(x) - y).pow(2).mean())
            opt.step()
            opt.zero_grad()
    if r == 0:
        with torch.no_grad():
            for x, _y in own:
                model(x)
    fabric.barrier("end")
case("train", train)
report(fabric, out=out)
