"""The job of tests/strategies/test_ddp.py::test_phalanx_run_cli."""

from job_runner import report

import phalanx

fabric = phalanx.Fabric(accelerator="cpu")   # devices come from `phalanx run --devices 2`
fabric.launch()
report(fabric, world=fabric.world_size, precision=fabric.strategy.precision.name,
       strategy=fabric.strategy.name)
