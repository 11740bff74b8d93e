"""Single-process tests of Fabric's API, precision plugins, checkpoints and data handling."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import JOBS
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

import phalanx
from phalanx import Fabric
from phalanx.errors import CheckpointError, MisconfigurationError, PhalanxWarning
from phalanx.fabric.data import distribute_dataloader
from phalanx.precision import PRECISIONS


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# fp8-mixed needs a GPU or emulation and layers it can convert: tests/precision/test_fp8.py.
@pytest.mark.parametrize("precision", [name for name in PRECISIONS if name != "fp8-mixed"])
def test_every_precision_trains_one_step(precision: str) -> None:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    model = fabric.setup(_model())  # (an optimizer over another instance's parameters is refused)
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    out = model(torch.randn(3, 4))
    assert out.dtype == (torch.float64 if precision == "64-true" else torch.float32)
    fabric.backward(out.float().square().mean())
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    expected_param = {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}
    assert next(model.parameters()).dtype == expected_param.get(precision, torch.float32)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "8-bit"}, "Unknown precision '8-bit'"),
        ({"accelerator": "tpu"}, "Unknown accelerator 'tpu'"),
        ({"accelerator": "cuda"}, "no CUDA device is available"),
        ({"strategy": "horovod"}, "Unknown strategy 'horovod'"),
        ({"strategy": "single", "devices": 2}, "runs one process"),
        ({"devices": 0}, r"devices must be a positive integer"),
        ({"devices": "many"}, r"devices='many' is not understood"),
        ({"num_nodes": 0}, "num_nodes must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_clearly(kwargs: dict[str, object], message: str) -> None:
    if kwargs.get("accelerator") == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(MisconfigurationError, match=message):
        Fabric(**kwargs)  # type: ignore[arg-type]


def test_lightning_precision_aliases() -> None:
    assert Fabric(accelerator="cpu", precision=16).strategy.precision.name == "16-mixed"
    assert Fabric(accelerator="cpu", precision="bf16").strategy.precision.name == "bf16-mixed"
    assert Fabric(accelerator="cpu", precision=64).strategy.precision.name == "64-true"


def test_multi_process_fabric_requires_launch() -> None:
    fabric = Fabric(accelerator="cpu", devices=2)
    with pytest.raises(MisconfigurationError, match=r"call fabric.launch\(\)"):
        fabric.setup(_model())


def test_backward_before_setup_runs_on_one_process() -> None:
    # As in Lightning (meta-learning): nothing to sync on one process. Several processes: test_unmanaged_backward.py.
    fabric = Fabric(accelerator="cpu")
    model = _model()
    fabric.backward(model(torch.randn(2, 4)).sum())
    assert all(p.grad is not None for p in model.parameters())


def test_setup_twice_and_wrong_types_are_refused() -> None:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(_model())
    with pytest.raises(MisconfigurationError, match="already set up"):
        fabric.setup(model)
    with pytest.raises(MisconfigurationError, match=r"expects an nn\.Module"):
        fabric.setup("model")  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match="exactly one of max_norm"):
        fabric.clip_gradients(model, torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.raises(MisconfigurationError, match=r"returned by fabric\.setup"):
        fabric.no_backward_sync(_model())


def test_wrapped_optimizer_is_the_same_optimizer() -> None:
    fabric = Fabric(accelerator="cpu")
    raw = torch.optim.AdamW(_model().parameters(), lr=0.5)
    model = fabric.setup(_model())
    raw = torch.optim.AdamW(model.parameters(), lr=0.5)
    opt = fabric.setup_optimizers(raw)
    assert isinstance(opt, torch.optim.AdamW)
    opt.param_groups[0]["lr"] = 0.25  # writes reach the real optimizer
    assert raw.param_groups[0]["lr"] == 0.25
    fabric.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    state = opt.state_dict()
    opt.load_state_dict(state)  # replaces raw.param_groups: the wrapper must not go stale
    opt.param_groups[0]["lr"] = 0.125
    assert raw.param_groups[0]["lr"] == 0.125
    # A scheduler built on the wrapper sees its steps (no "step() before optimizer.step()" warning).
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    fabric.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    sched.step()
    assert raw.param_groups[0]["lr"] == pytest.approx(0.0625)


def test_custom_methods_and_submodules_are_reachable() -> None:
    class Net(nn.ModuleDict):
        def score(self, x: torch.Tensor) -> torch.Tensor:
            return self["head"](x).sum(1)

    fabric = Fabric(accelerator="cpu", precision="64-true")
    net = fabric.setup(Net({"head": nn.Linear(4, 2)}))
    x = torch.randn(3, 4)
    # Routed through forward, so the precision plugin converted the input to float64.
    assert net.score(x).dtype == torch.float64
    assert isinstance(net["head"], nn.Linear) and net.head is net["head"]
    net.eval()
    assert not net.training and not net.module.training
    assert "head.weight" in net.state_dict()


def test_save_load_round_trip_single(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", precision="16-mixed")
    model = fabric.setup(_model())
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        fabric.backward(model(torch.randn(4, 4)).square().mean())
        opt.step()
        sched.step()
    scaler_scale = fabric.strategy.precision.state_dict()["scaler"]["scale"]
    fabric.save(tmp_path / "a.ckpt", {"model": model, "opt": opt, "sched": sched, "step": 7, "extra": [1, 2]})

    fabric2 = Fabric(accelerator="cpu", precision="16-mixed")
    model2 = fabric2.setup(_model())
    opt2 = fabric2.setup_optimizers(torch.optim.Adam(model2.parameters(), lr=0.01))
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    state = {"model": model2, "opt": opt2, "sched": sched2, "step": 0}
    remainder = fabric2.load(tmp_path / "a.ckpt", state)
    assert remainder == {"extra": [1, 2]}
    assert state["step"] == 7
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert sched2.last_epoch == 2 and opt2.param_groups[0]["lr"] == pytest.approx(0.0025)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert fabric2.strategy.precision.state_dict()["scaler"]["scale"] == scaler_scale
    raw = fabric2.load(tmp_path / "a.ckpt")
    assert set(raw) == {"model", "opt", "sched", "step", "extra"}
    assert not list(tmp_path.glob(".*tmp*")), "no temporary file may be left behind"


def test_load_of_another_model_lists_the_keys(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    fabric.save(tmp_path / "a.ckpt", {"model": fabric.setup(_model())})
    other = fabric.setup(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 3)))
    with pytest.raises(CheckpointError, match=r"missing keys: \[3.weight, 3.bias\]") as err:
        fabric.load(tmp_path / "a.ckpt", {"model": other})
    assert "another model" in str(err.value)
    wider = fabric.setup(nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 2)))
    with pytest.raises(CheckpointError, match=r"0.weight: checkpoint \(8, 4\) vs model \(9, 4\)"):
        fabric.load(tmp_path / "a.ckpt", {"model": wider})
    with pytest.raises(CheckpointError, match=r"no entry for \['optimizer'\]; it holds \['model'\]"):
        fabric.load(tmp_path / "a.ckpt", {"model": other, "optimizer": object()})
    # strict=False loads what matches, leaves the rest, and says what it skipped.
    saved = fabric.load(tmp_path / "a.ckpt")["model"]
    untouched = {k: v.detach().clone() for k, v in other.module.state_dict().items() if k.startswith("3.")}
    with pytest.warns(PhalanxWarning, match=r"strict=False: loaded 4 of 6 entries of Sequential; skipped "
                      r"missing from the checkpoint: \[3.weight, 3.bias\]"):
        fabric.load(tmp_path / "a.ckpt", {"model": other}, strict=False)
    now = other.module.state_dict()
    assert all(torch.equal(now[k], v) for k, v in saved.items())
    assert all(torch.equal(now[k], v) for k, v in untouched.items())
    # A state entry the checkpoint lacks is left as it was, with a warning naming it.
    state = {"model": other, "step": 5}
    with pytest.warns(PhalanxWarning, match=r"has no entry for \['step'\]; they are left unchanged"):
        fabric.load(tmp_path / "a.ckpt", state, strict=False)
    assert state["step"] == 5


def test_raw_state_dict_file_points_to_load_raw_and_nothing_matching_is_refused(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    src = _model()
    torch.save(src.state_dict(), tmp_path / "raw.pt")
    model = fabric.setup(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    before = [p.detach().clone() for p in model.parameters()]
    for strict in (True, False):
        # strict=False used to be suggested here, and then loaded nothing without a word.
        with pytest.raises(CheckpointError, match=r"holds a plain state dict .* torch.save\(model.state_dict\(\)\)\. "
                           r"Load it with fabric.load_raw\(path, model\)"):
            fabric.load(tmp_path / "raw.pt", {"model": model}, strict=strict)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    fabric.load_raw(tmp_path / "raw.pt", model)
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), model.parameters()))
    # A checkpoint in which no key of the model matches is refused, not "loaded" as a no-op.
    fabric.save(tmp_path / "other.ckpt", {"model": fabric.setup(nn.Linear(3, 3))})
    with pytest.raises(CheckpointError, match=r"does not match Sequential.*strict=False loads matching keys, and none"):
        fabric.load(tmp_path / "other.ckpt", {"model": model}, strict=False)
    # load_raw of a phalanx checkpoint says which call it needs.
    with pytest.raises(CheckpointError, match=r"is a phalanx checkpoint \(entries \['model'\]\).*fabric.load"):
        fabric.load_raw(tmp_path / "other.ckpt", model)


def test_truncated_and_missing_checkpoints_fail_clearly(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(_model())
    path = tmp_path / "a.ckpt"
    fabric.save(path, {"model": model})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated or corrupt"):
        fabric.load(path, {"model": model})
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(CheckpointError, match=r"truncated or corrupt"):
        fabric.load(path, {"model": model})
    # What a save killed mid-write leaves in its preallocated temporary: data (or none yet), then zeros.
    for written in (len(data) // 2, 0):
        path.write_bytes(data[:written] + bytes(len(data) - written))
        with pytest.raises(CheckpointError, match=r"truncated or corrupt"):
            fabric.load(path, {"model": model})
    with pytest.raises(CheckpointError, match=r"nope.ckpt does not exist\. The checkpoints that do, newest first: "):
        fabric.load(tmp_path / "nope.ckpt", {"model": model})
    with pytest.raises(CheckpointError, match=r"is not a complete sharded checkpoint: phalanx_meta.pt is missing"):
        fabric.load(tmp_path, {"model": model})


def test_failed_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(_model())
    path = tmp_path / "a.ckpt"
    fabric.save(path, {"model": model, "v": 1})

    class Opaque:  # would need code to rebuild: not something a safe checkpoint can hold
        pass

    with pytest.raises(CheckpointError, match=r"state\['v'\] is a \S*test_fabric\..*Opaque, which a checkpoint "
                       r"cannot hold.*weights_only=True"):
        fabric.save(path, {"model": model, "v": Opaque()})
    assert fabric.load(path)["v"] == 1
    assert not list(tmp_path.glob(".*tmp*"))


def test_load_raw_into_module(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    src = _model()
    torch.save(src.state_dict(), tmp_path / "w.pt")
    model = fabric.setup(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    fabric.load_raw(tmp_path / "w.pt", model)
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), model.parameters()))


def test_distributed_sampler_injection_keeps_user_choices() -> None:
    ds = TensorDataset(torch.arange(10.0))
    shuffled = distribute_dataloader(DataLoader(ds, batch_size=2, shuffle=True, drop_last=True), 2, 1)
    assert shuffled.sampler.shuffle and shuffled.sampler.drop_last and shuffled.batch_size == 2  # type: ignore[attr-defined]
    plain = distribute_dataloader(DataLoader(ds, batch_size=3), 2, 0)
    assert list(plain.sampler) == [0, 2, 4, 6, 8]
    weighted = DataLoader(ds, sampler=WeightedRandomSampler([1.0] * 10, 10))
    with pytest.raises(MisconfigurationError, match=r"custom sampler .WeightedRandomSampler."):
        distribute_dataloader(weighted, 2, 0)


def test_dataloader_set_epoch_changes_order_each_pass() -> None:
    fabric = Fabric(accelerator="cpu")
    ds = TensorDataset(torch.arange(16.0))
    loader = fabric.setup_dataloaders(DataLoader(ds, batch_size=16, shuffle=True))
    first = next(iter(loader))[0]
    second = next(iter(loader))[0]
    assert sorted(first.tolist()) == sorted(second.tolist()) and not torch.equal(first, second)


def test_seed_everything_is_reproducible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_SEED", raising=False)
    before = dict(os.environ)
    assert phalanx.seed_everything(123) == 123
    a = torch.rand(3)
    phalanx.seed_everything(123)
    assert torch.equal(a, torch.rand(3))
    assert torch.initial_seed() == 123  # what the samplers read (phalanx.fabric.data.shared_seed)
    assert dict(os.environ) == before  # no process-wide state beyond the generators themselves
    monkeypatch.setenv("PHALANX_SEED", "77")  # seed=None: the environment configures it, as PL_GLOBAL_SEED does
    assert phalanx.seed_everything() == 77


def test_warnings_are_phalanx_warnings_on_rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.data import IterableDataset

    from phalanx.fabric.data import warn_iterable
    from phalanx.utils.errors import PhalanxWarning

    class Stream(IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(3))

    with pytest.warns(PhalanxWarning, match=r"wraps an IterableDataset, which no sampler can split"):
        warn_iterable(DataLoader(Stream()), rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_iterable(DataLoader(Stream()), rank=1)
    monkeypatch.setenv("PHALANX_PRECISION", "bf16-mixed")
    with pytest.warns(PhalanxWarning, match=r"The code sets precision='64-true' but the job was launched with "
                      r"--precision bf16-mixed; using bf16-mixed"):
        assert Fabric(accelerator="cpu", precision="64-true").strategy.precision.name == "bf16-mixed"


def test_logging_and_callbacks(tmp_path: Path) -> None:
    from phalanx.loggers import CSVLogger

    calls: list[tuple[str, int]] = []

    class Recorder:
        def on_thing(self, value: int) -> None:
            calls.append(("on_thing", value))

    logger = CSVLogger(tmp_path, name="exp")
    fabric = Fabric(accelerator="cpu", loggers=logger, callbacks=[Recorder(), object()])
    fabric.log("loss", torch.tensor(0.5), step=1)
    fabric.log_dict({"loss": 0.25, "acc": 0.9}, step=2)
    fabric.call("on_thing", 3)
    fabric.call("on_missing")
    fabric.teardown()
    assert calls == [("on_thing", 3)]
    lines = (tmp_path / "exp" / "version_0" / "metrics.csv").read_text().splitlines()
    assert lines[0] == "step,loss,acc" and lines[1] == "1,0.5," and lines[2] == "2,0.25,0.9"


def test_import_is_light() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(JOBS / "heavy_packages_not_imported.py")], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"
