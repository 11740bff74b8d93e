"""Bad input: every mistake gets an error that says what went wrong and how to fix it, and nothing hangs.

Configuration mistakes are checked in-process (they fail before any process group exists); mistakes
that only show up with several ranks (a collective on some ranks, unequal shards) run real 2-rank gloo
jobs, each with a hard timeout.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from job_runner import JOBS, run_job
from run_if import run_if
from torch import nn

from phalanx import Fabric
from phalanx.strategies import DDPStrategy, SingleDeviceStrategy, parallel
from phalanx.utils.compat import FSDP_ON_CPU
from phalanx.utils.errors import CheckpointError, MisconfigurationError

pytestmark = pytest.mark.timeout(180)
# FSDP2 runs on CPU from torch 2.7 (scripts/torch_matrix.sh runs the oldest supported torch, 2.5, too).
CPU_FSDP = run_if(fsdp=True)

ENV = {"PHALANX_GUARD_TIMEOUT": "4"}


def _mlp(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


# ---------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("kwargs", "problem", "fix"),
    [
        ({"strategy": "dpp"}, "Unknown strategy 'dpp'", "Choose one of 'auto', 'single', 'single_device', 'ddp'"),
        ({"precision": "fp16"}, "Unknown precision 'fp16'", "Choose one of '32-true', '64-true', '16-mixed'"),
        ({"accelerator": "mps"}, "Unknown accelerator 'mps'", "Choose one of 'auto', 'cpu', 'cuda', 'gpu'"),
        ({"lockstep": "loose"}, "lockstep='loose' is not a mode", "choose one of ('default', 'strict')"),
        ({"devices": -2}, "devices must be a positive integer or 'auto', got -2", "positive integer"),
    ],
)
def test_unknown_strings_name_the_valid_choices(kwargs: dict[str, object], problem: str, fix: str) -> None:
    with pytest.raises(MisconfigurationError) as err:
        Fabric(**kwargs)  # type: ignore[arg-type]
    assert problem in str(err.value) and fix in str(err.value)


def test_more_devices_than_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(MisconfigurationError, match=r"devices=4 but only 2 CUDA device\(s\) are visible on this node. "
                       r"Pass devices<=2 \(or devices='auto'\)"):
        Fabric(accelerator="cuda", devices=4)


class _Fp32OnlyStrategy(SingleDeviceStrategy):
    """Stands for a backend with a narrow precision menu (the check lives on the strategy)."""

    supported_precisions = ("32-true", "64-true")


def test_precision_the_strategy_cannot_run() -> None:
    with pytest.raises(MisconfigurationError, match=r"precision='bf16-mixed' is not supported by strategy='single'. "
                       r"It supports '32-true', '64-true'"):
        Fabric(accelerator="cpu", strategy=_Fp32OnlyStrategy(), precision="bf16-mixed")


def test_lockstep_is_a_fabric_argument() -> None:
    assert Fabric(accelerator="cpu", devices=2, lockstep="strict").strategy.lockstep == "strict"  # type: ignore[attr-defined]
    assert Fabric(accelerator="cpu", devices=2).strategy.lockstep == "default"  # type: ignore[attr-defined]
    Fabric(accelerator="cpu", lockstep="strict")  # one process: nothing to compare, but accepted
    with pytest.raises(MisconfigurationError, match=r"Fabric\(lockstep='strict'\) contradicts "
                       r"DDPStrategy\(lockstep='default'\); set the mode in one place"):
        Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(lockstep="default"), lockstep="strict")


@pytest.mark.parametrize(
    ("env", "kwargs", "message"),
    [
        ({"WORLD_SIZE": "3"}, {"devices": 2},
         r"asks for devices=2, num_nodes=1 \(2 processes\), but env started 3 process\(es\) with 3 per node. "
         r"Either change devices/num_nodes to match, or set WORLD_SIZE=2 and LOCAL_WORLD_SIZE=2"),
        # A one-process strategy inside a launched 2-process job would train two independent copies.
        ({"WORLD_SIZE": "2"}, {"devices": 1}, r"asks for devices=1, num_nodes=1 \(1 processes\), but env started 2"),
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, {"devices": 1, "num_nodes": 2},
         r"started 2 process\(es\) with 2 per node.*set WORLD_SIZE=2 and LOCAL_WORLD_SIZE=1"),
        ({"WORLD_SIZE": "2", "RANK": "5"}, {"devices": 2}, r"RANK=5 is outside \[0, WORLD_SIZE=2\)"),
        ({"WORLD_SIZE": "two"}, {"devices": 2}, r"Environment variable WORLD_SIZE='two' is not an integer"),
    ],
)
def test_launch_environment_that_contradicts_the_code(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], kwargs: dict[str, int], message: str
) -> None:
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in {"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555", **env}.items():
        monkeypatch.setenv(var, value)
    fabric = Fabric(accelerator="cpu", **kwargs)  # type: ignore[arg-type]

    def rendezvous(*args: object, **kwargs: object) -> None:
        raise AssertionError("the check must come before any rendezvous (it would wait for ranks that never come)")

    monkeypatch.setattr(parallel, "TCPStore", rendezvous)
    monkeypatch.setattr(torch.distributed, "init_process_group", rendezvous)
    with pytest.raises(MisconfigurationError, match=message):
        fabric.launch()


def test_backward_before_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    # Allowed on one process (as in Lightning); refused where gradients would not sync (test_unmanaged_backward.py).
    fabric = Fabric(accelerator="cpu")
    monkeypatch.setattr(Fabric, "world_size", property(lambda self: 2))
    with pytest.raises(MisconfigurationError, match=r"`model, optimizer = fabric.setup\(model, optimizer\)`"):
        fabric.backward(_mlp()(torch.randn(2, 4)).sum())


# ---------------------------------------------------------------- checkpoints
def test_checkpoint_of_another_model_lists_keys(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    fabric.save(tmp_path / "a.ckpt", {"model": fabric.setup(_mlp())})
    other = fabric.setup(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), nn.Linear(2, 2), nn.Linear(2, 1)))
    other.module[2] = nn.Identity()
    with pytest.raises(CheckpointError) as err:
        fabric.load(tmp_path / "a.ckpt", {"model": other})
    text = str(err.value)
    assert "missing keys: [3.weight, 3.bias, 4.weight, 4.bias]" in text
    assert "unexpected keys: [2.weight, 2.bias]" in text
    assert "Is it a checkpoint of another model? Pass strict=False to load the matching entries only." in text


@pytest.mark.parametrize("damage", ["empty", "truncated", "flipped", "not-a-dict"])
def test_truncated_or_corrupt_checkpoint_file(tmp_path: Path, damage: str) -> None:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(_mlp())
    path = tmp_path / "a.ckpt"
    fabric.save(path, {"model": model})
    data = bytearray(path.read_bytes())
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(data[: len(data) - 100])
    elif damage == "flipped":
        # Overwrite the middle (the zip's record headers and tensor bytes): not a valid archive anymore.
        data[len(data) // 4 : len(data) // 4 + 64] = b"\xff" * 64
        path.write_bytes(bytes(data))
    else:
        torch.save([1, 2, 3], path)
    expected = r"holds a list, not a dict of state" if damage == "not-a-dict" else (
        r"\(\d+ bytes\) is truncated or corrupt and cannot be read: .*use an earlier checkpoint"
    )
    with pytest.raises(CheckpointError, match=expected):
        fabric.load(path, {"model": model})


# ---------------------------------------------------------------- things only several ranks can get wrong
def test_mistakes_across_ranks_fail_fast_and_leave_ranks_in_step(tmp_path: Path) -> None:
    """One strict-mode job; every mistake here is caught before any real collective starts, so the
    ranks are still in step afterwards and the job goes on to the next case."""
    job = run_job(
        JOBS / "bad_input_mistakes_across_ranks.py",
        tmp_path,
        timeout=150,
        env=ENV,
    ).check()
    for rank in (0, 1):
        out = job.reports[rank]["out"]
        kind, msg, _ = out["sampler"]
        assert kind == "MisconfigurationError" and "WeightedRandomSampler" in msg
        assert "Make it rank-aware" in msg and "use_distributed_sampler=False" in msg
        for op, called in (("save", "save"), ("barrier", "barrier"), ("all_reduce", "all_reduce(mean:(3,):float32)")):
            # The lockstep check's own error, naming both operations: not a timeout, however slow the box.
            kind, msg, _ = out[op]
            assert kind == "CollectiveMismatchError", (op, out[op])
            assert f"rank 0 called {called} at job.py" in msg and "rank 1 called all_gather((1,):float32)" in msg
            assert "look for a collective inside a rank-dependent branch" in msg
        kind, msg, _ = out["shapes"]
        assert "Ranks called different tensor shapes/dtypes" in msg and "(2,):float32" in msg and "(3,):float32" in msg
        kind, msg, _ = out["call_sites"]
        assert kind == "CollectiveMismatchError" and "call sites (lockstep='strict')" in msg, out["call_sites"]
        assert out["train"] == ["ok", "", 0.0], out["train"]
    assert not (tmp_path / "x.ckpt").exists()


UNEQUAL = JOBS / "unequal_batch_counts.py"  # argv[1]: whether to accumulate


@pytest.mark.parametrize(
    ("accumulate", "expected"),
    [
        # Rank 1 runs out while rank 0 enters the all-reduce of its extra batch.
        (False, r"Rank 1's dataloader ran out after 3 batches while another rank still had batches"),
        # No communication in the extra batch: both ranks reach the end and compare their counts.
        (True, r"Ranks ran different numbers of batches in one pass over a dataloader \(rank 0: 4, rank 1: 3\)"),
    ],
)
def test_unequal_batch_counts_with_user_sharded_data(tmp_path: Path, accumulate: bool, expected: str) -> None:
    """Without the check, the two epochs' all-reduces silently pair up across epochs and the job dies
    at the end with a bare gloo 'Connection closed by peer' (or hangs until the 30 min timeout)."""
    job = run_job(UNEQUAL, tmp_path, args=(str(accumulate),), timeout=120, env=ENV)
    assert job.returncode != 0
    reports = [job.reports[r] for r in sorted(job.reports) if "message" in job.reports[r]]
    assert any(rep["error"] == "CollectiveMismatchError" for rep in reports), job.output[-3000:]
    messages = " | ".join(rep["message"] for rep in reports)
    assert re.search(expected, messages), messages
    assert "give every rank the same number of batches (truncate to the shortest shard, or pad)" in messages


# ---------------------------------------------------------------- sharded (FSDP) mistakes, when FSDP exists
FSDP_MISTAKES = JOBS / "fsdp_mistakes.py"  # argv[1]: the mistake


@CPU_FSDP
def test_sharded_checkpoint_mistakes(tmp_path: Path) -> None:
    job = run_job(
        FSDP_MISTAKES,
        tmp_path,
        args=("save_then_load_wider",),
        timeout=150,
        env=ENV,
    )
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["error"] == "CheckpointError", rep
        assert "0.weight" in rep["message"], rep
    # Damage one file of the sharded directory: load must refuse it, naming the file, not hang.
    files = sorted(p for p in (tmp_path / "sharded").rglob("*") if p.is_file() and p.stat().st_size > 64)
    assert files, "the sharded checkpoint has no files"
    victim = max(files, key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    job = run_job(
        FSDP_MISTAKES,
        tmp_path,
        args=("load",),
        timeout=150,
        env=ENV,
        name="load.py",
    )
    assert any(job.reports[r]["error"] == "CorruptCheckpointError" and f"{victim.name}" in job.reports[r]["message"]
               for r in job.reports), (job.reports, job.output[-3000:])


@CPU_FSDP
def test_optimizer_built_before_fsdp_setup_is_refused(tmp_path: Path) -> None:
    job = run_job(
        FSDP_MISTAKES,
        tmp_path,
        args=("optimizer_before_setup",),
        timeout=150,
        env=ENV,
    )
    for rank in (0, 1):
        assert job.reports[rank]["error"] == "MisconfigurationError", job.reports[rank]
        assert "optimizer" in job.reports[rank]["message"].lower()


def test_fsdp_on_cpu_is_refused_where_torch_cannot_run_it() -> None:
    if FSDP_ON_CPU:
        assert Fabric(accelerator="cpu", devices=2, strategy="fsdp").strategy.name == "fsdp"
    else:
        with pytest.raises(MisconfigurationError, match=r"strategy='fsdp' on CPU needs torch >= 2\.7 \(torch 2\.[56]"):
            Fabric(accelerator="cpu", devices=2, strategy="fsdp")


SUMMING_GLOO_JOB = JOBS / "summing_gloo.py"


@CPU_FSDP
def test_fsdp_refuses_a_gloo_whose_reduce_scatter_sums(tmp_path: Path) -> None:
    """FSDP2 averages gradients with ReduceOp.AVG; a gloo that sums instead (torch 2.7) would train on
    gradients world_size times too large, silently: phalanx checks once at launch and refuses."""
    reports = run_job(SUMMING_GLOO_JOB, tmp_path, timeout=120, env=ENV).check().reports
    for rank in (0, 1):
        assert reports[rank]["error"].startswith("strategy='fsdp' on gloo (CPU) needs a torch whose gloo "
                                                 "reduce-scatter averages"), reports[rank]
        assert "gradients would be 2x too large" in reports[rank]["error"]
