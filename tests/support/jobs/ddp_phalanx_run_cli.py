"""A Fabric whose devices come from phalanx run --devices 2 reports its world size, precision and strategy.

Run by tests/strategies/test_ddp.py.
"""

from job_runner import report

import phalanx

fabric = phalanx.Fabric(accelerator="cpu")   # devices come from `phalanx run --devices 2`
fabric.launch()
report(fabric, world=fabric.world_size, precision=fabric.strategy.precision.name,
       strategy=fabric.strategy.name)
