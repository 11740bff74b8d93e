"""An FSDP save called on rank 0 only.

Run by tests/strategies/test_fsdp_checkpoint.py: test_rank_zero_only_save_raises_named_error_quickly.
"""

import time

from fsdp_models import make_model
from job_runner import report

import phalanx
from phalanx.utils.errors import CollectiveError

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="fsdp")
fabric.launch()
model = fabric.setup_module(make_model())
start = time.monotonic()
try:
    if fabric.global_rank == 0:
        fabric.save("ckpt", {"model": model})  # the classic bug: save only on rank 0
    else:
        fabric.barrier("after save")
    report(fabric, error=None)
except CollectiveError as err:
    report(fabric, error=f"{type(err).__name__}: {err}", seconds=time.monotonic() - start)
