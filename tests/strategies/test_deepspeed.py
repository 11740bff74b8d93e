"""DeepSpeed ZeRO 1/2/3 on CPU with gloo: equivalence with DDP and single-process training,
accumulation semantics, checkpoints, and every configuration conflict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import JOBS, REPO, run_job
from run_if import run_if

import phalanx
from phalanx.strategies import DeepSpeedStrategy, resolve_strategy
from phalanx.strategies.deepspeed.strategy import build_zero_config, import_deepspeed
from phalanx.utils.errors import MisconfigurationError

pytestmark = run_if(deepspeed=True)

TIMEOUT = 180

TRAIN_JOB = JOBS / "deepspeed_accumulation.py"


def _params(job: Any, rank: int, key: str = "params") -> torch.Tensor:
    return torch.tensor(job.reports[rank][key], dtype=torch.float64)


@pytest.fixture(scope="module")
def ddp_result(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return run_job(TRAIN_JOB, tmp_path_factory.mktemp("ddp"), args=("ddp",), timeout=TIMEOUT).check()


# Fabric's accumulation on every stage runs in slow; CI's is test_trainer_accumulation_matches_ddp (ZeRO-2
# through the Trainer, which drives Fabric's public no_backward_sync).
@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3)])
def test_accumulated_training_equals_ddp_and_single_process(tmp_path: Path, stage: int, ddp_result: Any) -> None:
    job = run_job(TRAIN_JOB, tmp_path, args=(f"deepspeed_{stage}",), timeout=TIMEOUT).check()
    for rank in (0, 1):
        report = job.reports[rank]
        # 3 windows of 3 micro-batches: the wrapped optimizer really stepped 3 times, as under DDP.
        assert report["calls"] == ddp_result.reports[rank]["calls"] == 3
        torch.testing.assert_close(_params(job, rank), _params(job, rank, "reference"), rtol=0, atol=1e-6)
        torch.testing.assert_close(_params(job, rank), _params(ddp_result, rank), rtol=0, atol=1e-6)


MISUSE_JOB = JOBS / "deepspeed_misuse.py"


def test_misuse_raises_like_ddp_and_clipping_maps_to_deepspeed(tmp_path: Path) -> None:
    job = run_job(MISUSE_JOB, tmp_path, timeout=TIMEOUT).check()
    for rank in (0, 1):
        report = job.reports[rank]
        errors = report["errors"]
        assert errors["step_after_no_sync"].startswith("GradientSyncError: optimizer.step() was called while the")
        assert "no_backward_sync" in errors["step_after_no_sync"]
        assert "zero_grad() was called after a backward without an optimizer.step()" in errors["zero_grad_without_step"]
        assert "clip_val= (clipping by value) cannot be honoured" in errors["clip_val"]
        assert "norm_type=1.0 cannot be honoured" in errors["norm_type"]
        assert "already holds an engine" in errors["second_engine"]
        assert "fabric.setup(model, optimizer)" in errors["setup_optimizers"]
        assert report["calls"] == 1  # the refused step did not reach the optimizer
        # lr * clipped norm: SGD without momentum moves the parameters by exactly lr * 1e-3.
        assert report["grad_norm"] > 1e-3
        assert report["update_norm"] == pytest.approx(0.1 * 1e-3, rel=1e-3)  # float32 parameter differences


CKPT_JOB = JOBS / "deepspeed_checkpoint.py"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_round_trip_and_world_size_change(tmp_path: Path, stage: int) -> None:
    saved = run_job(CKPT_JOB, tmp_path, args=("save", str(stage), "2"), timeout=TIMEOUT).check()
    final = _params(saved, 0)
    torch.testing.assert_close(final, _params(saved, 0, "reference"), rtol=0, atol=1e-6)
    assert saved.reports[0]["broken"].startswith("CheckpointError: ")
    assert "is not a complete sharded checkpoint: phalanx_meta.pt is missing" in saved.reports[0]["broken"]
    assert (tmp_path / "ckpt" / "phalanx_meta.pt").is_file() and (tmp_path / "full.pt").is_file()
    assert not list(tmp_path.glob(".ckpt.*"))  # no temporary directory left behind

    # Same world size: the sharded checkpoint resumes exactly (momentum included).
    resumed = run_job(CKPT_JOB, tmp_path, args=("load_sharded", str(stage), "2"), timeout=TIMEOUT).check()
    for rank in (0, 1):
        torch.testing.assert_close(_params(resumed, rank), final, rtol=0, atol=1e-6)
        assert resumed.reports[rank]["calls"] == 2

    # One process: the sharded form (ZeRO's partitions merged into full state) and the full file both
    # resume exactly, momentum included.
    for mode in ("load_sharded", "load_full"):
        single = run_job(CKPT_JOB, tmp_path, args=(mode, str(stage), "1"), timeout=TIMEOUT).check()
        assert "error" not in single.reports[0], single.reports[0]["error"]
        torch.testing.assert_close(_params(single, 0), final, rtol=0, atol=1e-6)


def test_zero3_save_refuses_incomplete_dirs_and_full_file_loads_into_plain_torch(tmp_path: Path) -> None:
    """Stage 3 in the fast suite: training equals the reference, a directory without its meta file is
    refused, and the full file uses torch's own layout (a plain model and optimizer load it)."""
    job = run_job(CKPT_JOB, tmp_path, args=("save", "3", "2"), timeout=TIMEOUT).check()
    for rank in (0, 1):
        torch.testing.assert_close(_params(job, rank), _params(job, rank, "reference"), rtol=0, atol=1e-6)
        assert "is not a complete sharded checkpoint: phalanx_meta.pt is missing" in job.reports[rank]["broken"]
        assert job.reports[rank]["finite_despite_padding"] is True and job.reports[rank]["nan_on_rank1"] is False
    assert not list(tmp_path.glob(".ckpt.*"))
    # Both files phalanx wrote open with torch's safe loader: the marker of the sharded form and the full file.
    assert torch.load(tmp_path / "ckpt" / "phalanx_meta.pt", weights_only=True)["extras"] == {"step": 2}
    ckpt = torch.load(tmp_path / "full.pt", weights_only=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model.load_state_dict(ckpt["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(ckpt["optimizer"])
    assert ckpt["step"] == 2
    assert len(opt.state) == 4 and all(s["momentum_buffer"].abs().sum() > 0 for s in opt.state.values())


TRAINER_JOB = JOBS / "deepspeed_trainer_fit.py"


def test_trainer_accumulation_matches_ddp(tmp_path: Path) -> None:
    """Trainer(accumulate_grad_batches=4) on DeepSpeed: one real step per window (hooks, scheduler,
    global_step and the optimizer's own step() count), and the same parameters as under DDP."""
    (tmp_path / "ddp").mkdir()
    ddp = run_job(TRAINER_JOB, tmp_path / "ddp", args=("ddp",), timeout=TIMEOUT).check()
    ds = run_job(TRAINER_JOB, tmp_path, args=("deepspeed_stage_2",), timeout=TIMEOUT).check()
    # 10 batches of 4 per rank -> windows of 4, 4 and 2 batches: 3 real steps.
    expected = {"before_step": 3, "optimizer_step": 3, "scheduler": 3, "train_batches": 10}
    for rank in (0, 1):
        report = ds.reports[rank]
        assert report["counts"] == ddp.reports[rank]["counts"] == expected
        assert report["opt_steps"] == ddp.reports[rank]["opt_steps"] == 3
        assert report["global_step"] == 3
        torch.testing.assert_close(_params(ds, rank), _params(ddp, rank), rtol=0, atol=1e-6)


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])  # the same merge of partitions
def test_validate_with_a_sharded_checkpoint_loads_the_fitted_weights(tmp_path: Path, stage: int) -> None:
    """trainer.validate(ckpt_path=<sharded DeepSpeed checkpoint>) sets the module up without its optimizer,
    so there is no engine: the ZeRO partitions are merged into full weights, and the new module validates
    to the fitted model's metric (tests/support/deepspeed_validate_job.py)."""
    job = run_job(JOBS / "deepspeed_validate.py", tmp_path, args=(str(stage),),
                  timeout=TIMEOUT).check()
    for rank in (0, 1):
        report = job.reports[rank]
        assert report["layout"] == "deepspeed", report  # the engine's own checkpoint, not a single file
        assert report["moved"] and report["equal"], report
        assert report["loaded"] == pytest.approx(report["fitted"], rel=1e-6), report


# ---------------------------------------------------------------------- configuration (no processes)
def _configured(precision: str = "32-true", **kwargs: Any) -> DeepSpeedStrategy:
    strategy = DeepSpeedStrategy(**kwargs)
    strategy.configure(device_type="cpu", devices=1, num_nodes=1, precision=precision)
    return strategy


def test_strings_resolve_lazily_without_importing_deepspeed() -> None:
    assert resolve_strategy("deepspeed", 2).stage == 2  # type: ignore[attr-defined]
    for stage in (1, 2, 3):
        strategy = resolve_strategy(f"deepspeed_stage_{stage}", 2)
        assert isinstance(strategy, DeepSpeedStrategy) and strategy.stage == stage
    subprocess.run([sys.executable, str(JOBS / "deepspeed_imported_lazily.py")], check=True, cwd=REPO, timeout=120)


def test_missing_deepspeed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(MisconfigurationError, match=r"pip install 'phalanx\[deepspeed\]'"):
        import_deepspeed()


def test_config_defaults() -> None:
    cfg = _configured(stage=3).config
    assert cfg["zero_optimization"] == {"stage": 3}
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["train_micro_batch_size_per_gpu"] == 1
    assert cfg["gradient_clipping"] == 0.0  # DeepSpeed's own default (1.0) would clip silently
    assert _configured(config={"zero_optimization": {"stage": 1}}).stage == 1
    assert _configured("bf16-mixed").config["bf16"] == {"enabled": True}
    offloaded = _configured(stage=3, offload_optimizer=True, offload_parameters=True).config["zero_optimization"]
    assert offloaded["offload_optimizer"]["device"] == "cpu" and offloaded["offload_param"]["device"] == "cpu"


def test_config_from_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3}, "gradient_clipping": 0.5}')
    strategy = _configured(config=str(path))
    assert strategy.stage == 3 and strategy.config["gradient_clipping"] == 0.5
    with pytest.raises(MisconfigurationError, match="does not exist"):
        DeepSpeedStrategy(config=tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(MisconfigurationError, match="is not valid JSON"):
        DeepSpeedStrategy(config=path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": 2, "config": {"zero_optimization": {"stage": 3}}},
         r"config sets zero_optimization.stage=3, but DeepSpeedStrategy was given stage=2"),
        ({"offload_optimizer": True, "config": {"zero_optimization": {"offload_optimizer": {"device": "none"}}}},
         r"offload_optimizer.device='none', but DeepSpeedStrategy was given offload_optimizer=True"),
        ({"offload_optimizer": False, "config": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}},
         r"offload_optimizer.device='cpu', but DeepSpeedStrategy was given offload_optimizer=False"),
        ({"stage": 2, "offload_parameters": True}, r"Parameter offload needs ZeRO stage 3, but the stage is 2"),
        ({"config": {"gradient_accumulation_steps": 4}}, r"sets gradient_accumulation_steps=4.*Remove"),
        ({"config": {"managed_gradient_accumulation": False}}, r"managed_gradient_accumulation=false"),
        ({"stage": 0}, r"ZeRO stage must be 1, 2 or 3, got 0.*strategy='ddp'"),
        ({"state_dict_type": "zip"}, r"state_dict_type='zip'"),
        ({"config": 3}, r"config must be a dict, a path"),
    ],
)
def test_conflicting_arguments_raise(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(MisconfigurationError, match=match):
        DeepSpeedStrategy(**kwargs)


@pytest.mark.parametrize(
    ("precision", "config", "match"),
    [
        ("32-true", {"bf16": {"enabled": True}}, r"config enables bf16, but Fabric's precision is '32-true'"),
        ("bf16-mixed", {"bf16": {"enabled": False}}, r"sets bf16.enabled=false, but Fabric's precision is"),
        ("bf16-true", {"fp16": {"enabled": True}}, r"config enables fp16, but Fabric's precision is 'bf16-true'"),
        ("16-mixed", None, r"needs a GPU: DeepSpeed's CPU backend has no float16 support"),
        ("64-true", None, r"precision='64-true' is not supported by strategy='deepspeed'"),
    ],
)
def test_precision_conflicts_raise(precision: str, config: dict[str, Any] | None, match: str) -> None:
    with pytest.raises(MisconfigurationError, match=match):
        _configured(precision, config=config)


def test_config_dict_is_not_mutated() -> None:
    user = {"zero_optimization": {"stage": 2}}
    build_zero_config(user, None, True, None)
    assert user == {"zero_optimization": {"stage": 2}}


def test_fabric_accepts_the_strategy_object() -> None:
    fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=DeepSpeedStrategy(stage=1), precision="bf16-mixed")
    assert fabric.strategy.name == "deepspeed" and fabric.strategy.precision.name == "bf16-mixed"


SNAPSHOT_JOB = JOBS / "deepspeed_snapshot.py"


# Stage 3 (partitioned parameters, some kept gathered between steps) in CI; the other stages and bf16 in slow.
@pytest.mark.parametrize("stage,precision", [
    (3, "32-true"),
    pytest.param(1, "32-true", marks=pytest.mark.slow),
    pytest.param(2, "32-true", marks=pytest.mark.slow),
    pytest.param(2, "bf16-mixed", marks=pytest.mark.slow),
    pytest.param(3, "bf16-mixed", marks=pytest.mark.slow),
])
def test_snapshot_restores_the_zero_partitions_exactly(tmp_path: Path, stage: int, precision: str) -> None:
    # The snapshot is this rank's ZeRO partition in shared memory (no file, no collective): restored into the
    # engine it gives back the weights, the fp32 master weights and Adam's moments of its step, and training
    # from there repeats the uninterrupted run.
    job = run_job(SNAPSHOT_JOB, tmp_path, args=(str(stage), precision), timeout=TIMEOUT).check()
    for rank in (0, 1):
        r = job.reports[rank]
        assert r["complete"] == [3] and r["files"] == [] and r["step"] == 3
        assert r["uninterrupted"]["params"] != r["at_snapshot"]["params"]  # the run moved on after it
        for key in ("params", "moments", "lr"):
            torch.testing.assert_close(torch.tensor(r["restored"][key]), torch.tensor(r["at_snapshot"][key]),
                                       rtol=0, atol=0)
            torch.testing.assert_close(torch.tensor(r["resumed"][key]), torch.tensor(r["uninterrupted"][key]),
                                       rtol=0, atol=0)
