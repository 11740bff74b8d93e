"""``fabric.init_module(empty_init=True)`` skips the default initialisation, as Lightning does: no random
number is drawn, so a program's own initialisation afterwards draws what it would under Lightning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from job_runner import JOB_PYTHONPATH, JOBS
from torch import nn

from phalanx import Fabric
from phalanx.utils.init import SkipInit, materialize_meta_tensors


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8, padding_idx=0)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 8, 3)


def own_init(module: nn.Module) -> None:
    for p in module.parameters():
        nn.init.normal_(p, std=0.02)


def test_empty_init_draws_no_random_numbers() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with fabric.init_module(empty_init=True):
        model = Block()
    assert torch.equal(torch.get_rng_state(), before)
    # The program's own initialisation now draws exactly the numbers it would with no default init at all
    # (what Lightning's empty_init gives).
    own_init(model)
    torch.manual_seed(7)
    reference = Block.__new__(Block)
    with SkipInit():
        Block.__init__(reference)
    own_init(reference)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_default_init_still_runs_without_empty_init() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    for empty_init in (None, False):
        torch.manual_seed(3)
        before = torch.get_rng_state()
        with fabric.init_module(empty_init=empty_init):
            model = nn.Linear(4, 4)
        assert not torch.equal(torch.get_rng_state(), before)
        torch.manual_seed(3)
        assert torch.equal(model.weight, nn.Linear(4, 4).weight)


def test_skip_init_leaves_init_functions_working_outside() -> None:
    with SkipInit():
        pass
    t = torch.zeros(3)
    nn.init.ones_(t)
    assert torch.equal(t, torch.ones(3))
    with SkipInit(enabled=False):
        nn.init.zeros_(t)
    assert torch.equal(t, torch.zeros(3))


def test_materialize_meta_tensors() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    materialize_meta_tensors(model, "cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(model[1].weight, torch.ones(4))

    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(2))

    with torch.device("meta"):
        bad = NoReset()
    try:
        materialize_meta_tensors(bad, "cpu")
    except TypeError as err:
        assert "NoReset holds tensors on the meta device but defines no reset_parameters()" in str(err)
    else:
        raise AssertionError("a module without reset_parameters was materialised with garbage")


PARITY_SCRIPT = JOBS / "empty_init_weights.py"


def test_same_weights_as_lightning(tmp_path: Path) -> None:
    """Where the Lightning peer is installed: the same program initialises the same weights under both."""
    lightning_python = Path(os.environ.get("PHALANX_LIGHTNING_PYTHON", "/work/lightning-venv/bin/python"))
    if not lightning_python.exists():
        pytest.skip(f"the Lightning peer is not installed ({lightning_python})")
    script = tmp_path / "init.py"
    script.write_text(PARITY_SCRIPT.read_text())
    env = {**os.environ, "PYTHONPATH": JOB_PYTHONPATH}
    ours = subprocess.run([sys.executable, str(script), "phalanx"], capture_output=True, text=True, env=env,
                          timeout=120)
    theirs = subprocess.run([str(lightning_python), str(script), "lightning"], capture_output=True, text=True,
                            timeout=120)
    assert ours.returncode == 0 and theirs.returncode == 0, ours.stderr[-2000:] + theirs.stderr[-2000:]
    assert json.loads(ours.stdout.splitlines()[-1]) == json.loads(theirs.stdout.splitlines()[-1])
