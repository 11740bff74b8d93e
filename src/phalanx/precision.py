"""Precision plugins: how a module's parameters are stored, how forward runs, how loss is scaled.

A strategy chooses and validates its plugin (see ``Strategy.select_precision``); these classes only
know about dtypes, autocast and loss scaling, never about processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.tensors import apply_to_tensors

PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
# Lightning-compatible short forms, so a port is an import change.
_ALIASES = {
    "32": "32-true", 32: "32-true",
    "64": "64-true", 64: "64-true",
    "16": "16-mixed", 16: "16-mixed",
    "bf16": "bf16-mixed",
    "transformer-engine": "unsupported",
}


def canonical_precision(precision: str | int) -> str:
    name = _ALIASES.get(precision, precision)
    if name not in PRECISIONS:
        raise MisconfigurationError(
            f"Unknown precision {precision!r}. Choose one of {', '.join(map(repr, PRECISIONS))}."
        )
    return str(name)


class Precision:
    """Full precision with the default dtype (float32): nothing to convert, nothing to scale."""

    name = "32-true"
    param_dtype: torch.dtype | None = None

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

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class DoublePrecision(Precision):
    name = "64-true"
    param_dtype = torch.float64


class HalfTruePrecision(Precision):
    """Parameters, inputs and compute all in a half type; outputs come back as float32."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.param_dtype = dtype
        self.name = "bf16-true" if dtype == torch.bfloat16 else "16-true"

    def convert_output(self, data: Any) -> Any:
        return apply_to_tensors(
            data, lambda t: t.to(torch.float32) if torch.is_floating_point(t) else t
        )


class MixedPrecision(Precision):
    """float32 parameters, forward under autocast; ``16-mixed`` adds a ``torch.amp.GradScaler``.

    The one place loss scaling lives, for every strategy whose gradients are tensors or DTensors:
    the loss is scaled before backward, gradients are unscaled at most once per step (clipping does it
    early, the step must not repeat it), a step with inf/nan gradients is skipped, and the scaler's
    state is saved and loaded with the checkpoint."""

    def __init__(self, dtype: torch.dtype, device_type: str) -> None:
        self.dtype = dtype
        self.device_type = device_type
        self.name = "bf16-mixed" if dtype == torch.bfloat16 else "16-mixed"
        self.scaler: torch.amp.GradScaler | None = None
        if dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(device_type)
        self._unscaled: set[int] = set()  # optimizers unscaled since their last step

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def convert_output(self, data: Any) -> Any:
        return apply_to_tensors(
            data, lambda t: t.to(torch.float32) if torch.is_floating_point(t) else t
        )

    def pre_backward(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self._unscale(optimizer)
            self._unscaled.add(id(optimizer))

    def _unscale(self, optimizer: Optimizer) -> None:
        assert self.scaler is not None
        self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> float | None:
        if self.scaler is None:
            return super().optimizer_step(optimizer, **kwargs)
        self.unscale_gradients(optimizer)  # here rather than inside scaler.step, so _unscale runs for it
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self._unscaled.discard(id(optimizer))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def make_precision(name: str, device_type: str) -> Precision:
    """Build the plugin for a canonical precision name on ``device_type``."""
    if name == "32-true":
        return Precision()
    if name == "64-true":
        return DoublePrecision()
    if name == "bf16-true":
        return HalfTruePrecision(torch.bfloat16)
    if name == "16-true":
        return HalfTruePrecision(torch.float16)
    if name == "bf16-mixed":
        if device_type == "cuda" and not torch.cuda.is_bf16_supported():
            raise MisconfigurationError(
                "precision='bf16-mixed' needs a GPU with bfloat16 support (Ampere or newer). "
                "Use precision='16-mixed' on this GPU."
            )
        return MixedPrecision(torch.bfloat16, device_type)
    if name == "16-mixed":
        return MixedPrecision(torch.float16, device_type)
    raise MisconfigurationError(f"Unknown precision {name!r}.")
