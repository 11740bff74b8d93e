"""2-rank FSDP jobs (real processes, gloo): equivalence with single-process training, optimizer
re-pointing, direct submodule calls, gradient accumulation, clipping, empty init and precisions."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from mp import JOBS, run_job
from run_if import run_if

from phalanx import Fabric
from phalanx.strategies import FSDPStrategy, resolve_strategy
from phalanx.utils.errors import MisconfigurationError

# FSDP2 runs on CPU from torch 2.7 (scripts/torch_matrix.sh runs the oldest supported torch, 2.5, too).
pytestmark = [pytest.mark.timeout(240), run_if(fsdp=True)]

# Shared by the jobs and the single-process references (imported by the job scripts).
MODEL_CODE = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.l1 = nn.Linear(d, 2 * d)
        self.l2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.l2(torch.tanh(self.l1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Teacher(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 3)

    def forward(self, x):
        return self.proj(x)


class Distill(nn.Module):
    """A trainable student (a Net) next to a frozen teacher."""
    def __init__(self):
        super().__init__()
        self.student = Net()
        self.teacher = Teacher()
        self.teacher.requires_grad_(False)

    def forward(self, x):
        return self.student(x)


def make_model(cls=Net):
    torch.manual_seed(0)
    return cls()


def make_data(n=32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().reshape(-1).double().cpu()


def full_params(model):
    return torch.cat([full(p) for p in model.parameters()])


def full_grads(model):
    return torch.cat([full(p.grad) if p.grad is not None else torch.zeros(p.numel()).double()
                      for p in model.parameters()])
'''


def _close(got: list[float], expected: torch.Tensor, atol: float = 1e-6) -> None:
    t = torch.tensor(got, dtype=torch.float64)
    assert t.shape == expected.shape
    assert torch.allclose(t, expected, atol=atol), (t - expected).abs().max()


# ---------------------------------------------------------------------- no processes needed
def test_fsdp_is_a_registered_strategy_string() -> None:
    assert isinstance(resolve_strategy("fsdp", 2), FSDPStrategy)
    assert isinstance(resolve_strategy("FSDP", 1), FSDPStrategy)


@pytest.mark.parametrize("precision", ["32-true", "32", 32, "64-true", "bf16-mixed", "bf16", "16-mixed",
                                       "bf16-true", "16-true"])
def test_precision_strings_accepted(precision: Any) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="fsdp", precision=precision)
    plugin = fabric.strategy.precision
    canonical = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed"}.get(precision, precision)
    assert plugin.name == canonical
    if canonical.endswith("-mixed"):
        # FSDP2 does mixed precision itself: parameters all-gathered in half, gradients reduced in fp32.
        policy = plugin.policy()  # type: ignore[attr-defined]
        assert policy.reduce_dtype == torch.float32
        assert policy.param_dtype == (torch.bfloat16 if canonical == "bf16-mixed" else torch.float16)
        assert (plugin.scaler is not None) == (canonical == "16-mixed")  # type: ignore[attr-defined]


@pytest.mark.parametrize("precision", ["bf15", "8-true", "transformer-engine", "fp32"])
def test_precision_strings_refused(precision: str) -> None:
    with pytest.raises(MisconfigurationError, match=r"Unknown precision .*Choose one of '32-true'"):
        Fabric(accelerator="cpu", devices=2, strategy="fsdp", precision=precision)


def test_strategy_arguments_are_validated() -> None:
    with pytest.raises(MisconfigurationError, match=r"auto_wrap_policy must be a set of nn\.Module classes"):
        FSDPStrategy(auto_wrap_policy=lambda m: True)  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match="state_dict_type='local'; choose one of"):
        FSDPStrategy(state_dict_type="local")
    with pytest.raises(MisconfigurationError, match="Pass auto_wrap_policy or parallelize_fn, not both"):
        FSDPStrategy(auto_wrap_policy={torch.nn.Linear}, parallelize_fn=lambda m, mesh: None)


# ---------------------------------------------------------------------- training equivalence
EQUIVALENCE_JOB = """
import torch
import phalanx
from phalanx.utils.errors import GradientSyncError
from phalanx.strategies import FSDPStrategy
from mp import report
from models import Block, make_model, make_data, full_params

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(**KWARGS))
fabric.launch()
x, y = make_data()
r = fabric.global_rank
ce = torch.nn.functional.cross_entropy

# A: optimizer built before setup -> phalanx re-points it at the sharded parameters.
model2 = make_model()
model, opt = fabric.setup(model2, torch.optim.Adam(model2.parameters(), lr=0.01))
assert all(type(p).__name__ == "DTensor" for g in opt.param_groups for p in g["params"])
norms = []
for i in range(0, 32, 8):
    opt.zero_grad()
    fabric.backward(ce(model(x[i + 4 * r : i + 4 * r + 4]), y[i + 4 * r : i + 4 * r + 4]))
    norms.append(fabric.clip_gradients(model, opt, max_norm=0.5).item())
    opt.step()
report(fabric, a=full_params(model), a_norms=norms)

# B: gradient accumulation (2 micro-batches per step) through setup_module + setup_optimizers.
model = fabric.setup_module(make_model())
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
sharded_grad_none_inside_no_sync = []
for i in range(0, 32, 8):
    opt.zero_grad()
    for j, micro in enumerate((0, 2)):
        lo = i + 4 * r + micro
        with fabric.no_backward_sync(model, enabled=j == 0):
            fabric.backward(ce(model(x[lo : lo + 2]), y[lo : lo + 2]) / 2)
        if j == 0:
            # The reduce-scatter was skipped: no sharded gradient exists yet.
            sharded_grad_none_inside_no_sync.append(all(p.grad is None for p in model.parameters()))
    opt.step()
report(fabric, b=full_params(model), skipped=sharded_grad_none_inside_no_sync)

# Stepping after an unsynchronized backward must raise, like DDP.
with fabric.no_backward_sync(model):
    fabric.backward(ce(model(x[:4]), y[:4]))
try:
    opt.step()
    report(fabric, step_error=None)
except GradientSyncError as err:
    report(fabric, step_error=str(err))
"""


def _reference(models: dict[str, Any], opt_name: str, clip: bool, steps: int = 4) -> tuple[torch.Tensor, list[float]]:
    model = models["make_model"]()
    x, y = models["make_data"]()
    if opt_name == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for i in range(0, 8 * steps, 8):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 8]), y[i : i + 8]).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
    return models["full_params"](model), norms


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        # Every option that changes how work is scheduled must leave the numbers unchanged.
        {"auto_wrap_policy": {"Block"}, "reshard_after_forward": False, "cpu_offload": True,
         "activation_checkpointing_policy": {"Block"}},
    ],
    ids=["default", "options"],
)
def test_fsdp_training_equals_single_process(tmp_path: Path, models: dict[str, Any], kwargs: dict[str, Any]) -> None:
    code = EQUIVALENCE_JOB.replace("KWARGS", repr(kwargs).replace("'Block'", "Block"))
    job = run_job(code, tmp_path).check()
    expected_a, expected_norms = _reference(models, "adam", clip=True)
    expected_b, _ = _reference(models, "sgd", clip=False)
    assert max(expected_norms) > 0.5  # clipping really happened
    for rank in (0, 1):
        rep = job.reports[rank]
        _close(rep["a"], expected_a)
        assert rep["a_norms"] == pytest.approx(expected_norms, rel=1e-5)
        _close(rep["b"], expected_b)
        assert rep["skipped"] == [True] * 4
        assert rep["step_error"] is not None
        assert "optimizer.step() was called while the gradients of Net were never reduce-scattered" in (
            rep["step_error"]
        )


# ---------------------------------------------------------------------- call paths and misuse
CALL_PATHS_JOB = """
import warnings
import torch
import phalanx
from phalanx.utils.errors import MisconfigurationError
from phalanx.strategies import FSDPStrategy
from mp import report
from models import Block, Distill, Net, Teacher, make_model, make_data, full_grads, full_params

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy=POLICY))
fabric.launch()
x, _ = make_data()
xb = x[fabric.global_rank * 8 : (fabric.global_rank + 1) * 8]
model = make_model(Distill)
model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))

def errors(fn):
    try:
        fn()
        return None
    except MisconfigurationError as err:
        return str(err)

def distill_step():
    # The distillation pattern: the student is called directly, before the root ever ran forward.
    loss = ((model.student(xb) - model.teacher(xb)) ** 2).mean()
    fabric.backward(loss)

report(fabric, student_error=errors(distill_step))
report(fabric, student_grads=full_grads(model.student))
fabric.verify_in_sync(model, grads=False)

# A child that is its own sharded unit works on any policy (the blocks of a ModuleList are units).
opt.zero_grad()
fabric.backward(model.student.blocks[0](torch.ones(2, 8) * (1 + fabric.global_rank)).pow(2).sum())
report(fabric, block_grads=full_grads(model.student.blocks[0]))

# An optimizer holding pre-sharding parameters is refused.
plain = make_model()
stale = torch.optim.SGD(plain.parameters(), lr=0.1)
fabric.setup_module(plain)
report(fabric, stale_error=errors(lambda: fabric.setup_optimizers(stale)))

# An optimizer over another (unsharded) model's parameters is refused.
other = make_model()
report(fabric, unrelated_error=errors(lambda: fabric.setup(make_model(), torch.optim.SGD(other.parameters(), lr=0.1))))

# An optimizer that already has state cannot be moved to the sharded parameters.
used = make_model()
used_opt = torch.optim.Adam(used.parameters())
used(x[:2]).sum().backward()
used_opt.step()
report(fabric, state_error=errors(lambda: fabric.setup(used, used_opt)))

# model.state_dict() holds shards only: a one-time hint about torch.save.
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.state_dict()
    model.state_dict()
report(fabric, hints=[str(w.message) for w in caught])
"""


def _distill_reference(models: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    model = models["make_model"](models["Distill"])
    x, _ = models["make_data"]()
    grads = []
    for r in (0, 1):  # FSDP averages the two ranks' gradients
        model.zero_grad()
        xb = x[r * 8 : (r + 1) * 8]
        ((model.student(xb) - model.teacher(xb)) ** 2).mean().backward()
        grads.append(models["full_grads"](model.student))
    block_grads = []
    for r in (0, 1):
        model.zero_grad()
        model.student.blocks[0](torch.ones(2, 8) * (1 + r)).pow(2).sum().backward()
        block_grads.append(models["full_grads"](model.student.blocks[0]))
    return (grads[0] + grads[1]) / 2, (block_grads[0] + block_grads[1]) / 2


def test_direct_call_of_sharded_child_keeps_grads_correct(tmp_path: Path, models: dict[str, Any]) -> None:
    """``model.student(x)`` where the student is its own sharded unit: FSDP's hooks on the unit gather
    its parameters and reduce its gradients, so every rank gets the averaged gradient."""
    job = run_job(CALL_PATHS_JOB.replace("POLICY", "{Net, Block, Teacher}"), tmp_path).check()
    expected, expected_block = _distill_reference(models)
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["student_error"] is None
        _close(rep["student_grads"], expected)
        _close(rep["block_grads"], expected_block)
        assert "holds parameters from before FSDP sharded the model" in rep["stale_error"]
        assert "Adam already has state" in rep["state_error"]
        assert "SGD updates 12 parameters that are not part of Net" in rep["unrelated_error"]
        assert len(rep["hints"]) == 1
        assert "model.state_dict() holds only this rank's shards" in rep["hints"][0]


def test_direct_call_of_unsharded_child_raises(tmp_path: Path, models: dict[str, Any]) -> None:
    """With the default policy the student is not a unit: its own layers belong to the root's unit, so
    calling it directly would compute on sharded parameters and skip the reduce-scatter: it raises."""
    job = run_job(CALL_PATHS_JOB.replace("POLICY", "None"), tmp_path).check()
    _, expected_block = _distill_reference(models)
    for rank in (0, 1):
        rep = job.reports[rank]
        # The module the user called is named (not a layer inside it), with a policy that works.
        assert rep["student_error"].startswith(
            "student (Net) was called directly, but its parameters are sharded as part of the enclosing "
            "unit Distill, whose forward is not running"
        )
        assert "FSDPStrategy(auto_wrap_policy={Block, Net})" in rep["student_error"]
        _close(rep["block_grads"], expected_block)  # a block is its own unit under the default policy


# ---------------------------------------------------------------------- empty init and precision
PRECISION_JOB = """
import torch
from torch import nn
import phalanx
from phalanx.utils.errors import MisconfigurationError
from mp import report
from models import Net, make_model, make_data, full_params

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy="fsdp", precision=PRECISION)
fabric.launch()
x, y = make_data()
r = fabric.global_rank

# empty_init: parameters on the meta device, only local shards materialized at setup.
torch.manual_seed(0)
with fabric.init_module(empty_init=True):
    model = Net()
report(fabric, meta_before=all(p.is_meta for p in model.parameters()))
model = fabric.setup_module(model)
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
w = model.blocks[0].l1.weight  # (16, 8): 8 rows per rank
report(fabric, meta_after=any(p.is_meta or p.to_local().is_meta for p in model.parameters()),
       local_shape=list(w.to_local().shape), local_sum=float(w.to_local().sum()),
       param_dtype=str(w.dtype), init_std=float(w.full_tensor().std()))
dtypes = []
model.blocks[0].l1.register_forward_hook(lambda m, a, out: dtypes.append(str(a[0].dtype)))
def full_data_loss():
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))

losses = [full_data_loss()]
for _ in range(3):  # three epochs over the 32 samples, 8 per step (4 per rank)
    for i in range(0, 32, 8):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[i + 4 * r : i + 4 * r + 4]), y[i + 4 * r : i + 4 * r + 4])
        fabric.backward(loss)
        opt.step()
    losses.append(full_data_loss())
report(fabric, losses=losses, compute_dtype=dtypes[0], grad_dtype=str(w.grad.dtype))

class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

try:
    with fabric.init_module(empty_init=True):
        bad = nn.Sequential(nn.Linear(4, 4), NoReset())
    fabric.setup_module(bad)
    report(fabric, no_reset_error=None)
except MisconfigurationError as err:
    report(fabric, no_reset_error=str(err))

if PRECISION == "16-mixed":
    # An overflow on one rank only must skip the step on every rank (shards would diverge otherwise).
    before = full_params(model)
    scale = fabric.strategy.precision.scaler.get_scale()
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x[:4]), y[:4])
    fabric.backward(loss * (float("inf") if r == 1 else 1.0))
    opt.step()
    report(fabric, skipped=bool(torch.equal(before, full_params(model))),
           scale_ratio=fabric.strategy.precision.scaler.get_scale() / scale)
"""


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_empty_init_and_mixed_precision(tmp_path: Path, models: dict[str, Any], precision: str) -> None:
    job = run_job(PRECISION_JOB.replace("PRECISION", repr(precision)), tmp_path).check()
    half = "torch.float16" if precision == "16-mixed" else "torch.bfloat16"
    reps = job.reports
    print("full-data losses per epoch:", reps[0]["losses"])
    for rank in (0, 1):
        rep = reps[rank]
        assert rep["meta_before"] and not rep["meta_after"]
        assert rep["local_shape"] == [8, 8]
        # Sharded parameters, gradients and optimizer stay float32; compute runs in the half type.
        assert rep["param_dtype"] == "torch.float32" and rep["grad_dtype"] == "torch.float32"
        assert rep["compute_dtype"] == half
        # reset_parameters ran on the shards: Linear's kaiming-uniform bound for fan_in=8 is 1/sqrt(8).
        assert 0.5 / math.sqrt(8) / math.sqrt(3) < rep["init_std"] < 1.5 / math.sqrt(8) / math.sqrt(3)
        # Training works in the half type: the loss on all 32 samples falls after every epoch.
        losses = rep["losses"]
        assert all(math.isfinite(v) for v in losses)
        assert all(after < before for before, after in itertools.pairwise(losses)), losses
        assert "Modules ['1'] were created with empty_init=True but define no reset_parameters()" in (
            rep["no_reset_error"]
        )
    # Each rank initialized its own rows (no repeated rows across ranks).
    assert reps[0]["local_sum"] != reps[1]["local_sum"]
    if precision == "16-mixed":
        for rank in (0, 1):
            assert reps[rank]["skipped"] is True
            assert reps[rank]["scale_ratio"] == 0.5


# ---------------------------------------------------------------------- torch's numerics on DTensor gradients
OVERFLOW_JOB = """
import torch
import phalanx
from mp import report
from models import make_model, make_data, full_params

from phalanx.strategies import FSDPStrategy

fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=STRATEGY, precision="16-mixed")
fabric.launch()
x, y = make_data()
r = fabric.global_rank
model = fabric.setup_module(make_model())
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
scaler = fabric.strategy.precision.scaler

def step(poison, clip):
    before, scale = full_params(model), scaler.get_scale()
    opt.zero_grad()
    fabric.backward(torch.nn.functional.cross_entropy(model(x[:4]), y[:4]))
    grad = model.head.weight.grad.to_local()  # rows 0-1 on rank 0, row 2 on rank 1
    if poison and r == 1:
        # After the reduce-scatter: the overflow exists in rank 1's shard only.
        grad[0, 0] = float("inf")
    local_finite = bool(torch.isfinite(grad).all())
    if clip:
        fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
    opt.step()
    return {"local_finite": local_finite, "skipped": bool(torch.equal(before, full_params(model))),
            "scale_ratio": scaler.get_scale() / scale}

report(fabric, poisoned=step(True, clip=False), clean=step(False, clip=False),
       poisoned_clipped=step(True, clip=True), clean_clipped=step(False, clip=True))
"""


@pytest.mark.parametrize(
    "strategy",
    [
        "'fsdp'",
        # Hybrid sharding's 2-D mesh (replicate, shard) = (1, 2): the same shards, on DTensors of two dimensions.
        pytest.param("FSDPStrategy(sharding_strategy='HYBRID_SHARD', device_mesh=(1, 2))", marks=pytest.mark.slow),
    ],
    ids=["fsdp", "hybrid"],
)
def test_sixteen_mixed_overflow_in_one_shard_skips_every_rank(
    tmp_path: Path, models: dict[str, Any], strategy: str
) -> None:
    """torch's GradScaler on DTensor gradients: the found-inf flag of one rank's shard reaches every
    rank, whether the gradients are unscaled by the step or earlier by clip_gradients."""
    reps = run_job(OVERFLOW_JOB.replace("STRATEGY", strategy), tmp_path).check().reports
    for rank in (0, 1):
        for case in ("poisoned", "poisoned_clipped"):
            rep = reps[rank][case]
            assert rep["local_finite"] == (rank == 0)  # rank 0's own shard is clean...
            assert rep["skipped"] is True and rep["scale_ratio"] == 0.5  # ...and it skips all the same
        for case in ("clean", "clean_clipped"):
            rep = reps[rank][case]
            assert rep["local_finite"] and rep["skipped"] is False and rep["scale_ratio"] == 1.0


CLIP_JOB = JOBS / "fsdp_gradient_clipping.py"


def test_clipping_by_any_norm_and_by_value_equals_single_process(tmp_path: Path, models: dict[str, Any]) -> None:
    """Clipping measures the norm over every shard of every rank (inf and 1-norms too, and through
    clip_grad_norm_ where get_total_norm is missing); a non-finite norm raises on every rank; without
    torch's private root hook the call order is guarded instead."""
    reps = run_job(CLIP_JOB, tmp_path).check().reports
    model = models["make_model"]()
    x, y = models["make_data"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    expected_norms: list[float | None] = []
    for i, clip in zip(range(0, 32, 8), ((0.05, float("inf")), None, (0.1, 1.0), (0.05, 2.0))):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 8]), y[i : i + 8]).backward()
        if clip is None:
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            expected_norms.append(None)
        else:
            expected_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), *clip)))
        opt.step()
    expected_params = models["full_params"](model)
    assert expected_norms[0] > 0.05 and expected_norms[2] > 0.1 and expected_norms[3] > 0.05  # all really clip
    expected_grads, _ = _distill_reference(models)
    for rank in (0, 1):
        rep = reps[rank]
        _close(rep["params"], expected_params)
        assert rep["norms"][1] is None
        assert rep["norms"][0] == pytest.approx(expected_norms[0], rel=1e-5)
        assert rep["norms"][2] == pytest.approx(expected_norms[2], rel=1e-5)
        assert rep["norms"][3] == pytest.approx(expected_norms[3], rel=1e-5)
        assert "is non-finite, so it cannot be clipped" in rep["nonfinite_error"]
        assert rep["early_error"].startswith("student (Net) was called directly before Distill ever ran forward")
        _close(rep["student_grads"], expected_grads)


def test_root_hook_missing_from_torch_is_tolerated() -> None:
    """``_get_fsdp_state()._lazy_init`` is private to torch: a rename must not break strategy='fsdp'."""
    from phalanx.strategies.fsdp.guards import decide_root_now

    class RenamedState:
        pass

    class Module(torch.nn.Module):
        def _get_fsdp_state(self) -> RenamedState:
            return RenamedState()

    assert decide_root_now(Module()) is False
    assert decide_root_now(torch.nn.Linear(2, 2)) is False  # not sharded at all: nothing to decide
