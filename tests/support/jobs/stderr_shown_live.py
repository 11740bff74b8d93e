"""2 ranks print to stdout and stderr; rank 1 prints a handled exception's traceback when argv[1] is ``True``.

Run by tests/distributed/test_failure_output.py: test_log_dir_comes_from_the_environment_and_stderr_stays_live.
"""

import sys

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=2)
fabric.launch()
print(f"stdout of rank {fabric.global_rank}", flush=True)
print(f"stderr of rank {fabric.global_rank}", file=sys.stderr, flush=True)
if fabric.global_rank == 1 and sys.argv[1] == "True":
    try:
        raise OSError("retrying the download")
    except OSError:
        import traceback
        traceback.print_exc()
fabric.barrier()
