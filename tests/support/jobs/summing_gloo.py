"""An FSDP launch on a gloo whose reduce-scatter sums where it should average (patched in here), which phalanx must
refuse.

Run by tests/fabric/test_bad_input.py: test_fsdp_refuses_a_gloo_whose_reduce_scatter_sums.
"""

import os
from typing import Any

import torch.distributed as dist
from job_runner import report

import phalanx
from phalanx.utils.errors import MisconfigurationError

real = dist.reduce_scatter_tensor

# what gloo did with AVG before the fix
def summing(output: Any, input: Any, op: Any = dist.ReduceOp.SUM, **kwargs: Any) -> Any:
    return real(output, input, op=dist.ReduceOp.SUM, **kwargs)

dist.reduce_scatter_tensor = summing  # type: ignore[assignment]  # the job injects gloo's old behaviour
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="fsdp")
try:
    fabric.launch()
    report(rank=int(os.environ["RANK"]), error=None)
except MisconfigurationError as err:
    report(rank=int(os.environ["RANK"]), error=str(err))
