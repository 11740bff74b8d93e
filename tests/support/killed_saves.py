"""Saves killed mid-write: a 2-rank FSDP job saving every step is SIGKILLed at a random moment, and what is left on
disk must be one complete checkpoint (used by tests/strategies/test_fsdp_checkpoint.py and
tests/checkpoint/test_async_sharded.py)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from job_runner import JOBS, kill_mid_run

from phalanx.checkpoint import read_everything

KILL_JOB = JOBS / "fsdp_checkpoint_save_until_killed.py"


def kill_trial(tmp_path: Path, seed: int, strategy: str = "fsdp") -> int:
    """Run the saving job (``strategy``: ``fsdp`` or ``fsdp_async``), SIGKILL every process of it at a random moment
    mid-save; return the step of the checkpoint that survived (and assert it is complete and holds one save's values
    only)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    kill_mid_run(KILL_JOB, tmp_path, args=(strategy,), ranks=2, delay=random.Random(seed).uniform(0.0, 2.0))
    sd = read_everything(tmp_path / "ckpt")  # raises CheckpointError if not complete
    step = int(sd["step"])
    for key, value in sd["model"].items():
        assert torch.all(value == float(step)), f"{key} holds values of another step than {step}"
    assert set(sd["optimizer"]["state"]) == set(range(16))
    return step
