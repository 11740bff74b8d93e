"""Non-finite losses and gradients: the opt-in check that stops, ``Fabric(detect_anomaly=True)``, and the
default warning for a nan/inf loss (:class:`LossWatch`, at the end).

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

import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx.utils.errors import PhalanxError, PhalanxWarning
from phalanx.utils.late_reads import LateRead, defers_host_reads

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
        return not self.strategy.precision.scales_loss

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


#: Backward calls whose losses are checked together (see :class:`LossWatch`).
LOSS_CHECK_EVERY = 4
#: Set to 0 to turn the default non-finite loss warning off without touching the code.
LOSS_WATCH_VARIABLE = "PHALANX_WARN_NONFINITE_LOSS"


class LossWatch:
    """On by default (``Fabric(warn_nonfinite_loss=True)``): a nan/inf loss is never silent.

    Without it, a non-finite loss trains the weights to nan with no message and exit code 0. A scalar loss
    on the CPU is checked at once (reading a CPU value costs a fraction of a microsecond and waits for
    nothing). Elsewhere (a GPU; a CPU under ``PHALANX_DEFER_HOST_READS=1``), each ``fabric.backward`` only
    keeps a detached reference to its loss: no device work and no sync on the per-step path. Every ``every``
    calls the kept losses are stacked and copied to the host in the background
    (:class:`phalanx.utils.late_reads.LateRead`), and looked at once they have arrived, so the training loop
    never waits for the GPU; a nan is reported within about ``2 * every`` steps. The first non-finite loss is
    reported once, as a warning naming this rank and the backward call (counted from 1); whatever is pending
    is checked when the Fabric tears down. ``Fabric(detect_anomaly=True)`` replaces this with a check that
    stops the run.
    """

    def __init__(self, rank: Callable[[], int], every: int = LOSS_CHECK_EVERY) -> None:
        self._rank = rank
        self._every = every
        self._losses: list[torch.Tensor] = []
        self.calls = 0
        self._inflight: list[tuple[LateRead, int]] = []  # (the losses on their way, first call number)
        self.reported = False

    def record(self, loss: torch.Tensor) -> None:
        """The per-step part (see the class docstring)."""
        self.calls += 1
        if self.reported:
            return
        if type(loss) is torch.Tensor and loss.numel() == 1 and not defers_host_reads(loss.device):
            if not math.isfinite(loss.item()):
                self._report([self.calls], self.calls, self.calls)
            return
        losses = self._losses
        losses.append(loss.detach())
        if len(losses) >= self._every:
            self._launch()
            self._poll(block=False)

    def flush(self) -> None:
        """Check everything still pending, waiting for the device (teardown)."""
        if self._losses and not self.reported:
            self._launch()
        self._poll(block=True)

    def _launch(self) -> None:
        losses, self._losses = self._losses, []
        first = self.calls - len(losses) + 1
        # One value per loss that is non-finite exactly when the loss is: the loss itself, or for a loss with
        # several elements log(all finite) (0 or -inf; a sum could overflow where every element is finite).
        values = [
            _local(t).reshape(()).float() if t.numel() == 1 else torch.isfinite(_local(t)).all().float().log()
            for t in losses
        ]
        device = values[0].device
        self._inflight.append((LateRead(torch.stack([v.to(device) for v in values])), first))

    def _poll(self, block: bool) -> None:
        while self._inflight and not self.reported:
            read, first = self._inflight[0]
            if not block and not read.ready():
                return
            self._inflight.pop(0)
            values = read.values()
            bad = [first + i for i, value in enumerate(values) if not math.isfinite(value)]
            if bad:
                self._report(bad, first, first + len(values) - 1)
        if self.reported:
            self._inflight.clear()
            self._losses.clear()

    def _report(self, bad: list[int], first: int, last: int) -> None:
        self.reported = True
        others = f" ({len(bad)} of backward calls #{first}-#{last} were non-finite)" if len(bad) > 1 else ""
        rank = self._rank()
        warnings.warn(
            f"rank {rank}: the loss passed to fabric.backward is nan/inf at backward call #{bad[0]}{others}. Optimizer "
            "steps on its gradients turn the weights into nan; the run goes on but is no longer training. "
            f"{_HINTS.split('. ', 1)[1]} Fabric(detect_anomaly=True) stops at the first such backward and names the "
            f"parameter. This is reported once per Fabric; to turn it off pass Fabric(warn_nonfinite_loss=False) or "
            f"set {LOSS_WATCH_VARIABLE}=0.",
            PhalanxWarning,
            stacklevel=_outside_phalanx(),
        )


def _outside_phalanx() -> int:
    """The ``stacklevel`` of the first caller outside phalanx (the user's ``fabric.backward`` line)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame = frame.f_back
        level += 1
    return level
