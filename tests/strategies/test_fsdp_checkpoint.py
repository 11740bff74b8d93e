"""FSDP checkpoints: sharded and full round trips (model, optimizer, scheduler, scaler, user state),
loading at another world size, ``phalanx consolidate``, guarded saves, and atomicity under kill -9."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import fsdp_models
import pytest
import torch
from job_runner import JOBS, run_job
from killed_saves import kill_trial
from run_if import run_if

from phalanx import Fabric
from phalanx.checkpoint import MARKER, read_everything
from phalanx.cli.commands import main as phalanx_main
from phalanx.utils.errors import CheckpointError

pytestmark = [pytest.mark.timeout(300), run_if(fsdp=True)]

SAVE_JOB = JOBS / "fsdp_checkpoint_save.py"


def _close(got: list[float], expected: list[float]) -> None:
    a, b = torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    assert a.shape == b.shape and torch.allclose(a, b, atol=1e-7), (a - b).abs().max()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    """One 2-rank job: train, save sharded + full, reload both into fresh objects, keep training."""
    tmp_path = tmp_path_factory.mktemp("fsdp_ckpt")
    job = run_job(SAVE_JOB, tmp_path, args=("32-true",)).check()
    return tmp_path, job.reports


@pytest.mark.parametrize("name", ["ckpt", "ckpt.pt"], ids=["sharded", "full"])
def test_round_trip_restores_everything(saved: tuple[Path, dict[int, dict[str, Any]]], name: str) -> None:
    _, reports = saved
    for rank in (0, 1):
        rep = reports[rank]
        _close(rep[name + ":params"], rep["params"])
        _close(rep[name + ":opt"], rep["opt"])
        assert rep[name + ":lr"] == rep["lr"]
        assert rep[name + ":counter"] == 2 and rep[name + ":step"] == 2
        assert rep[name + ":rest"] == ["note"] and rep[name + ":note"] == "hi"
        _close(rep[name + ":after"], rep["after"])
        # fabric.load(path) without state, in the job: each rank reads the whole checkpoint (sharded: no collective).
        _close(rep[name + ":whole"], rep["params"])
        assert rep[name + ":whole_keys"] == ["counter", "model", "note", "optimizer", "scheduler", "step"]
        assert rep[name + ":whole_opt"] == list(range(12))  # torch's index-keyed layout, as in a single file


def test_sharded_layout_and_full_file(saved: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    tmp_path, reports = saved
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert ".metadata" in files and MARKER in files
    assert sum(f.endswith(".distcp") for f in files) == 2  # every rank wrote its own shards
    assert not list(tmp_path.glob(".ckpt.partial-*"))  # the temporary directory was renamed away
    # The full file is the usual single-file layout: plain torch.load, index-keyed optimizer state.
    ckpt = torch.load(tmp_path / "ckpt.pt")  # torch's defaults: weights_only=True on torch >= 2.6
    assert set(ckpt["optimizer"]["state"]) == set(range(12))
    flat = torch.cat([t.reshape(-1).double() for t in ckpt["model"].values()])
    _close(flat.tolist(), reports[0]["params"])


def _load_single_process(path: Path) -> dict[str, Any]:
    """Load into a plain single-device Fabric (no process group) and report the same numbers."""
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fsdp_models.make_model()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(path, state, strict=False)
    exp = torch.cat([torch.cat([opt.state[p][k].reshape(-1).double() for k in ("exp_avg", "exp_avg_sq", "step")])
                     for p in model.parameters()])
    return {"params": fsdp_models.full_params(model), "opt": exp, "step": state["step"]}


def test_consolidate_output_loads_with_torch_load(saved: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    tmp_path, reports = saved
    out = tmp_path / "consolidated.pt"
    assert phalanx_main(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 0
    plain = torch.load(out, weights_only=True)
    full = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert sorted(plain) == sorted(full)
    for key in full["model"]:
        assert torch.equal(plain["model"][key], full["model"][key])
    assert plain["optimizer"]["param_groups"] == full["optimizer"]["param_groups"]
    for i, entry in full["optimizer"]["state"].items():
        for k, v in entry.items():
            assert torch.equal(plain["optimizer"]["state"][i][k], v)
    assert plain["step"] == 2 and plain["counter"] == {"n": 2}
    # Both single files and the sharded directory load into a one-process, unsharded model.
    for path in (out, tmp_path / "ckpt.pt", tmp_path / "ckpt"):
        got = _load_single_process(path)
        _close(got["params"].tolist(), reports[0]["params"])
        _close(got["opt"].tolist(), reports[0]["opt"])
        assert got["step"] == 2


def test_consolidate_refuses_incomplete_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "__0_0.distcp").write_bytes(b"\0" * 10)
    assert phalanx_main(["consolidate", str(tmp_path / "half"), str(tmp_path / "out.pt")]) == 1
    assert "half is not a complete sharded checkpoint: phalanx_meta.pt is missing" in capsys.readouterr().err
    assert not (tmp_path / "out.pt").exists()


WORLD1_JOB = JOBS / "fsdp_checkpoint_load_on_one_rank.py"


def test_load_two_rank_checkpoints_at_world_size_one(saved: tuple[Path, dict[int, dict[str, Any]]],
                                                      tmp_path: Path) -> None:
    saved_dir, reports = saved
    job = run_job(WORLD1_JOB, tmp_path, args=(str(saved_dir),)).check()
    rep = job.reports[0]
    _close(rep["ckpt"], reports[0]["params"])
    _close(rep["ckpt.pt"], reports[0]["params"])
    assert rep["ckpt:step"] == 2 and rep["ckpt.pt:step"] == 2
    assert rep["broken"].startswith("broken is not a complete sharded checkpoint: phalanx_meta.pt is missing")
    assert rep["mismatch"].startswith("The checkpoint does not match Linear: missing keys: [weight, bias]; "
                                      "unexpected keys: [inp.weight, inp.bias, blocks.0.l1.weight")


DDP_LOAD_JOB = JOBS / "fsdp_checkpoint_load_under_ddp.py"


def test_ddp_loads_an_fsdp_sharded_checkpoint(saved: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path) -> None:
    saved_dir, reports = saved
    job = run_job(DDP_LOAD_JOB, tmp_path, args=(str(saved_dir),)).check()
    for rank in (0, 1):
        for name in ("ckpt", "ckpt.pt"):
            _close(job.reports[rank][name], reports[0]["params"])
            _close(job.reports[rank][name + ":opt"], reports[0]["opt"])
            assert job.reports[rank][name + ":step"] == 2


def test_sixteen_mixed_scaler_state_round_trips(tmp_path: Path) -> None:
    reports = run_job(SAVE_JOB, tmp_path, args=("16-mixed",)).check().reports
    for rank in (0, 1):
        rep = reports[rank]
        _close(rep["ckpt:params"], rep["params"])
        _close(rep["ckpt.pt:opt"], rep["opt"])
        _close(rep["ckpt:after"], rep["after"])
    meta = torch.load(tmp_path / "ckpt" / MARKER, weights_only=True)["__phalanx__"]
    assert meta["precision"] == "16-mixed" and meta["precision_state"]["scaler"]["scale"] == reports[0]["scale"]


RANK0_ONLY_JOB = JOBS / "fsdp_rank0_only_save.py"


def test_rank_zero_only_save_raises_named_error_quickly(tmp_path: Path) -> None:
    job = run_job(RANK0_ONLY_JOB, tmp_path, env={"PHALANX_GUARD_TIMEOUT": "5"}, timeout=120)
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["error"] is not None, job.output[-3000:]
        assert rep["error"].startswith("CollectiveMismatchError")
        # The lockstep check's own error, naming both operations (a timeout would say something else).
        assert "rank 0 called save at job.py" in rep["error"] and "after save" in rep["error"]
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("trial", [0, pytest.param(1, marks=pytest.mark.slow)])  # another random kill moment
def test_kill_during_save_leaves_a_loadable_checkpoint(tmp_path: Path, trial: int) -> None:
    kill_trial(tmp_path, seed=trial)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_kill_during_save_many_trials(tmp_path: Path) -> None:
    steps = [kill_trial(tmp_path / str(i), seed=100 + i) for i in range(10)]
    assert max(steps) > 1, steps  # the kills did land after later saves began, not only before


def test_load_refuses_missing_and_partial_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="No checkpoint at"):
        read_everything(tmp_path / "nothing")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"phalanx_meta\.pt is missing"):
        read_everything(tmp_path / "ckpt")


def test_load_finds_the_previous_checkpoint_after_a_crash_mid_publish(
    saved: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without an atomic exchange, publishing takes two renames; a crash between them leaves nothing at
    the path and the previous checkpoint under .old-: load must find it there."""
    import shutil

    saved_dir, _ = saved
    shutil.copytree(saved_dir / "ckpt", tmp_path / ".ckpt.old-0123456789")
    sd = read_everything(tmp_path / "ckpt")
    assert sd["step"] == 2 and "interrupted while replacing it" in caplog.text
    # An interrupted copy that is itself incomplete is still refused, naming it.
    (tmp_path / ".ckpt.old-0123456789" / MARKER).unlink()
    with pytest.raises(CheckpointError, match=r"\.ckpt\.old-0123456789 is not a complete sharded checkpoint"):
        read_everything(tmp_path / "ckpt")


def test_sharded_metadata_that_could_run_code_is_refused(
    saved: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path
) -> None:
    """torch reads DCP's .metadata with plain pickle; phalanx vets it first (weights_only=True)."""
    import pickle
    import shutil

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("echo pwned > pwned.txt",))

    saved_dir, _ = saved
    shutil.copytree(saved_dir / "ckpt", tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"\.metadata names posix\.system.*could run code"):
        read_everything(tmp_path / "ckpt")
    assert phalanx_main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out.pt")]) == 1
    assert not (tmp_path / "pwned.txt").exists() and not Path("pwned.txt").exists()
