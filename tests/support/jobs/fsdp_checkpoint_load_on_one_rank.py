"""Loads the checkpoints in the folder argv[1] on one rank.

Run by tests/strategies/test_fsdp_checkpoint.py: test_load_two_rank_checkpoints_at_world_size_one.
"""

import shutil
import sys

import torch
from fsdp_models import full_params, make_model
from job_runner import report

import phalanx
from phalanx.utils.errors import CheckpointError

SAVED = sys.argv[1]  # the folder the saving job wrote
fabric = phalanx.Fabric(accelerator="cpu", devices=1, strategy="fsdp")
fabric.launch()
for name in (f"{SAVED}/ckpt", f"{SAVED}/ckpt.pt"):
    model = make_model()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(name, state, strict=False)
    report(fabric, **{name.split("/")[-1]: full_params(model), name.split("/")[-1] + ":step": state["step"]})

# A directory without the completion marker is refused.
shutil.copytree(f"{SAVED}/ckpt", "broken")
(__import__("pathlib").Path("broken") / "phalanx_meta.pt").unlink()
try:
    fabric.load("broken", {"model": model})
    report(fabric, broken=None)
except CheckpointError as err:
    report(fabric, broken=str(err))
# A checkpoint of another model names what does not match.
other = fabric.setup_module(torch.nn.Linear(6, 3))
try:
    fabric.load(f"{SAVED}/ckpt", {"model": other})
    report(fabric, mismatch=None)
except CheckpointError as err:
    report(fabric, mismatch=str(err))
