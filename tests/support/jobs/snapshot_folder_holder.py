"""Claims the snapshot folder argv[1] as rank 0, prints ``held`` and waits to be killed (run by
tests/checkpoint/test_snapshot_writer.py)."""

import sys
import time
from pathlib import Path

from phalanx.checkpoint.snapshot import FolderClaim

claim = FolderClaim(Path(sys.argv[1]), 0)
print("held", flush=True)
time.sleep(60)
