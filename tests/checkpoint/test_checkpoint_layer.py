"""The checkpoint layer across strategies: files that open safely, failures with their true cause on
every rank, directory checkpoints under the Trainer (rotation, resume), and a diverged run never
replacing a good checkpoint."""

from __future__ import annotations

import argparse
import ast
import enum
import errno
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fake_trainer import FakeTrainer, end_epoch
from job_runner import JOBS, REPO, run_job
from run_if import run_if
from torch import nn
from trainer_support import Regressor, loader, quiet

import phalanx
from phalanx import Fabric
from phalanx.callbacks import EarlyStopping, ModelCheckpoint
from phalanx.checkpoint import MARKER, storage
from phalanx.errors import CheckpointError, PhalanxWarning
from phalanx.fabric.anomaly import NonFiniteError

pytestmark = pytest.mark.timeout(420)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# ---------------------------------------------------------------------- structure
def test_checkpoint_package_never_imports_strategies_and_deepspeed_files_do_not_cycle() -> None:
    """The layer is below the strategies: importing them from it (or DeepSpeed's checkpoint helper
    importing its strategy back) is the cycle this layer exists to remove."""

    def imports(path: Path) -> set[str]:
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                out.add(node.module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        return out

    src = REPO / "src" / "phalanx"
    for path in (src / "checkpoint").rglob("*.py"):
        assert not [m for m in imports(path) if m.startswith("phalanx.strategies")], path
        if path.name != "__init__.py":  # a module of the package never goes through its own __init__
            assert "phalanx.checkpoint" not in imports(path), path
    for backend in ("deepspeed", "fsdp"):
        assert f"phalanx.strategies.{backend}.strategy" not in imports(src / "strategies" / backend / "checkpoint.py")


def test_every_checkpoint_module_is_public_or_behind_a_contract() -> None:
    """The import-linter contracts name the modules they protect: a module added to phalanx.checkpoint
    must join one of them (or be a public package), or code above the strategies could import it freely."""
    import fnmatch

    try:
        import tomllib
    except ImportError:  # Python 3.10: import-linter's own TOML reader
        import tomli as tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    protected = [m for c in config if c["id"] in ("checkpoint-facade", "checkpoint-backends")
                 for m in c["protected_modules"]]
    package = REPO / "src" / "phalanx" / "checkpoint"
    for path in package.rglob("*.py"):
        parts = ("phalanx", *path.relative_to(package.parent).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name in ("phalanx.checkpoint", "phalanx.checkpoint.snapshot"):
            continue  # the public packages
        assert any(fnmatch.fnmatchcase(name, m) for m in protected), f"{name} is in no checkpoint contract"


def test_fsdp_does_not_depend_on_torch_private_checkpoint_helpers_at_import() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    subprocess.run([sys.executable, str(JOBS / "fsdp_without_torch_private_checkpoint_helpers.py")], check=True,
                   env=env, timeout=120)


# ---------------------------------------------------------------------- safe to open
class Color(enum.Enum):
    RED = "red"


class Opaque:
    def __repr__(self) -> str:
        return "Opaque()"


class HParamModel(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"cfg": argparse.Namespace(depth=2, out=Path("/tmp/x")), "color": Color.RED,
                                   "scale": np.float64(0.5), "ids": np.arange(3), "odd": Opaque(), "lr": 0.05})


def test_every_single_file_checkpoint_opens_with_plain_torch_load(tmp_path: Path) -> None:
    """Fabric and Trainer checkpoints (RNG states, loop state, callback states, hyperparameters)
    open with torch.load's defaults (weights_only=True on torch >= 2.6)."""
    fabric = Fabric(accelerator="cpu", precision="16-mixed")
    model = fabric.setup(_model())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    fabric.backward(model(torch.randn(4, 4)).square().mean())
    opt.step()
    sched.step()
    fabric.save(tmp_path / "fabric.ckpt", {"model": model, "optimizer": opt, "scheduler": sched, "step": 1,
                                           "tags": ("a", 2), "dtype": torch.bfloat16, "ids": {3, 4}})
    trainer = phalanx.Trainer(max_epochs=1, callbacks=[EarlyStopping("val_mae"), ModelCheckpoint(tmp_path / "mc")],
                              **quiet(enable_checkpointing=True, default_root_dir=tmp_path))
    module = HParamModel()
    with pytest.warns(PhalanxWarning, match=r"hyperparameter hparams\['odd'\] is a Opaque.*repr is stored"):
        trainer.fit(module, loader(16, 4), loader(8, 4))
        trainer.save_checkpoint(tmp_path / "trainer.ckpt")
    files = [tmp_path / "fabric.ckpt", tmp_path / "trainer.ckpt", *sorted((tmp_path / "mc").glob("*.ckpt"))]
    assert len(files) == 3
    for path in files:
        assert torch.load(path) is not None  # torch's defaults, nothing allowlisted
    ckpt = torch.load(tmp_path / "trainer.ckpt", weights_only=True)
    assert ckpt["hyper_parameters"] == {"cfg": {"depth": 2, "out": "/tmp/x"}, "color": "red", "scale": 0.5,
                                        "ids": [0, 1, 2], "odd": "Opaque()", "lr": 0.05}
    assert isinstance(ckpt["__phalanx__"]["torch_version"], str)
    assert ckpt["rank_states"][0]["rng"]["numpy"]["kind"] == "MT19937"
    # The RNG state restores exactly from its plain form.
    phalanx.seed_everything(3)
    from phalanx.utils.seed import capture_rng_state, restore_rng_state

    snap = torch.load(io.BytesIO(_saved(capture_rng_state())), weights_only=True)
    expected = (np.random.rand(), torch.rand(1).item())
    restore_rng_state(snap)
    assert (np.random.rand(), torch.rand(1).item()) == expected


def _saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_unsafe_files_are_refused_by_default_with_the_way_out(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(_model())
    path = tmp_path / "foreign.ckpt"
    torch.save({"model": _model().state_dict(), "cfg": argparse.Namespace(a=1)}, path)
    with pytest.raises(CheckpointError, match=r"holds objects other than tensors and plain Python values \(a "
                       r"argparse.Namespace\).*unpickling it could run code.*weights_only=False"):
        fabric.load(path, {"model": model})
    rest = fabric.load(path, {"model": model}, weights_only=False)  # the explicit opt-in for a trusted file
    assert rest["cfg"].a == 1
    torch.save({"weight": torch.zeros(2, 4), "note": argparse.Namespace()}, tmp_path / "raw.pt")
    with pytest.raises(CheckpointError, match=r"State dict file .* argparse.Namespace"):
        fabric.load_raw(tmp_path / "raw.pt", nn.Linear(4, 2))


def test_saving_refuses_values_that_would_not_open_safely(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(_model())
    for bad, name in ((Path("x"), "PosixPath"), (np.int64(3), "int64"), (Color.RED, "Color")):
        with pytest.raises(CheckpointError, match=rf"state\['extra'\]\[0\] is a .*{name}, which a checkpoint cannot "
                           r"hold"):
            fabric.save(tmp_path / "a.ckpt", {"model": model, "extra": [bad]})
    assert not (tmp_path / "a.ckpt").exists()


# ---------------------------------------------------------------------- true causes
class _FullDisk(io.RawIOBase):
    """A file that takes ``room`` bytes, then fails like a full disk."""

    def __init__(self, fh: Any, room: int) -> None:
        self.fh, self.room = fh, room

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return int(self.fh.write(data))

    def fileno(self) -> int:
        return int(self.fh.fileno())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fh, name)


def test_disk_full_says_so_and_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(nn.Linear(256, 256))
    path = tmp_path / "a.ckpt"
    fabric.save(path, {"model": model, "step": 1})
    real_open = open

    def full_disk_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = real_open(file, mode, *args, **kwargs)
        return _FullDisk(fh, room=4096) if "w" in mode else fh

    monkeypatch.setattr(storage, "open", full_disk_open, raising=False)
    with pytest.raises(CheckpointError, match=rf"Cannot write checkpoint {path}: \[Errno 28\] No space left on "
                       r"device.*it needs about 0\.3 MiB, .* MiB free there\)\. Free some space.*previous checkpoint.*"
                       r"unchanged"):
        fabric.save(path, {"model": model, "step": 2})
    monkeypatch.undo()
    assert fabric.load(path)["step"] == 1
    assert not list(tmp_path.glob(".a.ckpt*")), "the partial temporary file was not removed"


def test_unwritable_directory_gives_the_true_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(_model())
    path = tmp_path / "a.ckpt"
    fabric.save(path, {"model": model, "step": 1})

    def read_only(file: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))

    monkeypatch.setattr(storage, "open", read_only, raising=False)
    with pytest.raises(CheckpointError, match=r"Cannot write checkpoint .*a\.ckpt: \[Errno 30\] Read-only file system: "
                       r"'.*\.a\.ckpt\.tmp-.*'\. Save to a writable directory"):
        fabric.save(path, {"model": model, "step": 2})
    monkeypatch.undo()
    assert fabric.load(path)["step"] == 1


def test_a_write_error_that_lost_its_cause_is_asked_of_the_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.distributed.checkpoint shares each rank's exception by pickling it, which drops the OSError
    behind torch's "unexpected pos": phalanx asks the filesystem again with a test write."""
    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    generic = storage.write_error(lost, tmp_path / "ckpt", "write the shards of checkpoint")
    assert "unexpected pos" in str(generic)  # the filesystem is fine here: torch's words are all there is

    def no_space(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(storage.os, "posix_fallocate", no_space)
    err = storage.write_error(lost, tmp_path / "ckpt", "write the shards of checkpoint")
    assert str(err).startswith(f"Cannot write the shards of checkpoint {tmp_path / 'ckpt'}: [Errno 28] No space left")
    assert not list(tmp_path.iterdir()), "the probe file was left behind"


def _tmpfs_available() -> bool:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d && umount $d && rmdir $d"
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


TMPFS_JOB = JOBS / "checkpoint_on_tmpfs.py"


@pytest.mark.skipif(not _tmpfs_available(), reason="needs `unshare -rm` and tmpfs mounts (a private mount namespace)")
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=run_if(fsdp=True))])
def test_real_full_disk_and_read_only_mount_on_two_ranks(tmp_path: Path, strategy: str) -> None:
    """A 2 MiB tmpfs in a private mount namespace: every rank raises with rank 0's true cause, and the
    previous checkpoint still loads."""
    (tmp_path / "disk").mkdir()
    script = "mount -t tmpfs -o size=2m tmpfs disk && exec \"$@\""
    job = run_job(TMPFS_JOB, tmp_path, args=(strategy,), timeout=240,
                  command=["unshare", "-rm", "sh", "-c", script, "sh", sys.executable]).check()
    for rank in (0, 1):
        rep = job.reports[rank]
        assert "No space left on device" in rep["full"] and "disk/good" in rep["full"], rep["full"]
        assert "Read-only file system" in rep["read_only"], rep["read_only"]
        if rank == 1 and strategy == "ddp":  # only rank 0 writes a single file: rank 1 hears it from rank 0
            assert rep["full"].startswith("Saving disk/good failed on rank 0: Cannot write checkpoint")
        assert rep["after_full"] == 1 and rep["after_read_only"] == 1


FAULT_JOB = JOBS / "checkpoint_write_faults.py"


def test_a_failure_on_one_rank_reaches_every_rank_with_its_cause(tmp_path: Path) -> None:
    job = run_job(FAULT_JOB, tmp_path, timeout=240).check()
    for rank in (0, 1):
        rep = job.reports[rank]
        for form, path in (("sharded", "good"), ("full", "good.pt")):
            assert "ValueError: cannot serialize the sampler (at job.py:" in rep[form], rep[form]
            if rank == 1:
                assert rep[form].startswith(f"Saving {path} failed on rank 0: ValueError"), rep[form]
            assert rep[form + ":step"] == 1  # the previous checkpoint is untouched
        assert rep["finite"] is True and rep["nan_on_rank1"] is False
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith((".good", "good"))]


# ---------------------------------------------------------------------- publishing and removing
def _fake_dir_checkpoint(path: Path, step: int) -> None:
    path.mkdir(parents=True)
    (path / "shard").write_text(str(step))
    torch.save({"__phalanx__": {}, "extras": {}}, path / MARKER)


def test_directory_publish_without_exchange_is_crash_safe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "ckpt"
    _fake_dir_checkpoint(target, 1)
    _fake_dir_checkpoint(tmp_path / "new", 2)
    real_rename = os.rename
    calls: list[str] = []

    def crash_on_second(a: Any, b: Any) -> None:
        calls.append(str(b))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the two renames")
        real_rename(a, b)

    monkeypatch.setattr(storage.os, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        storage.publish_dir(tmp_path / "new", target, exchange=False)
    monkeypatch.undo()
    # Rolled back where the process lived on; where it died (simulate: undo the rollback), locate finds .old-.
    assert (target / "shard").read_text() == "1"
    old = tmp_path / ".ckpt.old-0000000000"
    real_rename(target, old)
    found = phalanx.checkpoint.find(target)
    assert found is not None and found.recovered and found.path == old and found.problem is None
    storage.publish_dir(tmp_path / "new", target, exchange=False)
    assert (target / "shard").read_text() == "2" and not old.exists()


def test_remove_checkpoint_handles_files_and_directories(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    fabric.save(tmp_path / "a.ckpt", {"model": fabric.setup(_model())})
    _fake_dir_checkpoint(tmp_path / "b.ckpt", 1)
    for name in ("a.ckpt", "b.ckpt"):
        fabric.remove_checkpoint(tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    fabric.remove_checkpoint(tmp_path / "missing.ckpt")  # nothing there: nothing to do


def test_saving_over_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("user data")
    fabric = Fabric(accelerator="cpu")
    with pytest.raises(CheckpointError, match=r"a directory exists at that path"):
        fabric.save(tmp_path / "data", {"model": fabric.setup(_model())})
    assert (tmp_path / "data" / "keep.txt").read_text() == "user data"


# ---------------------------------------------------------------------- Trainer: directories, rotation, resume
TRAINER_JOB = JOBS / "checkpoint_trainer_kill_resume.py"


def _trainer_strategies() -> list[Any]:
    # CI: the combination tier resumes FSDP's directory checkpoints through ModelCheckpoint (fsdp-bf16-mixed).
    return [pytest.param("fsdp", marks=[pytest.mark.slow, run_if(fsdp=True)]),
            pytest.param("deepspeed_stage_2", marks=[pytest.mark.slow, run_if(deepspeed=True)])]


@pytest.mark.parametrize("strategy", _trainer_strategies())
def test_trainer_with_directory_checkpoints_rotates_and_resumes_bit_identical(tmp_path: Path, strategy: str) -> None:
    """FSDP's (and DeepSpeed's) default checkpoints are directories: ModelCheckpoint must rotate them
    (it crashed with IsADirectoryError) and ckpt_path="last" must resume from one (it restarted from
    step 0 saying no last.ckpt was found)."""
    (tmp_path / "full").mkdir()
    full = run_job(TRAINER_JOB, tmp_path / "full", args=(strategy, "full"), timeout=300).check()
    cut = tmp_path / "cut"
    cut.mkdir()
    killed = run_job(TRAINER_JOB, cut, args=(strategy, "kill"), timeout=300)
    assert killed.returncode == 17, killed.output[-3000:]
    visible = sorted(p.name for p in (cut / "ckpt").iterdir() if not p.name.startswith("."))
    assert visible == ["epoch=1-step=6.ckpt", "last.ckpt"], visible  # steps 2 and 4 were rotated out
    assert all((cut / "ckpt" / name).is_dir() and (cut / "ckpt" / name / MARKER).is_file() for name in visible)
    assert torch.load(cut / "ckpt" / "last.ckpt" / MARKER)["extras"]["loops"]["global_step"] == 6
    resumed = run_job(TRAINER_JOB, cut, args=(strategy, "resume"), timeout=300).check()
    for rank in (0, 1):
        got, want = resumed.reports[rank], full.reports[rank]
        assert got["resumed_from"] == str(cut / "ckpt" / "last.ckpt")
        assert got["step"] == want["step"] == 12
        assert got["params"] == want["params"]  # bit-identical
        assert got["loss"] == want["loss"]
    assert Path(full.reports[0]["best"]).name == "epoch=2-step=12.ckpt"


def test_an_incomplete_last_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    (ckpt_dir / "last.ckpt").mkdir(parents=True)
    (ckpt_dir / "last.ckpt" / ".metadata").write_bytes(b"")
    trainer = phalanx.Trainer(max_epochs=1, callbacks=[ModelCheckpoint(ckpt_dir, save_last=True)],
                              **quiet(enable_checkpointing=True))
    with pytest.raises(CheckpointError, match=r"ckpt_path='last' resolves to .*last\.ckpt, which cannot be resumed "
                       r"from: .* phalanx_meta\.pt is missing"):
        trainer.fit(Regressor(), loader(8, 4), ckpt_path="last")
    assert trainer.global_step == 0


# ---------------------------------------------------------------------- non-finite never replaces finite
class Diverge:
    """Puts a NaN into the weights after optimizer step ``at_step`` (runs before ModelCheckpoint's hook)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.at_step and not trainer.in_window:
            with torch.no_grad():
                next(module.parameters()).view(-1)[0] = float("nan")


@pytest.mark.parametrize("monitor", [None, "train_loss_step"])
def test_a_diverged_run_never_replaces_the_last_good_checkpoint(tmp_path: Path, monitor: str | None) -> None:
    ckpt = ModelCheckpoint(tmp_path, monitor=monitor, every_n_train_steps=1, save_top_k=1)
    trainer = phalanx.Trainer(max_epochs=1, callbacks=[Diverge(at_step=4), ckpt], **quiet(enable_checkpointing=True))
    with pytest.warns(PhalanxWarning, match=r"ModelCheckpoint: the model's weights hold inf/nan at epoch 0, "
                      r"step 4; no checkpoint is written and the existing ones .* are kept"):
        # The next batch's loss is nan: the run stops there, before stepping (phalanx.trainer.loops).
        with pytest.raises(NonFiniteError, match=r"The training loss is nan at epoch 0, global step 4, batch 4"):
            trainer.fit(Regressor(lr=0.05, scheduler=False), loader(24, 4))
    files = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    # The newest (no monitor) or best (lowest loss) checkpoint from before the weights went bad, never rotated out.
    assert len(files) == 1 and files[0].startswith("epoch=0-step=3" if monitor is None else "epoch=0-step="), files
    assert int(files[0].split("step=")[1].split(".")[0].split("-")[0]) <= 3
    saved = torch.load(tmp_path / files[0])["model"]
    assert all(bool(torch.isfinite(v).all()) for v in saved.values())
    assert ckpt.best_model_path == str(tmp_path / files[0])


def test_a_non_finite_monitor_value_never_enters_the_top_k(tmp_path: Path) -> None:
    trainer = FakeTrainer(tmp_path)
    cb = ModelCheckpoint(filename="{epoch}-{val_loss:.2f}", monitor="val_loss", save_top_k=1)
    cb.setup(trainer, None, "fit")
    end_epoch(cb, trainer, 0.5)
    with pytest.warns(PhalanxWarning, match=r"val_loss=nan .* is not finite"):
        end_epoch(cb, trainer, float("nan"))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["epoch=0-val_loss=0.50.ckpt"]
    assert cb.best_model_score == 0.5
