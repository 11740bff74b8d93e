"""Opt-in detection of non-finite losses and gradients: ``Fabric(detect_anomaly=True)``.

Why: a NaN or inf that reaches the weights spreads to every rank with the next gradient all-reduce,
and the run keeps going, producing garbage, until someone looks at a plot. With detection on,
``fabric.backward`` stops at the first backward pass that produced a non-finite loss or gradient,
naming the backward call, the rank(s) and the parameter, *before* any optimizer step applies it.

Cost, per ``fabric.backward``: one reduction per gradient tensor and one host sync (on a GPU that
sync stalls the CPU until the backward has finished); on more than one process, one small guarded
all-gather of two flags, so that every rank stops at the same backward call instead of one rank
raising while its peers wait for it in the next collective. The full scan that names the parameter
runs only once something was found.

Mixed precision with a loss scaler (``precision="16-mixed"``): overflowing gradients are part of how
the scaler finds its scale (it skips those steps), so only the loss is checked there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx.utils.errors import PhalanxError

if TYPE_CHECKING:
    from phalanx.strategies.base import Strategy

_HINTS = (
    "Nothing was updated yet: the optimizer has not stepped on these gradients. Typical causes: a learning "
    "rate that is too high (look at the losses before this call), log/sqrt/division of zero or negative "
    "values, overflow in a 16-bit dtype (use bf16, or precision='16-mixed' with its loss scaler), or a bad "
    "batch (check the inputs for nan/inf). To find the operation that produced it, re-run this step under "
    "torch.autograd.detect_anomaly()."
)


class NonFiniteError(PhalanxError, FloatingPointError):
    """A loss or gradient held nan/inf while ``detect_anomaly=True``."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly sharded, DTensor) gradient that lives on this rank."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _describe(tensor: torch.Tensor) -> str:
    t = _local(tensor).detach()
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    return f"{nan} nan and {inf} inf of {t.numel()} values"


class AnomalyDetector:
    """Checks each backward pass of one Fabric; counts backward calls so errors can name the step."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.backward_calls = 0
        self._loss: torch.Tensor | None = None

    @property
    def checks_gradients(self) -> bool:
        # A loss scaler overflows on purpose while it searches for its scale; see the module docstring.
        return getattr(self.strategy.precision, "scaler", None) is None

    def before_backward(self, loss: torch.Tensor) -> None:
        self.backward_calls += 1
        self._loss = loss.detach()

    def after_backward(self, modules: Sequence[nn.Module]) -> None:
        """Raise :class:`NonFiniteError` on every rank if the loss or a gradient was non-finite on any."""
        loss = self._loss
        self._loss = None
        named = self._named_grads(modules) if self.checks_gradients else []
        dev = loss.device if loss is not None else self.strategy.root_device
        true = torch.ones((), dtype=torch.bool, device=dev)
        sums = [_local(g).sum().float().to(dev) for _, g in named]  # grads may live elsewhere (offload)
        ok = torch.stack([
            torch.isfinite(loss).all() if loss is not None else true,
            torch.isfinite(torch.stack(sums)).all() if sums else true,
        ]).tolist()  # the one host sync of the fast path
        loss_bad, grad_bad = not ok[0], not ok[1]
        # A sum can overflow while every element is finite (large fp16 gradients): confirm element-wise.
        bad_params = [(n, g) for n, g in named if grad_bad and not bool(torch.isfinite(_local(g)).all())]
        flags = (loss_bad, bool(bad_params))
        per_rank: list[Any] = [flags]
        if self.strategy.world_size > 1:
            per_rank = self.strategy.all_gather_object(flags, name="detect_anomaly (finite check)")
        if not any(a or b for a, b in per_rank):
            return
        self._raise(loss, per_rank, bad_params)

    def _named_grads(self, modules: Sequence[nn.Module]) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for module in modules:
            prefix = f"{type(module).__name__}." if len(modules) > 1 else ""
            out += [(prefix + n, p.grad) for n, p in module.named_parameters() if p.grad is not None]
        return out

    def _raise(
        self, loss: torch.Tensor | None, per_rank: list[Any], bad_params: list[tuple[str, torch.Tensor]]
    ) -> None:
        multi = len(per_rank) > 1
        loss_ranks = [r for r, (lb, _) in enumerate(per_rank) if lb]
        grad_ranks = [r for r, (_, gb) in enumerate(per_rank) if gb]
        parts = []
        if loss_ranks:
            on = f" on rank(s) {loss_ranks}" if multi else ""
            mine = loss is not None and loss.numel() == 1 and not bool(torch.isfinite(loss))
            value = f" (this rank's loss: {loss.item()})" if mine and loss is not None else ""
            parts.append(f"the loss is non-finite{on}{value}")
        if bad_params:
            name, grad = bad_params[0]
            on = f" on this rank (rank {self.strategy.global_rank})" if multi else ""
            others = [n for n, _ in bad_params[1:6]]
            more = f"; {len(bad_params) - 1} more parameter(s) too: {others}" if others else ""
            parts.append(f"the gradient of parameter {name!r} has {_describe(grad)}{on}{more}")
        elif grad_ranks:
            parts.append(f"gradients are non-finite on rank(s) {grad_ranks} (their errors name which)")
        raise NonFiniteError(
            f"detect_anomaly: non-finite values at backward call #{self.backward_calls}: "
            f"{'; '.join(parts)}. {_HINTS}"
        )
