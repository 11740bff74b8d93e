"""Resume on any topology: a Trainer checkpoint written mid-epoch by one strategy and world size
continues under any other, with the data position exact.

Each pair (save topology -> load topology) is a fit of 2 epochs stopped after step 5 of 8 (its last
checkpoint is mid-epoch 0), then resumed from ``last`` in the same checkpoint folder by the other
topology, which keeps saving there (in its own layout, replacing the other one's). The global batch
is the same everywhere (ranks x per-rank batch = 4), so the resumed run must see every sample exactly
once per epoch over both attempts and end with the weights of one uninterrupted run (single process)
to float32 rounding. The job (tests/support/topology_job.py) runs many pairs per process start: the
saves and the loads of one world size share a job, a pair whose world size changes loads in a later job.

The default tier runs the pairs of reported failures; the rest of the matrix is ``slow``, as are the pairs of
ModelParallelStrategy (``model_parallel@4``: 2 data-parallel x 2 tensor-parallel ranks, a per-rank batch of 2)
to and from FSDP, DDP, one process and ZeRO-1, and those of ZeRO-1 (``deepspeed_stage_1@2``) with DDP and FSDP.
"""

from __future__ import annotations

import json
from collections import defaultdict
from itertools import product
from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import JOBS, run_job
from run_if import missing, run_if
from topology_job import EPOCHS, FABRIC_STEPS, GLOBAL_BATCH, SAMPLES

import phalanx
import phalanx.checkpoint as checkpoint
import phalanx.checkpoint.layer as layer
import phalanx.checkpoint.replace as replace
import phalanx.checkpoint.storage as storage
from phalanx.utils.errors import CheckpointError

TOPOLOGIES = ("single@1", "ddp@2", "fsdp@2", "deepspeed_stage_2@2", "deepspeed_stage_3@2", "ddp@4")
STOP = 5  # of 8 steps per epoch: the checkpoint the second attempt resumes from is mid-epoch 0
STEPS = EPOCHS * SAMPLES // GLOBAL_BATCH
PER_JOB = 12
#: The pairs of the reported failures (and a world-size change) run by default; the others are slow.
DEFAULT = (("ddp@2", "fsdp@2"), ("ddp@2", "deepspeed_stage_3@2"), ("fsdp@2", "single@1"))
#: A Fabric loop's sharded FSDP checkpoint loaded under DeepSpeed (fabric.save / fabric.load).
FABRIC = ("fsdp@2", "deepspeed_stage_2@2")
JOB = JOBS / "topology_matrix.py"


def _ranks(topology: str) -> int:
    return int(topology.split("@")[1])


def _needs(*topologies: str) -> dict[str, bool]:
    return {"fsdp": any(t.startswith(("fsdp", "model_parallel")) for t in topologies),
            "deepspeed": any(t.startswith("deepspeed") for t in topologies)}


def _runnable(pair: tuple[str, str]) -> bool:
    return not missing(**_needs(*pair))


def tag(save: str, load: str) -> str:
    return f"{save}->{load}"


def run_matrix(tmp: Path, pairs: list[tuple[str, str]], fabric: tuple[str, str] | None = None) -> dict[str, Any]:
    """Run ``pairs`` (and the Fabric pair) in as few process starts as their world sizes allow, plus the
    uninterrupted reference run; rank 0's reports by tag."""
    phases: list[dict[int, list[list[Any]]]] = [defaultdict(list), defaultdict(list)]
    for save, load in pairs:
        folder = str(tmp / tag(save, load).replace("->", "-to-").replace("@", "_"))
        phases[0][_ranks(save)].append(["fit", save, folder, STOP, False, "save:" + tag(save, load)])
        later = _ranks(save) != _ranks(load)
        phases[later][_ranks(load)].append(["fit", load, folder, None, True, "load:" + tag(save, load)])
    if fabric is not None:
        path = str(tmp / "fabric.ckpt")
        phases[0][_ranks(fabric[0])].append(["fabric_save", fabric[0], path, "fabric_save"])
        phases[_ranks(fabric[0]) != _ranks(fabric[1])][_ranks(fabric[1])].append(
            ["fabric_load", fabric[1], path, "fabric_load"])
    phases[1 if 1 in phases[1] or 1 not in phases[0] else 0][1].append(
        ["fit", "single@1", str(tmp / "reference"), None, False, "reference"])
    reports: dict[str, Any] = {}
    for index, phase in enumerate(phases):
        for world, steps in sorted(phase.items()):
            # In order (a load follows its save), at most PER_JOB steps a process: a hang or a crash costs
            # one chunk, and a process does not grow without bound (DeepSpeed keeps memory per engine).
            for start in range(0, len(steps), PER_JOB):
                chunk = steps[start : start + PER_JOB]
                where = tmp / f"job{index}-{world}ranks-{start // PER_JOB}"
                where.mkdir()
                # ~3 s per 2-rank fit on a loaded 2-CPU box; the job's own limit keeps a hang from lasting.
                job = run_job(JOB, where, args=(json.dumps(chunk),), timeout=120 + 20 * len(chunk)).check()
                assert sorted(job.reports) == list(range(world)), job.output[-3000:]
                reports.update(job.reports[0])
    return reports


def check_pair(reports: dict[str, Any], save: str, load: str) -> None:
    saved, resumed, reference = reports["save:" + tag(save, load)], reports["load:" + tag(save, load)], reports[
        "reference"]
    for name, run in (("saving", saved), ("resumed", resumed), ("reference", reference)):
        assert "error" not in run, f"{tag(save, load)}: the {name} run failed: {run.get('error')}"
    assert saved["step"] == STOP and resumed["step"] == reference["step"] == STEPS
    seen = saved["seen"] + resumed["seen"]
    for epoch in range(EPOCHS):
        samples = sorted(i for e, i in seen if e == epoch)
        assert samples == list(range(SAMPLES)), f"{tag(save, load)}: epoch {epoch} trained on {samples}"
    difference = (torch.tensor(resumed["weights"]) - torch.tensor(reference["weights"])).abs().max().item()
    assert difference <= 1e-5, f"{tag(save, load)}: resumed weights differ from the uninterrupted run's by {difference}"


# ---------------------------------------------------------------------- a checkpoint of the other layout
def _directory_checkpoint(path: Path, step: int) -> None:
    path.mkdir(parents=True)
    (path / "shard").write_text(str(step))
    torch.save({"__phalanx__": {}, "extras": {}}, path / checkpoint.MARKER)


@pytest.mark.parametrize("exchange", [True, False], ids=["atomic-exchange", "two-renames"])
def test_a_checkpoint_of_the_other_layout_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """A run that changes strategy saves where the earlier attempt did: a directory replaces a file
    checkpoint and a file replaces a directory checkpoint, each only once the new one is complete."""
    if not exchange:  # a filesystem without renameat2(RENAME_EXCHANGE)
        monkeypatch.setattr(storage, "_exchange", lambda a, b: False)
    fabric = phalanx.Fabric(accelerator="cpu")
    target = tmp_path / "last.ckpt"
    fabric.save(target, {"step": 1})
    tmp = layer.begin_directory(fabric.strategy, target)  # a file checkpoint there is no obstacle
    _directory_checkpoint(tmp, 2)
    replace.publish_directory(tmp, target)
    assert (target / "shard").read_text() == "2"
    fabric.save(target, {"step": 3})
    assert target.is_file() and torch.load(target, weights_only=True)["step"] == 3
    assert not list(tmp_path.glob(".last.ckpt.old-*"))  # the replaced checkpoint is gone once the new one is in place


def test_what_is_not_a_checkpoint_is_never_replaced(tmp_path: Path) -> None:
    fabric = phalanx.Fabric(accelerator="cpu")
    notes = tmp_path / "notes.txt"
    notes.write_text("user data")
    with pytest.raises(CheckpointError, match=r"a file that is not a phalanx checkpoint exists at that path"):
        layer.begin_directory(fabric.strategy, notes)
    assert not replace.is_checkpoint_file(notes) and notes.read_text() == "user data"
    plain = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, plain)  # a torch file, but not phalanx's
    assert not replace.is_checkpoint_file(plain)
    data = tmp_path / "data"
    data.mkdir()
    (data / "keep.txt").write_text("user data")
    with pytest.raises(CheckpointError, match=r"a directory exists at that path"):
        fabric.save(data, {"step": 1})
    assert (data / "keep.txt").read_text() == "user data"


# ---------------------------------------------------------------------- default tier
@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pairs = [pair for pair in DEFAULT if _runnable(pair)]
    fabric = FABRIC if _runnable(FABRIC) else None
    if not pairs and fabric is None:
        pytest.skip("; ".join(missing(fsdp=True, deepspeed=True)))
    return run_matrix(tmp_path_factory.mktemp("topology"), pairs, fabric)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("save", "load"), [pytest.param(*pair, marks=run_if(**_needs(*pair)), id=tag(*pair))
                                            for pair in DEFAULT])
def test_trainer_resumes_exactly_on_another_topology(reported: dict[str, Any], save: str, load: str) -> None:
    check_pair(reported, save, load)
    if (save, load) == ("ddp@2", "fsdp@2"):
        # The second attempt saved into the folder where the first left a single file: its own layout
        # (a directory) replaced it, and the last save is complete and readable.
        folder = Path(reported["load:" + tag(save, load)]["folder"])
        last = checkpoint.find(folder / "last.ckpt")
        assert last is not None and last.path.is_dir() and last.problem is None and not last.recovered
        state = checkpoint.read_everything(folder / "last.ckpt")
        assert state["__phalanx__"]["strategy"] == "fsdp" and state["loops"]["global_step"] >= 10


@pytest.mark.timeout(400)
@run_if(fsdp=True, deepspeed=True)
def test_fabric_fsdp_checkpoint_loads_under_deepspeed(reported: dict[str, Any]) -> None:
    saved, loaded = reported["fabric_save"], reported["fabric_load"]
    assert "error" not in loaded, loaded["error"]
    assert loaded["step"] == FABRIC_STEPS
    assert loaded["weights"] == saved["weights"]
    assert sorted(loaded["optimizer"]) == sorted(saved["optimizer"]) == ["0", "1", "2", "3"]
    for index, state in saved["optimizer"].items():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in state.items():
            assert loaded["optimizer"][index][key] == value, f"optimizer state {index}.{key}"


# ---------------------------------------------------------------------- the rest of the matrix
REST = [pair for pair in product(TOPOLOGIES, TOPOLOGIES) if pair not in DEFAULT]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_matrix(tmp_path_factory.mktemp("matrix"), [pair for pair in REST if _runnable(pair)])


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the first test runs every pair's jobs (the fixture); the others only check
@pytest.mark.parametrize(("save", "load"), [pytest.param(*pair, marks=run_if(**_needs(*pair)), id=tag(*pair))
                                            for pair in REST])
def test_matrix(matrix: dict[str, Any], save: str, load: str) -> None:
    check_pair(matrix, save, load)


# ---------------------------------------------------------------------- tensor parallel x FSDP, and ZeRO-1
# model_parallel@4 is a 2 (data-parallel) x 2 (tensor-parallel) mesh: 4 ranks on a 2-core machine, so slow. Its
# per-rank batch is 2 (tensor-parallel peers share a batch), so the global batch is 4 as everywhere.
# model_parallel_full@4 saves one full file (save_distributed_checkpoint=False) instead of DCP shards.
MODEL_PARALLEL = [("fsdp@2", "model_parallel@4"), ("ddp@2", "model_parallel@4"),
                  ("model_parallel@4", "fsdp@2"), ("model_parallel@4", "single@1"),
                  ("model_parallel_full@4", "fsdp@2"), ("fsdp@2", "model_parallel_full@4"),
                  ("deepspeed_stage_1@2", "model_parallel@4"), ("model_parallel@4", "deepspeed_stage_1@2")]
STAGE_1 = [("deepspeed_stage_1@2", "ddp@2"), ("ddp@2", "deepspeed_stage_1@2"),
           ("deepspeed_stage_1@2", "fsdp@2"), ("fsdp@2", "deepspeed_stage_1@2")]


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_matrix(tmp_path_factory.mktemp("model_parallel"), [p for p in MODEL_PARALLEL if _runnable(p)])


@pytest.fixture(scope="module")
def stage_1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_matrix(tmp_path_factory.mktemp("stage_1"), [p for p in STAGE_1 if _runnable(p)])


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first runs the fixture's jobs (4-rank starts on 2 cores); the others only check
@pytest.mark.parametrize(("save", "load"), [pytest.param(*pair, marks=run_if(**_needs(*pair)), id=tag(*pair))
                                            for pair in MODEL_PARALLEL])
def test_model_parallel_resumes_from_and_into_fsdp(model_parallel: dict[str, Any], save: str, load: str) -> None:
    check_pair(model_parallel, save, load)
    # The resumed run saved over the other's checkpoint in its own layout, recorded as its strategy's.
    last = Path(model_parallel["load:" + tag(save, load)]["folder"]) / "last.ckpt"
    name = load.split("@")[0]
    assert last.is_dir() == (name not in ("single", "model_parallel_full"))
    saved_by = "deepspeed" if name.startswith("deepspeed") else name.removesuffix("_full")
    assert checkpoint.read_everything(last)["__phalanx__"]["strategy"] == saved_by


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("save", "load"), [pytest.param(*pair, marks=run_if(**_needs(*pair)), id=tag(*pair))
                                            for pair in STAGE_1])
def test_deepspeed_stage_1_resumes_on_another_topology(stage_1: dict[str, Any], save: str, load: str) -> None:
    check_pair(stage_1, save, load)
