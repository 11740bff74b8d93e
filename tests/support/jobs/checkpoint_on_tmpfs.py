"""Saves and loads a checkpoint on a tmpfs folder, on the strategy in argv[1].

Run by tests/checkpoint/test_checkpoint_layer.py: test_real_full_disk_and_read_only_mount_on_two_ranks.
"""

import subprocess
import sys
from typing import Any

import torch
from job_runner import report

import phalanx
from phalanx.utils.errors import CheckpointError

strategy = sys.argv[1]
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
small = fabric.setup(torch.nn.Linear(16, 16))
big = fabric.setup(torch.nn.Linear(1024, 1024))  # 4 MiB: does not fit on the 2 MiB filesystem
out = {}

def attempt(name: str, fn: Any) -> None:
    try:
        fn()
        out[name] = None
    except CheckpointError as err:
        out[name] = str(err)

def load_step(path: Any) -> Any:
    state = {"model": small, "step": -1}
    fabric.load(path, state)
    return state["step"]

fabric.save("disk/good", {"model": small, "step": 1})
attempt("full", lambda: fabric.save("disk/good", {"model": big, "step": 2}))
out["after_full"] = load_step("disk/good")
if fabric.global_rank == 0:
    subprocess.run(["mount", "-o", "remount,ro", "disk"], check=True)
fabric.barrier("remounted read-only")
attempt("read_only", lambda: fabric.save("disk/good", {"model": small, "step": 3}))
out["after_read_only"] = load_step("disk/good")
report(fabric, **out)
