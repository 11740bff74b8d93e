"""Lightning's ``sharding_strategy`` and ``device_mesh`` on FSDP2: the argument checks (no processes), and
2-rank jobs where hybrid sharding (HSDP on a 2-D mesh), SHARD_GRAD_OP and NO_SHARD train exactly like one
process on the concatenated batches, clip by the global norm and round-trip checkpoints on the 2-D mesh."""

from __future__ import annotations

import enum
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import JOBS, SUPPORT, run_job
from run_if import run_if

from phalanx import Fabric
from phalanx.strategies import FSDPStrategy, ModelParallelStrategy
from phalanx.strategies.fsdp.sharding import SHARDING_STRATEGIES
from phalanx.utils.errors import MisconfigurationError

pytestmark = [pytest.mark.timeout(300), run_if(fsdp=True)]

MODELS = SUPPORT / "fsdp_models.py"  # the ``models`` fixture (conftest.py); the jobs import it too


class ShardingStrategy(enum.Enum):  # the shape of torch's FSDP1 enum, which Lightning programs pass
    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()
    _HYBRID_SHARD_ZERO2 = enum.auto()


def _configured(devices: int = 2, num_nodes: int = 1, **kwargs: Any) -> FSDPStrategy:
    strategy = FSDPStrategy(**kwargs)
    Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy)
    return strategy


# ---------------------------------------------------------------------- no processes needed
@pytest.mark.parametrize(
    ("kwargs", "reshard", "shape"),
    [
        ({}, True, (2,)),
        ({"reshard_after_forward": False}, False, (2,)),
        ({"sharding_strategy": "FULL_SHARD"}, True, (2,)),
        ({"sharding_strategy": "shard_grad_op"}, False, (2,)),
        ({"sharding_strategy": "SHARD_GRAD_OP", "reshard_after_forward": False}, False, (2,)),
        ({"sharding_strategy": "HYBRID_SHARD"}, True, (1, 2)),  # Lightning's (num_nodes, devices)
        ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 1)}, True, (2, 1)),
        ({"sharding_strategy": "_HYBRID_SHARD_ZERO2", "device_mesh": [1, 2]}, False, (1, 2)),
        ({"sharding_strategy": "NO_SHARD"}, False, (2, 1)),
        ({"device_mesh": (2, 1)}, True, (2, 1)),  # a 2-D mesh alone is FSDP2's hybrid sharding
        ({"device_mesh": (2,), "sharding_strategy": "FULL_SHARD"}, True, (2,)),
        ({"sharding_strategy": ShardingStrategy.HYBRID_SHARD}, True, (1, 2)),
        ({"sharding_strategy": ShardingStrategy._HYBRID_SHARD_ZERO2, "device_mesh": (2, 1)}, False, (2, 1)),
    ],
)
def test_sharding_strategy_maps_onto_fsdp2(kwargs: dict[str, Any], reshard: bool, shape: tuple[int, ...]) -> None:
    strategy = _configured(**kwargs)
    assert strategy.reshard_after_forward is reshard
    assert strategy._mesh_shape == shape
    name = kwargs.get("sharding_strategy")
    assert strategy.sharding_strategy == (None if name is None else getattr(name, "name", str(name).upper()))


def test_hybrid_default_mesh_is_nodes_by_devices() -> None:
    assert _configured(devices=4, num_nodes=2, sharding_strategy="HYBRID_SHARD")._mesh_shape == (2, 4)
    assert _configured(devices=4, num_nodes=2, sharding_strategy="NO_SHARD")._mesh_shape == (8, 1)
    assert _configured(devices=4, num_nodes=2, sharding_strategy="FULL_SHARD")._mesh_shape == (8,)


def test_torch_sharding_strategy_enum_is_accepted() -> None:
    fsdp1 = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp1, "ShardingStrategy"):
        pytest.skip("this torch has no FSDP1 ShardingStrategy")
    for member in fsdp1.ShardingStrategy:
        assert FSDPStrategy(sharding_strategy=member).sharding_strategy == member.name
    assert {m.name for m in fsdp1.ShardingStrategy} <= set(SHARDING_STRATEGIES)


def test_lightning_fsdp1_arguments_with_an_fsdp2_meaning_are_accepted(caplog: pytest.LogCaptureFixture) -> None:
    # LitGPT's finetune scripts: FSDPStrategy(..., limit_all_gathers=True, cpu_offload=False) on 2+ devices.
    strategy = FSDPStrategy(state_dict_type="full", limit_all_gathers=True, use_orig_params=True, cpu_offload=False)
    assert (strategy.limit_all_gathers, strategy.use_orig_params) == (True, True)
    with caplog.at_level("INFO", logger="phalanx"):
        assert FSDPStrategy(limit_all_gathers=False).limit_all_gathers is False
    assert "FSDPStrategy(limit_all_gathers=False) has no effect: FSDP2 has no CPU rate limiter" in caplog.text


def test_lightning_fsdp1_arguments_without_one_are_refused() -> None:
    with pytest.raises(MisconfigurationError, match=r"^use_orig_params=False asks FSDP1 to flatten .* Drop the "):
        FSDPStrategy(use_orig_params=False)
    with pytest.raises(MisconfigurationError, match="limit_all_gathers must be True or False, got 'yes'"):
        FSDPStrategy(limit_all_gathers="yes")
    with pytest.raises(MisconfigurationError) as err:
        FSDPStrategy(backward_prefetch=None, mixed_precision=None)
    assert str(err.value).startswith(
        "FSDPStrategy runs on FSDP2 (fully_shard), which has no backward_prefetch, mixed_precision argument (an "
        "FSDP1 option Lightning passes on to torch): backward_prefetch: FSDP2 prefetches"
    )
    assert "mixed_precision: pass Fabric(precision=...)" in str(err.value)


def test_bad_sharding_arguments_are_refused_with_the_fix() -> None:
    names = "'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD', 'HYBRID_SHARD', '_HYBRID_SHARD_ZERO2'"
    for bad in ("ZERO3", 3, "HYBRID"):
        with pytest.raises(MisconfigurationError) as err:
            FSDPStrategy(sharding_strategy=bad)
        assert str(err.value) == (
            f"sharding_strategy={bad!r} is not a sharding strategy; choose one of {names} (or torch's "
            "ShardingStrategy member of that name)."
        )
    conflicts = [
        ("FULL_SHARD", False, "sharding_strategy='FULL_SHARD' means reshard_after_forward=True, but "
         "reshard_after_forward=False was passed too: pass only one of them. sharding_strategy='SHARD_GRAD_OP' is "
         "the same sharding with reshard_after_forward=False."),
        ("shard_grad_op", True, "sharding_strategy='SHARD_GRAD_OP' means reshard_after_forward=False, but "
         "reshard_after_forward=True was passed too: pass only one of them. sharding_strategy='FULL_SHARD' is the "
         "same sharding with reshard_after_forward=True."),
        ("HYBRID_SHARD", False, "sharding_strategy='HYBRID_SHARD' means reshard_after_forward=True, but "
         "reshard_after_forward=False was passed too: pass only one of them. sharding_strategy='_HYBRID_SHARD_ZERO2' "
         "is the same sharding with reshard_after_forward=False."),
        ("NO_SHARD", True, "sharding_strategy='NO_SHARD' means reshard_after_forward=False, but "
         "reshard_after_forward=True was passed too: pass only one of them. NO_SHARD never shards, so nothing is "
         "resharded."),
    ]
    for name, reshard, message in conflicts:
        with pytest.raises(MisconfigurationError) as err:
            FSDPStrategy(sharding_strategy=name, reshard_after_forward=reshard)
        assert str(err.value) == message
    with pytest.raises(MisconfigurationError) as err:
        _configured(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))
    assert str(err.value) == (
        "device_mesh=(2, 2) holds 4 ranks, but the job has 2 processes (devices=2 x num_nodes=1): the product of "
        "device_mesh must equal the world size, e.g. device_mesh=(1, 2)."
    )
    with pytest.raises(MisconfigurationError, match=r"^device_mesh=\(3,\) holds 3 ranks, but the job has 2"):
        _configured(device_mesh=(3,))
    with pytest.raises(MisconfigurationError, match=r"^device_mesh=\(0, 2\): pass a shape \(replicate, shard\)"):
        FSDPStrategy(device_mesh=(0, 2))
    with pytest.raises(MisconfigurationError, match=r"^device_mesh=\(1, 1, 2\): pass a shape"):
        FSDPStrategy(device_mesh=(1, 1, 2))
    with pytest.raises(MisconfigurationError, match="that is hybrid sharding, sharding_strategy='HYBRID_SHARD'"):
        FSDPStrategy(sharding_strategy="FULL_SHARD", device_mesh=(2, 1))
    with pytest.raises(MisconfigurationError, match=r"needs a 2-D device_mesh \(replicate, shard\), got a 1-D one"):
        FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2,))
    with pytest.raises(MisconfigurationError, match="'NO_SHARD' replicates the whole model on every rank and takes no"):
        FSDPStrategy(sharding_strategy="NO_SHARD", device_mesh=(2, 1))
    with pytest.raises(MisconfigurationError, match=r"^ModelParallelStrategy takes no sharding_strategy: its mesh is"):
        ModelParallelStrategy(sharding_strategy="HYBRID_SHARD")


# ---------------------------------------------------------------------- 2-rank jobs
HYBRID_JOB = JOBS / "fsdp_hybrid_cases.py"  # argv: the cases as JSON, devices

FAST_CASES = [
    ("hybrid_2x1", {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 1)}, "32-true"),
    ("hybrid_1x2", {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (1, 2)}, "32-true"),
    ("shard_grad_op", {"sharding_strategy": "SHARD_GRAD_OP"}, "32-true"),
]
SLOW_CASES = [
    ("no_shard", {"sharding_strategy": "NO_SHARD"}, "32-true"),
    ("hybrid_mesh_object", {"sharding_strategy": "HYBRID_SHARD", "device_mesh": "MESH_OBJECT"}, "32-true"),
    ("hybrid_zero2_2x1", {"sharding_strategy": "_HYBRID_SHARD_ZERO2", "device_mesh": (2, 1),
                          "auto_wrap_policy": {"Block"}, "activation_checkpointing_policy": {"Block"}}, "32-true"),
    ("hybrid_default_offload", {"sharding_strategy": "HYBRID_SHARD", "cpu_offload": True}, "32-true"),
    ("hybrid_bf16_2x1", {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 1)}, "bf16-mixed"),
    ("full_shard_bf16", {"sharding_strategy": "FULL_SHARD"}, "bf16-mixed"),  # what hybrid bf16 must equal
]


def _reference(models: dict[str, Any]) -> tuple[torch.Tensor, list[float]]:
    model = models["make_model"]()
    x, y = models["make_data"]()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    norms = []
    for norm_type, i in zip((2.0, math.inf, 1.0, 2.0), range(0, 32, 8)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 8]), y[i : i + 8]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25, norm_type)))
        opt.step()
    return models["full_params"](model), norms


def _run_cases(
    tmp_path: Path, models: dict[str, Any], cases: list[tuple[str, dict[str, Any], str]], devices: int = 2
) -> dict[str, Any]:
    as_json = json.dumps([(name, {k: sorted(v) if isinstance(v, set) else v for k, v in kwargs.items()}, precision)
                          for name, kwargs, precision in cases])
    reports = run_job(HYBRID_JOB, tmp_path, args=(as_json, str(devices)), timeout=280).check().reports
    expected, expected_norms = _reference(models)
    assert min(expected_norms) > 0.25  # every step really clips
    for name, kwargs, precision in cases:
        atol, rel = (1e-6, 1e-5) if precision == "32-true" else (2e-2, 5e-2)  # bf16: max error seen 0.011
        mesh = kwargs.get("device_mesh")
        shape = [2, 1] if mesh == "MESH_OBJECT" else list(mesh or ())
        for rank in range(devices):
            rep = reports[rank]
            got = torch.tensor(rep[name], dtype=torch.float64)
            assert torch.allclose(got, expected, atol=atol), (name, (got - expected).abs().max())
            assert rep[name + ":norms"] == pytest.approx(expected_norms, rel=rel), name
            assert rep[name + ":unreduced"] == [True] * 4, name
            assert rep[name + ":sampler"] == {"num_replicas": devices, "rank": rank}  # every rank is data parallel
            if shape:
                assert rep[name + ":mesh"] == shape
            if name.startswith("hybrid") or name == "no_shard":
                assert rep[name + ":placements"] == ["R", "S(0)"]  # (Replicate(), Shard(0))
                _, shards = rep[name + ":mesh"]
                assert rep[name + ":local_rows"] == 8 // shards, name  # inp.weight has 8 rows
                assert rep[name + ":in_sync"] == [True, True], name
            if precision != "32-true":  # the same bf16 arithmetic as FULL_SHARD: equal to fp32 rounding
                same = torch.tensor(rep["full_shard_bf16"], dtype=torch.float64)
                assert torch.allclose(got, same, atol=1e-6), (name, (got - same).abs().max())
            if mesh == "MESH_OBJECT":
                assert rep["unnamed_mesh"].startswith("A 2-D device_mesh for hybrid sharding needs dimension names")
            loaded = [key for key in rep if key.startswith(name + "<-")]
            for key in loaded:
                assert rep[key] == rep[key.split("<-ckpt-")[1]], key
            if name.startswith("hybrid"):
                assert rep[f"ckpt-{name}"] is True and rep[f"ckpt-{name}.pt"] is True, name
    return reports[0]


def test_hybrid_and_shard_grad_op_train_like_one_process(tmp_path: Path, models: dict[str, Any]) -> None:
    """HSDP on (2, 1) (pure replication) and (1, 2) (pure sharding) and SHARD_GRAD_OP equal single-process
    training with gradient accumulation and clipping by 2-, inf- and 1-norms; sharded and full checkpoints
    on the 2-D mesh load back bit-identical, on the same mesh and on the others."""
    rep = _run_cases(tmp_path, models, FAST_CASES)
    loads = {"hybrid_1x2<-ckpt-hybrid_2x1", "shard_grad_op<-ckpt-hybrid_1x2", "shard_grad_op<-ckpt-hybrid_2x1"}
    assert loads <= set(rep)


@pytest.mark.slow
def test_no_shard_zero2_offload_and_bf16_train_like_one_process(tmp_path: Path, models: dict[str, Any]) -> None:
    _run_cases(tmp_path, models, SLOW_CASES)


@pytest.mark.slow
def test_hybrid_on_four_ranks_shards_and_replicates(tmp_path: Path, models: dict[str, Any]) -> None:
    """The mesh (2, 2): two replicas of a model sharded over two ranks each (4 processes)."""
    _run_cases(tmp_path, models, [("hybrid_2x2", {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2)},
                                   "32-true")], devices=4)
