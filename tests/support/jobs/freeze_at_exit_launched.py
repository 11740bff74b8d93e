"""A launched 2-rank job whose ranks and launcher record, at exit, how many objects ``gc.freeze`` froze
(``frozen-<rank>``, ``frozen-launcher``); run by tests/utils/test_exiting.py."""

import atexit
import gc
import os

# Registered before phalanx registers anything, so it runs last (atexit is last in, first out): it sees what
# the final collection will see. ``gc.freeze`` moves every tracked object to the permanent generation.
atexit.register(lambda: open(f"frozen-{os.environ.get('RANK', 'launcher')}", "w").write(str(gc.get_freeze_count())))

import phalanx  # noqa: E402

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
fabric.barrier()
