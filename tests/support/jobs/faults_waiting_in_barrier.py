"""Rank 0 waits in a guarded barrier for rank 1, which is alive (heartbeating) but elsewhere, until the test kills
rank 1: then only its frozen heartbeat tells rank 0 what happened (run by tests/distributed/test_faults.py)."""

import time

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2)
fabric.launch()
open(f"ready{fabric.global_rank}", "w").close()
if fabric.global_rank == 0:
    fabric.barrier("wait for rank 1")
else:
    time.sleep(600)
