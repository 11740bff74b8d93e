"""Lightning's rank properties under phalanx run.

Run by tests/integration/test_porting_dist.py: test_ranks_are_known_right_after_construction_under_phalanx_run.
"""

from job_runner import report

import phalanx as L

fabric = L.Fabric(accelerator="cpu", devices=2)
trainer = L.Trainer(accelerator="cpu", devices=2, logger=False)
before = (fabric.global_rank, fabric.world_size, fabric.local_rank, trainer.global_rank, trainer.is_global_zero)
fabric.launch()
report(fabric, before=before, after=(fabric.global_rank, fabric.world_size))
