"""Checkpoints carry checksums and every load verifies them: bytes flipped on disk inside a tensor's data
(which torch.load accepts silently) are refused with an error naming the file, the entry and the tensor,
and pointing at the previous checkpoint. A checkpoint of another format (without checksums) is refused,
saying what to do."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from byte_flips import flip
from job_runner import JOBS, run_job
from run_if import run_if
from torch import nn
from trainer_support import Regressor, loader, quiet

import phalanx
from phalanx import Fabric
from phalanx.callbacks import ModelCheckpoint
from phalanx.checkpoint import MARKER, META_KEY, read_everything
from phalanx.errors import CheckpointError
from phalanx.offline.convert import convert
from phalanx.offline.lazy import lazy_load

pytestmark = pytest.mark.timeout(300)

REFUSED = ("Its bytes changed after phalanx saved it (a failing disk, a damaged copy), so loading it would "
           "silently give wrong values; it was refused.")


def _setup() -> tuple[Fabric, nn.Module, torch.optim.Optimizer]:
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    return fabric, model, optimizer


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.5)


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().numpy().tobytes()


def _older(path: Path, seconds: float = 60) -> None:
    st = path.stat()
    os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


def _expected_tensor_error(ckpt: Path, key: str, entry: str, before: bytes, after: bytes, advice: str) -> str:
    return (f"Checkpoint {ckpt} is corrupt: tensor {key!r} of entry {entry!r} does not match its checksum (crc32 "
            f"{zlib.crc32(before):#010x} saved, {zlib.crc32(after):#010x} now). {REFUSED} {advice}")


# ---------------------------------------------------------------------- single files
def test_flipped_bytes_in_a_single_file_are_refused_naming_the_tensor_and_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    fabric, model, optimizer = _setup()
    previous, ckpt = tmp_path / "epoch=0.ckpt", tmp_path / "epoch=1.ckpt"
    fabric.save(previous, {"model": model, "optimizer": optimizer, "step": 1})
    fabric.save(ckpt, {"model": model, "optimizer": optimizer, "step": 2})
    _older(previous)
    before, after = flip(ckpt, _raw(model[0].weight))

    # What the issue reported: plain torch.load takes the damaged file without a word.
    silent = torch.load(ckpt, weights_only=True)["model"]["0.weight"]
    assert not torch.equal(silent, model[0].weight.detach())

    expected = _expected_tensor_error(ckpt, "0.weight", "model", before, after,
                                      f"Use the previous checkpoint, {previous}.")
    fresh, fresh_opt = _fresh()
    with pytest.raises(CheckpointError) as err:
        fabric.load(ckpt, {"model": fresh, "optimizer": fresh_opt})
    assert str(err.value) == expected
    with pytest.raises(CheckpointError) as err:
        fabric.load(ckpt)  # everything, no state to fill
    assert str(err.value) == expected
    with pytest.raises(CheckpointError) as err:
        read_everything(ckpt)
    assert str(err.value) == expected

    # The previous checkpoint loads; without one, the advice is generic.
    fabric.load(previous, {"model": fresh, "optimizer": fresh_opt})
    assert torch.equal(fresh[0].weight, model[0].weight)
    previous.unlink()
    with pytest.raises(CheckpointError) as err:
        fabric.load(ckpt, {"model": fresh})
    assert str(err.value).endswith(f"{REFUSED} Use an earlier checkpoint.")


def test_optimizer_state_is_verified_too_and_every_mismatch_counted(tmp_path: Path) -> None:
    fabric, model, optimizer = _setup()
    ckpt = tmp_path / "ckpt.pt"
    fabric.save(ckpt, {"model": model, "optimizer": optimizer})
    flip(ckpt, _raw(optimizer.state[model[0].weight]["exp_avg_sq"]))
    before, after = flip(ckpt, _raw(model[0].bias), count=8, at=0)
    with pytest.raises(CheckpointError) as err:
        fabric.load(ckpt, {"model": _fresh()[0]})
    message = str(err.value)
    assert message.startswith(
        f"Checkpoint {ckpt} is corrupt: tensor '0.bias' of entry 'model' does not match its checksum (crc32 "
        f"{zlib.crc32(before):#010x} saved, {zlib.crc32(after):#010x} now) (and 1 more mismatch). "), message


def test_changed_plain_values_are_refused_naming_the_entry(tmp_path: Path) -> None:
    fabric, model, _ = _setup()
    ckpt = tmp_path / "ckpt.pt"
    fabric.save(ckpt, {"model": model, "loop": {"step": 100, "epoch": 3}})
    content = torch.load(ckpt, weights_only=True)
    content["loop"]["step"] = 108  # what a flipped bit in the pickled int gives
    torch.save(content, ckpt)
    with pytest.raises(CheckpointError, match=rf"^Checkpoint {ckpt} is corrupt: entry 'loop' is not what was "
                       r"saved: its non-tensor values or its structure changed\. "):
        fabric.load(ckpt, {"model": model, "loop": {}})


def test_an_intact_checkpoint_loads_bit_identically(tmp_path: Path) -> None:
    fabric, model, optimizer = _setup()
    ckpt = tmp_path / "ckpt.pt"
    state = {"model": model, "optimizer": optimizer, "step": 7, "rng": torch.get_rng_state(),
             "half": torch.randn(5, 3).to(torch.bfloat16), "empty": torch.zeros(0), "scalar": torch.tensor(3.5)}
    fabric.save(ckpt, state)
    assert torch.load(ckpt, weights_only=True)[META_KEY]["format_version"] == 3
    fresh, fresh_opt = _fresh()
    into: dict[str, Any] = {"model": fresh, "optimizer": fresh_opt, "step": 0, "rng": None, "half": None,
                            "empty": None, "scalar": None}
    fabric.load(ckpt, into)
    assert into["step"] == 7
    for key in ("rng", "half", "empty", "scalar"):
        assert torch.equal(into[key], state[key]) and into[key].dtype == state[key].dtype
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), fresh.parameters()):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][name], fresh_opt.state[q][name])


def test_checkpoints_of_another_format_are_refused_saying_what_to_do(tmp_path: Path) -> None:
    """Format 2 (before checksums) and markers without checksums: every reader refuses them."""
    fabric, model, _ = _setup()
    ckpt = tmp_path / "old.pt"
    fabric.save(ckpt, {"model": model, "step": 3})
    content = torch.load(ckpt, weights_only=True)
    content[META_KEY].pop("checksums")
    content[META_KEY]["format_version"] = 2
    torch.save(content, ckpt)
    refused = (r"old.pt is a phalanx checkpoint of format 2 without checksums; this phalanx version reads only "
               r"format 3, whose checksums every load verifies. Load it with the phalanx version that wrote it and "
               r"save it again with this one")
    with pytest.raises(CheckpointError, match=refused):
        fabric.load(ckpt, {"model": _fresh()[0], "step": 0})
    with pytest.raises(CheckpointError, match=refused):
        read_everything(ckpt)
    with pytest.raises(CheckpointError, match=refused):
        lazy_load(ckpt)


def test_lazy_load_verifies_each_tensor_when_first_used(tmp_path: Path) -> None:
    fabric, model, _ = _setup()
    ckpt = tmp_path / "ckpt.pt"
    fabric.save(ckpt, {"model": model})
    lazy = lazy_load(ckpt)
    assert torch.equal(torch.add(lazy["model"]["0.weight"], 0), model[0].weight)
    before, after = flip(ckpt, _raw(model[0].weight))
    lazy = lazy_load(ckpt)  # opening reads no tensor data: nothing to refuse yet
    assert torch.equal(torch.add(lazy["model"]["2.weight"], 0), model[2].weight)
    with pytest.raises(CheckpointError) as err:
        torch.add(lazy["model"]["0.weight"], 0)
    assert str(err.value) == _expected_tensor_error(ckpt, "0.weight", "model", before, after,
                                                    "Use an earlier checkpoint.")


def test_trainer_resume_refuses_a_corrupt_last_checkpoint(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    trainer = phalanx.Trainer(max_epochs=2, callbacks=[ModelCheckpoint(ckpt_dir, save_last=True)],
                              **quiet(enable_checkpointing=True))
    module = Regressor()
    trainer.fit(module, loader(16, 4))
    epochs = sorted(p for p in ckpt_dir.iterdir() if p.name.startswith("epoch="))
    assert epochs, sorted(ckpt_dir.iterdir())
    _older(epochs[-1])
    flip(ckpt_dir / "last.ckpt", _raw(module.net[0].weight), at=128)
    resumed = phalanx.Trainer(max_epochs=3, callbacks=[ModelCheckpoint(ckpt_dir, save_last=True)],
                              **quiet(enable_checkpointing=True))
    corrupt = r"tensor 'net\.0\.weight' of entry '\w+' does not match its checksum"
    with pytest.raises(CheckpointError, match=corrupt) as err:
        resumed.fit(Regressor(), loader(16, 4), ckpt_path="last")
    assert str(ckpt_dir / "last.ckpt") in str(err.value)
    assert str(err.value).endswith(f"Use the previous checkpoint, {epochs[-1]}."), str(err.value)
    assert resumed.global_step == 0


# ---------------------------------------------------------------------- directories (2 ranks)
SHARDED_JOB = JOBS / "sharded_checksums.py"


@run_if(fsdp=True)
def test_flipped_bytes_in_a_shard_file_are_refused_on_every_rank(tmp_path: Path) -> None:
    job = run_job(SHARDED_JOB, tmp_path, timeout=240).check()
    ckpt, shard = tmp_path / "step2", tmp_path / "step2" / "__1_0.distcp"
    record = torch.load(ckpt / MARKER, weights_only=True)[META_KEY]["checksums"]
    regions = record["files"]["__1_0.distcp"]["regions"]
    ((offset, length, _, saved),) = [r for r in regions if r[2] == ["model", "0.weight"]]
    now = zlib.crc32(shard.read_bytes()[offset:offset + length])

    def expected(root: Path) -> str:
        return (f"Checkpoint {root / 'step2'} is corrupt: tensor '0.weight' of entry 'model' in "
                f"{root / 'step2' / '__1_0.distcp'} does not match its checksum (crc32 {saved:#010x} saved, "
                f"{now:#010x} now). {REFUSED} Use the previous checkpoint, {root / 'step1'}.")

    # Rank 0 verifies every rank's files before any rank reads a shard; the others hear its verdict, as the same error.
    assert job.reports[0]["step2"] == f"CorruptCheckpointError: {expected(Path())}", job.reports[0]["step2"]
    assert job.reports[1]["step2"] == f"CorruptCheckpointError: Loading step2 failed on rank 0: {expected(Path())}"
    for rank in (0, 1):
        assert job.reports[rank]["step1"] is True and job.reports[rank]["async3"] is True, job.reports[rank]
    # The asynchronous save recorded its shards' checksums too, and every file of both is covered.
    for name in ("step1", "async3"):
        files = torch.load(tmp_path / name / MARKER, weights_only=True)[META_KEY]["checksums"]["files"]
        assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        for rec in files.values():
            assert sum(length for _, length, _, _ in rec["regions"]) == rec["size"]

    # Without a process group: reading everything and consolidating refuse it the same way.
    for call in (lambda: read_everything(ckpt), lambda: convert(ckpt, tmp_path / "out.pt", to="single")):
        with pytest.raises(CheckpointError) as err:
            call()
        assert str(err.value) == expected(tmp_path)
    assert not (tmp_path / "out.pt").exists()
    convert(tmp_path / "step1", tmp_path / "one.pt", to="single")
    sd = torch.load(tmp_path / "one.pt", weights_only=True)
    flip(tmp_path / "one.pt", _raw(sd["model"]["0.weight"]))
    with pytest.raises(CheckpointError, match=r"tensor '0\.weight' of entry 'model' does not match its checksum"):
        read_everything(tmp_path / "one.pt")

    # A shard file cut short is named as such.
    with open(tmp_path / "async3" / "__0_0.distcp", "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: it has 100 bytes, \d+ were written\. "):
        read_everything(tmp_path / "async3")
