"""``"bf16-mixed"`` and ``"16-mixed"``: float32 parameters, compute in a half type.

How the half type is reached depends on the placement: autocast by default; under FSDP2
(``placement.fsdp_casts``) FSDP casts parameters and inputs itself through :meth:`MixedPrecision.fsdp_policy`
and there is no autocast (units all-gather in the half type, gradients are reduced in float32).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from phalanx.precision.base import Placement, Precision, to_float32
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.utils.compat import MixedPrecisionPolicy

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class MixedPrecision(Precision):
    """float32 parameters, forward in ``bfloat16`` or ``float16``; ``16-mixed`` adds a ``torch.amp.GradScaler``.

    The one place loss scaling lives, for every strategy whose gradients are tensors or DTensors: the loss is
    scaled before backward, gradients are unscaled at most once per step (clipping does it early, the step
    must not repeat it), a step with inf/nan gradients is skipped, and the scaler's state is saved and loaded
    with the checkpoint. On sharded (DTensor) gradients torch all-reduces the scaler's found-inf flag over the
    mesh, so an overflow in one rank's shard skips the step on every rank; that all-reduce runs inside
    ``placement.guarded``, so a rank that never steps makes the others raise, naming it."""

    def __init__(self, precision: str = "bf16-mixed") -> None:
        if precision not in _DTYPES:
            raise MisconfigurationError(
                f"MixedPrecision(precision={precision!r}): choose 'bf16-mixed' or '16-mixed'."
            )
        self.name = precision
        self.dtype = _DTYPES[precision]
        self.scaler: torch.amp.GradScaler | None = None
        self._unscaled: set[int] = set()  # optimizers unscaled since their last step

    def configure(self, placement: Placement) -> None:
        if self.dtype == torch.bfloat16 and placement.device_type == "cuda" and not torch.cuda.is_bf16_supported():
            raise MisconfigurationError(
                f"precision={self.name!r} needs a GPU with bfloat16 support (Ampere or newer). "
                "Use precision='16-mixed' on this GPU."
            )
        super().configure(placement)
        # A strategy configures its precision once, at the start of a run: the scaler starts afresh there too.
        self.scaler = torch.amp.GradScaler(placement.device_type) if self.dtype == torch.float16 else None
        self._unscaled.clear()

    @property
    def device_type(self) -> str:
        return self.placement.device_type

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def scales_loss(self) -> bool:
        return self.scaler is not None

    def fsdp_policy(self) -> MixedPrecisionPolicy | None:
        if not self.placement.fsdp_casts:
            return None
        from phalanx.utils.compat import MixedPrecisionPolicy  # FSDP is imported by then

        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.placement.fsdp_casts:
            return contextlib.nullcontext()
        return torch.autocast(self.placement.device_type, dtype=self.dtype)

    def convert_output(self, data: Any) -> Any:
        return to_float32(data)

    def pre_backward(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            with self.placement.guarded("loss scaler (inf/nan in any gradient shard)"):
                self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> float | None:
        if self.scaler is None:
            return super().optimizer_step(optimizer, **kwargs)
        self.unscale_gradients(optimizer)  # here rather than inside scaler.step, so the guard covers it
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self._unscaled.discard(id(optimizer))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


__all__ = ["MixedPrecision"]
