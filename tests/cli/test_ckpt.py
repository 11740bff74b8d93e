"""``phalanx ckpt inspect`` and ``phalanx ckpt convert``: on checkpoints written by a real 2-rank FSDP job
(an MLP with AdamW, and a tiny GPT-2 held as ``self.model``), every conversion read back bit for bit,
the converted files loaded by ``fabric.load`` on 2 FSDP ranks and in one plain process, the safetensors
export loaded by ``from_pretrained``, and the argument errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_command_models import gpt2_config, mlp, tokens
from job_runner import JOBS, run_job
from run_if import run_if

from phalanx import Fabric
from phalanx.cli.commands import main as phalanx_main
from phalanx.offline.convert import stream_save, strip_prefixes
from phalanx.trainer.state import LoopState

pytestmark = [pytest.mark.timeout(300), run_if(fsdp=True)]


JOB = JOBS / "ckpt_commands_checkpoints.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    pytest.importorskip("transformers")
    tmp_path = tmp_path_factory.mktemp("ckpt_cli")
    job = run_job(JOB, tmp_path, timeout=240).check()
    return tmp_path, job.reports


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = phalanx_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal structure, equal plain values, bit-identical tensors (same dtype and shape)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), (where, sorted(a), sorted(b))
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            assert_same(u, v, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def entries(path: Path) -> dict[str, Any]:
    return {k: v for k, v in torch.load(path, weights_only=True).items() if k != "__phalanx__"}


# ---------------------------------------------------------------------- inspect
def test_inspect_single_file_and_sharded_directory(saved: tuple[Path, Any], capsys: pytest.CaptureFixture[str]) -> None:
    tmp_path, _ = saved
    infos = {}
    for name in ("ckpt", "ckpt.pt"):
        code, out, _ = cli(capsys, "ckpt", "inspect", tmp_path / name, "--json")
        assert code == 0
        infos[name] = json.loads(out)
    sharded, single = infos["ckpt"], infos["ckpt.pt"]
    assert sharded["layout"] == "sharded" and single["layout"] == "single"
    for info in (sharded, single):
        assert info["strategy"] == "fsdp" and info["world_size"] == 2 and info["step"] == 2
        assert {e["key"]: e["kind"] for e in info["entries"]} == {
            "model": "module", "optimizer": "optimizer", "step": "plain", "note": "plain"}
        assert info["tensor_count"] == 4 + 4 * 3  # weights; exp_avg, exp_avg_sq, step per parameter
    # The same tensors, described from DCP's metadata on one side and the file on the other.
    assert sharded["tensor_bytes"] == single["tensor_bytes"] == 4 * ((6 * 16 + 16 + 16 * 3 + 3) * 3 + 4)
    assert sharded["files"] == 4 and any("DCP reshards" in how for how in sharded["loadable_by"])
    assert any("torch.load" in how for how in single["loadable_by"])
    largest = single["tensors"][0]
    assert largest["bytes"] == 6 * 16 * 4 and largest["shape"] in ([16, 6],)

    code, out, _ = cli(capsys, "ckpt", "inspect", tmp_path / "ckpt")
    assert code == 0 and "strategy: fsdp, world size: 2" in out and "step: 2" in out
    assert "largest 10 of 16 tensors (--all lists every one)" in out
    assert "optimizer/state/0.weight/exp_avg" in out  # DCP keys optimizer state by parameter name
    code, out, _ = cli(capsys, "ckpt", "inspect", tmp_path / "ckpt.pt", "--all")
    assert code == 0 and "tensors:" in out and "optimizer/state/3/exp_avg_sq" in out


def test_inspect_reads_step_and_epoch_of_a_trainer_checkpoint(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    loop = LoopState()
    loop.current_epoch, loop.global_step, loop.batches_done = 3, 42, 5
    model = mlp().state_dict()
    stream_save({"model": model, "loops": loop.state_dict(1, 4), "phalanx_trainer": 1}, tmp_path / "t.ckpt",
                lambda t: t)
    code, out, _ = cli(capsys, "ckpt", "inspect", tmp_path / "t.ckpt", "--json")
    info = json.loads(out)
    assert code == 0 and info["trainer"] and (info["step"], info["epoch"], info["batches_done"]) == (42, 3, 5)


def test_inspect_lists_a_folder_of_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ModelCheckpoint's folder is listed, newest first, each with what its metadata says (not a "sharded
    checkpoint without its marker"); what is not a complete checkpoint is left out, one that cannot be read says
    why."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    model = mlp().state_dict()
    for name, epoch, step in (("epoch=0-step=4.ckpt", 0, 4), ("epoch=1-step=8.ckpt", 1, 8), ("last.ckpt", 1, 8)):
        loop = LoopState()
        loop.current_epoch, loop.global_step = epoch, step
        stream_save({"model": model, "loops": loop.state_dict(1, 4), "phalanx_trainer": 1}, folder / name,
                    lambda t: t)
    (folder / "broken.ckpt").write_bytes(b"PK\x03\x04 cut short")
    (folder / "notes.txt").write_text("not a checkpoint")
    (folder / ".last.ckpt.tmp-1").write_bytes(b"a save in progress")
    for age, name in enumerate(("last.ckpt", "epoch=1-step=8.ckpt", "broken.ckpt", "epoch=0-step=4.ckpt")):
        os.utime(folder / name, (1_700_000_000 - 60 * age, 1_700_000_000 - 60 * age))
    code, out, err = cli(capsys, "ckpt", "inspect", folder)
    assert code == 0 and err == "", err
    lines = out.splitlines()
    assert lines[0] == (f"{folder}: a folder of 4 checkpoints, newest first (`phalanx ckpt inspect FOLDER/NAME` "
                        "verifies one and shows what it holds):")
    assert [line.split()[0] for line in lines[1:]] == ["last.ckpt", "epoch=1-step=8.ckpt", "broken.ckpt",
                                                       "epoch=0-step=4.ckpt"]
    assert "single; step 8, epoch 1;" in lines[1] and "single; step 4, epoch 0;" in lines[4]
    assert "cannot be read: " in lines[3] and "truncated or corrupt" in lines[3]
    code, out, _ = cli(capsys, "ckpt", "inspect", folder, "--json")
    rows = json.loads(out)["checkpoints"]
    assert code == 0 and [(r["name"], r.get("step")) for r in rows] == [
        ("last.ckpt", 8), ("epoch=1-step=8.ckpt", 8), ("broken.ckpt", None), ("epoch=0-step=4.ckpt", 4)]


# ---------------------------------------------------------------------- convert
def test_convert_each_way_is_bit_identical(saved: tuple[Path, Any], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    job_dir, _ = saved
    full = entries(job_dir / "ckpt.pt")  # what phalanx's own full save wrote
    steps = [("ckpt", "a.pt", "single"), ("ckpt.pt", "b", "sharded"), ("b", "c.pt", "single"),
             ("ckpt", "d", "sharded"), ("d", "e.pt", "single")]
    for src, dst, to in steps:
        src_path = job_dir / src if (job_dir / src).exists() else tmp_path / src
        code, out, err = cli(capsys, "ckpt", "convert", src_path, tmp_path / dst, "--to", to)
        assert code == 0, err
        assert out.startswith(f"wrote {tmp_path / dst} ({to}")
    for name in ("a.pt", "c.pt", "e.pt"):
        assert_same(entries(tmp_path / name), full, name)  # plain torch.load, weights_only=True
    code, out, _ = cli(capsys, "ckpt", "inspect", tmp_path / "d", "--json")
    assert json.loads(out)["converted_from"] == "sharded"
    # The sharded outputs load in one plain process, as phalanx's own sharded checkpoints do.
    for name in ("b", "d"):
        fabric = Fabric(accelerator="cpu", devices=1)
        model = mlp()
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
        rest = fabric.load(tmp_path / name, state)
        assert state["step"] == 2 and rest == {"note": "hi"}
        assert_same(model.state_dict(), dict(full["model"]), name)
        assert_same(opt.state_dict()["state"], full["optimizer"]["state"], name)


def test_converted_checkpoints_load_under_fsdp_on_two_ranks(saved: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    _, reports = saved
    for rank in (0, 1):
        rep = reports[rank]
        for name in ("from_single", "from_sharded.pt"):
            assert rep[name] == rep["params"] and rep[name + ":opt"] == rep["opt"], name
            assert rep[name + ":step"] == 2 and rep[name + ":rest"] == {"note": "hi"}


def test_safetensors_export_loads_with_from_pretrained(saved: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    load_file = pytest.importorskip("safetensors.torch").load_file
    from transformers import GPT2LMHeadModel

    job_dir, reports = saved
    gpt2_config().to_json_file(tmp_path / "config.json")
    code, out, err = cli(capsys, "ckpt", "convert", job_dir / "gpt", tmp_path / "hf", "--to", "safetensors",
                         "--config", tmp_path / "config.json")
    assert code == 0, err
    assert "stripped model." in out
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors", "phalanx_checksums.json"]
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    model.eval()
    with torch.no_grad():
        logits = model(tokens()).logits.double()
    expected = torch.tensor(reports[0]["logits"], dtype=torch.float64)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    # The weights are the checkpoint's, bit for bit, under the Hugging Face names.
    single = tmp_path / "gpt.pt"
    assert cli(capsys, "ckpt", "convert", job_dir / "gpt", single, "--to", "single")[0] == 0
    weights = entries(single)["model"]
    assert_same(load_file(tmp_path / "hf" / "model.safetensors"),
                {k[len("model."):]: v for k, v in weights.items()})
    # --prefix '' keeps the names as saved.
    code, _, _ = cli(capsys, "ckpt", "convert", single, tmp_path / "raw", "--to", "safetensors", "--prefix", "")
    assert code == 0 and all(k.startswith("model.") for k in load_file(tmp_path / "raw" / "model.safetensors"))


def test_consolidate_is_still_an_alias(saved: tuple[Path, Any], tmp_path: Path) -> None:
    job_dir, _ = saved
    assert phalanx_main(["consolidate", str(job_dir / "ckpt"), str(tmp_path / "out.pt")]) == 0
    assert_same(entries(tmp_path / "out.pt"), entries(job_dir / "ckpt.pt"))


def test_stream_save_matches_torch_save(tmp_path: Path) -> None:
    """The record-by-record writer against torch.save: dtypes, 0-d and empty tensors, views, shared tensors."""
    shared = torch.randn(4, 3)
    obj = {"a": shared, "b": shared, "half": torch.randn(5).bfloat16(), "scalar": torch.tensor(7),
           "empty": torch.zeros(0, 3), "view": torch.arange(10.0)[2:7], "bool": torch.tensor([True, False]),
           "plain": [1, "x", {"y": 2.5}]}
    stream_save(obj, tmp_path / "s.pt", lambda t: t)
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    assert_same(back, obj)
    assert back["a"].data_ptr() == back["b"].data_ptr()  # tied weights stay tied
    assert not list(tmp_path.glob(".s.pt.tmp-*"))


def test_strip_prefixes() -> None:
    keys = ["_forward_module._orig_mod.model.transformer.wte.weight", "_forward_module._orig_mod.model.lm_head.weight"]
    names, removed = strip_prefixes(keys, None)
    assert sorted(names.values()) == ["lm_head.weight", "transformer.wte.weight"]
    assert removed == ["_orig_mod.", "_forward_module.", "model."] or set(removed) == {
        "_orig_mod.", "_forward_module.", "model."}
    # 'model.' goes only when every key has it (LlamaForCausalLM's own keys keep theirs).
    assert strip_prefixes(["model.layers.0.w", "lm_head.weight"], None) == (
        {"model.layers.0.w": "model.layers.0.w", "lm_head.weight": "lm_head.weight"}, [])
    assert strip_prefixes(["net.a", "b"], "net.")[0] == {"net.a": "a", "b": "b"}


# ---------------------------------------------------------------------- bad arguments
def test_bad_arguments_give_one_line_errors(saved: tuple[Path, Any], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    job_dir, _ = saved
    code, out, err = cli(capsys, "ckpt", "inspect", tmp_path / "nope")
    assert code == 2 and out == "" and err.count("\n") == 1 and "no such file or directory" in err
    code, _, err = cli(capsys, "ckpt", "convert", tmp_path / "nope", tmp_path / "x.pt", "--to", "single")
    assert code == 2 and "no such file or directory" in err
    (tmp_path / "taken.pt").write_bytes(b"")
    code, _, err = cli(capsys, "ckpt", "convert", job_dir / "ckpt", tmp_path / "taken.pt", "--to", "single")
    assert code == 2 and "exists; convert never overwrites" in err and err.count("\n") == 1
    assert (tmp_path / "taken.pt").read_bytes() == b""
    with pytest.raises(SystemExit) as exit_info:
        phalanx_main(["ckpt", "convert", str(job_dir / "ckpt"), str(tmp_path / "y"), "--to", "zip"])
    assert exit_info.value.code == 2 and "invalid choice: 'zip'" in capsys.readouterr().err
    code, _, err = cli(capsys, "ckpt", "convert", job_dir / "ckpt", tmp_path / "z.pt", "--to", "single",
                       "--prefix", "model.")
    assert code == 2 and "apply to --to safetensors only" in err
    code, _, err = cli(capsys, "ckpt", "convert", job_dir / "ckpt", tmp_path / "st", "--to", "safetensors",
                       "--entry", "nope")
    assert code == 1 and "has no entry 'nope'" in err and not (tmp_path / "st").exists()
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04 not really a checkpoint")
    code, _, err = cli(capsys, "ckpt", "inspect", tmp_path / "bad.pt")
    assert code == 1 and "truncated or corrupt" in err and err.count("\n") == 1
    code, _, err = cli(capsys, "ckpt", "convert", tmp_path / "bad.pt", tmp_path / "w", "--to", "sharded")
    assert code == 1 and not (tmp_path / "w").exists() and not list(tmp_path.glob(".w.*"))


def test_convert_refuses_a_checkpoint_whose_bytes_changed(saved: tuple[Path, Any], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A conversion verifies the checksums phalanx recorded: a flipped byte is not handed on under new
    (unrecorded) checksums. Inspect refuses it too; with --no-verify it reads no tensor data and describes it."""
    import shutil

    job_dir, _ = saved
    shutil.copyfile(job_dir / "ckpt.pt", tmp_path / "bad.pt")
    offset = torch._C.PyTorchFileReader(str(tmp_path / "bad.pt")).get_record_offset("data/0")
    with open(tmp_path / "bad.pt", "r+b") as fh:
        fh.seek(offset)
        first = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([first[0] ^ 0xFF]))
    shutil.copytree(job_dir / "ckpt", tmp_path / "bad_dir")
    shard = tmp_path / "bad_dir" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    for src in ("bad.pt", "bad_dir"):
        code, _, err = cli(capsys, "ckpt", "convert", tmp_path / src, tmp_path / f"{src}.out", "--to", "sharded")
        assert code == 1 and "is corrupt" in err and err.count("\n") == 1, err
        assert not (tmp_path / f"{src}.out").exists()
    assert cli(capsys, "ckpt", "inspect", tmp_path / "bad.pt")[0] == 1
    code, out, _ = cli(capsys, "ckpt", "inspect", tmp_path / "bad.pt", "--no-verify")
    assert code == 0 and "  checksums: not verified (--no-verify)" in out.splitlines()


def test_a_converted_file_carries_checksums_and_a_damaged_one_is_refused_by_name(
        saved: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every --to writes checksums as a phalanx save does; inspect verifies them by default, and inspect and
    fabric.load refuse a flipped byte, naming the tensor; the file's zip records are named after it."""
    import zipfile
    import zlib

    from phalanx.checkpoint.format import MARKER, META_KEY
    from phalanx.utils.errors import CorruptCheckpointError

    job_dir, _ = saved
    outs = {"single": tmp_path / "single" / "model.pt", "sharded": tmp_path / "sharded" / "model",
            "safetensors": tmp_path / "safetensors" / "model"}
    for to, dst in outs.items():  # each alone in its folder: no earlier checkpoint beside it
        assert cli(capsys, "ckpt", "convert", job_dir / "ckpt.pt", dst, "--to", to)[0] == 0
        code, out, _ = cli(capsys, "ckpt", "inspect", dst)
        assert code == 0 and "  checksums: verified (crc32 of every tensor matches what was saved)" in out, out
    assert {name.split("/")[0] for name in zipfile.ZipFile(outs["single"]).namelist()} == {"model"}
    assert {name.split("/")[0] for name in zipfile.ZipFile(outs["sharded"] / MARKER).namelist()} == {"phalanx_meta"}

    # One flipped byte in the first weight of each: its region, from the checksums each output recorded.
    record = torch.load(outs["single"], weights_only=True)[META_KEY]["checksums"]
    (_, saved_crc), *_ = record["entries"]["model"]["tensors"]
    offset = torch._C.PyTorchFileReader(str(outs["single"])).get_record_offset("data/0")
    flip_at = {"single": (outs["single"], offset, 16 * 6 * 4, saved_crc)}  # the weight: 16 x 6 float32
    files = torch.load(outs["sharded"] / MARKER, weights_only=True)[META_KEY]["checksums"]["files"]
    files2 = json.loads((outs["safetensors"] / "phalanx_checksums.json").read_text())["files"]
    for to, recorded in (("sharded", files), ("safetensors", files2)):
        name, (start, length, _, crc) = next((n, r) for n, f in recorded.items() for r in f["regions"]
                                             if r[2] == ["model", "0.weight"])
        flip_at[to] = (outs[to] / name, start, length, crc)
    for to, (file, at, length, crc) in flip_at.items():
        data = bytearray(file.read_bytes())
        data[at] ^= 0xFF
        file.write_bytes(bytes(data))
        now = zlib.crc32(data[at:at + length])
        where = "" if file == outs[to] else f" in {file}"
        expected = (f"Checkpoint {outs[to]} is corrupt: tensor '0.weight' of entry 'model'{where} does not match its "
                    f"checksum (crc32 {crc:#010x} saved, {now:#010x} now). Its bytes changed after phalanx saved it (a "
                    "failing disk, a damaged copy), so loading it would silently give wrong values; it was refused. "
                    "Use an earlier checkpoint.")
        assert cli(capsys, "ckpt", "inspect", outs[to]) == (1, "", f"phalanx ckpt inspect: {expected}\n"), to
        if to != "safetensors":  # what phalanx loads (a safetensors export is for from_pretrained)
            with pytest.raises(CorruptCheckpointError) as err:
                Fabric(accelerator="cpu", devices=1).load(outs[to], {"model": mlp()})
            assert str(err.value) == expected


# ---------------------------------------------------------------------- DeepSpeed
DS_JOB = JOBS / "ckpt_commands_deepspeed.py"


@pytest.mark.slow
@run_if(deepspeed=True)
def test_deepspeed_directory_converts_to_every_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_job(DS_JOB, tmp_path, timeout=240).check()
    code, out, _ = cli(capsys, "ckpt", "inspect", tmp_path / "ds", "--json")
    info = json.loads(out)
    assert code == 0 and info["layout"] == "deepspeed" and info["zero_stage"] == 2 and info["world_size"] == 2
    assert info["tensor_count"] == 4 and "read when converting" in info["notes"][0]  # shapes from DeepSpeed's files
    for dst, to in (("one.pt", "single"), ("dir", "sharded"), ("st", "safetensors")):
        assert cli(capsys, "ckpt", "convert", tmp_path / "ds", tmp_path / dst, "--to", to)[0] == 0
    # ZeRO's partitions merged: what DeepSpeedStrategy's own consolidated save wrote, bit for bit.
    full = entries(tmp_path / "ds.pt")
    assert_same(entries(tmp_path / "one.pt"), full)
    assert_same(entries_of_dir(tmp_path / "dir", capsys), full)


def entries_of_dir(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    out = path.with_name(path.name + ".pt")
    assert cli(capsys, "ckpt", "convert", path, out, "--to", "single")[0] == 0
    return entries(out)
