"""The precision contract: :class:`Precision`, whose defaults are full precision and no-ops, and
:class:`Placement`, what a strategy tells its precision about where the module runs.

A strategy calls these methods and nothing else (it never asks which class it holds), so a precision
that overrides one of them keeps what it adds on every strategy. Precisions know dtypes, autocast,
loss scaling and module conversion, never processes: a collective a precision needs is run inside
``Placement.guarded``, which the strategy supplies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.utils.tensors import apply_to_tensors

if TYPE_CHECKING:  # importing FSDP costs; only the FSDP strategy asks for a policy
    from phalanx.utils.compat import MixedPrecisionPolicy


def unguarded(name: str) -> contextlib.AbstractContextManager[None]:
    """The guard of a placement whose precision issues no collective (one process, or replicated gradients)."""
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Placement:
    """Where a precision's modules run, as the strategy sets them up (given once, to ``Precision.configure``)."""

    #: ``"cpu"`` or ``"cuda"``.
    device_type: str = "cpu"
    #: Parameters and gradients are DTensors (FSDP2, tensor parallelism): a check over gradients (a loss
    #: scaler's inf/nan search) is a collective over their mesh.
    sharded: bool = False
    #: ``fully_shard`` is given ``Precision.fsdp_policy()``, so FSDP2 casts parameters and inputs itself and
    #: the precision must not autocast as well.
    fsdp_casts: bool = False
    #: Layers are split across ranks by tensor parallelism (``parallelize_module``).
    tensor_parallel: bool = False
    #: Wraps a collective the precision issues, naming it, so that a rank that never reaches it ends every rank
    #: instead of hanging them (the strategy's lockstep guard). Must pickle: a bound method, not a lambda.
    guarded: Callable[[str], contextlib.AbstractContextManager[None]] = unguarded


class Precision:
    """Full precision in float32 (``"32-true"``), and the base every precision overrides.

    The hooks, in the order a step calls them: ``configure`` (once, by the strategy), ``init_context`` and
    ``convert_module`` (setup), ``convert_input`` + ``forward_context`` + ``convert_output`` (each forward),
    ``pre_backward`` (the loss), ``unscale_gradients`` (before clipping), ``optimizer_step`` and then
    ``after_optimizer_step``; ``state_dict``/``load_state_dict`` travel with checkpoints. ``compute_dtype``,
    ``param_dtype``, ``scales_loss`` and ``fsdp_policy`` are what readers ask instead of the class.
    """

    name: str = "32-true"
    #: The dtype parameters are stored in; None: as created (float32).
    param_dtype: torch.dtype | None = None
    placement: Placement = Placement()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def configure(self, placement: Placement) -> None:
        """Called once by the strategy, before any module is set up: validate here (the device, a package)."""
        self.placement = placement

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the device's matrix multiplications run in (the peak FLOP/s that MFU divides by)."""
        return self.param_dtype if self.param_dtype is not None else torch.float32

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is scaled before backward (so gradients are not true values until unscaled, and a
        step with inf/nan gradients is skipped on purpose)."""
        return False

    def fsdp_policy(self) -> MixedPrecisionPolicy | None:
        """FSDP2's mixed-precision policy for ``fully_shard`` when ``placement.fsdp_casts``; None: none."""
        return None

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.param_dtype is not None:
            module = module.to(dtype=self.param_dtype)
        return module

    @contextlib.contextmanager
    def init_context(self) -> Iterator[None]:
        """Create parameters directly in the target dtype (no float32 copy first)."""
        if self.param_dtype is None:
            yield
            return
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.param_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def convert_input(self, data: Any) -> Any:
        if self.param_dtype is None:
            return data
        dtype = self.param_dtype
        return apply_to_tensors(data, lambda t: t.to(dtype) if torch.is_floating_point(t) else t)

    def convert_output(self, data: Any) -> Any:
        return data

    def pre_backward(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Called before clipping so norms are measured on true gradients."""

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> float | None:
        loss: float | None = optimizer.step(**kwargs)  # the closure's loss, if one was passed
        return loss

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        """Called by the strategy after every optimizer step, on every rank alike (collectives allowed, inside
        ``placement.guarded``): work that depends on the updated weights."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def to_float32(data: Any) -> Any:
    """Floating-point tensors in ``data`` as float32 (outputs handed back from a half-precision forward)."""
    return apply_to_tensors(data, lambda t: t.to(torch.float32) if torch.is_floating_point(t) else t)


__all__ = ["Placement", "Precision", "to_float32", "unguarded"]
