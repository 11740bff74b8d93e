"""The Trainer's non-finite training loss check: a nan/inf loss never trains the weights silently.

Each optimizer step's losses (the accumulation window's) are checked before anything is built on them:

* **Read at once** where reading costs nothing (the CPU): a non-finite loss stops the run before the
  optimizer steps on it (:func:`check_window`), naming epoch, global step, batch and rank.
* **Read late** on a GPU (and on a CPU under ``PHALANX_DEFER_HOST_READS=1``): a read at every step would
  make the GPU wait for the host at every step. The window's summed loss goes into a device buffer (one
  copy per step); every :data:`ROWS` steps the buffer is copied to the host in the background
  (:class:`phalanx.utils.late_reads.LateRead`) and looked at once it has arrived, a step or two later,
  so the run stops within about ``ROWS + 2`` steps of the non-finite loss, naming it. Where the optimizer
  takes torch's ``found_inf`` (the fused implementations: ``Adam(fused=True)``, ``AdamW``, ``SGD``,
  ``Adagrad``), the non-finite step is skipped on the device, as GradScaler skips one, so the weights
  never take it; other optimizers apply the steps until the check stops the run. Either way nothing
  persists them: a checkpoint, a validation run and the end of an epoch first read every pending loss
  (:meth:`LossCheck.flush`), and ``callbacks.Snapshot`` removes its snapshots when the run stops this way.

A loss scaler (``16-mixed``) changes nothing here: the loss is computed before any scaling, so a
non-finite loss is the forward pass or the data, and letting the scaler skip the step (and halve its
scale, again at every recurrence) would hide it.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from phalanx.fabric.anomaly import NonFiniteError
from phalanx.utils.late_reads import LateRead, defers_host_reads

#: Steps whose losses are copied to the host together (at most; fewer with a smaller ``log_every_n_steps``).
ROWS = 16

_CAUSES = (
    "Typical causes: a learning rate that is too high (look at the losses before this batch), log/sqrt/division "
    "of zero or negative values, a bad batch (check its inputs for nan/inf), overflow in a 16-bit dtype. If the "
    "weights are already non-finite, an earlier gradient was, under a finite loss: Trainer(detect_anomaly=True) "
    "stops at that backward and names the parameter; torch.autograd.detect_anomaly() names the operation."
)


def check_window(losses: list[tuple[int, torch.Tensor]], epoch: int, step: int, rank: int | None) -> None:
    """Read the window's losses now (``(batch_idx, loss)``, one read) and raise before the optimizer steps if
    one is nan/inf."""
    if len(losses) == 1:
        value = losses[0][1].item()
        if math.isfinite(value):  # the common case: one loss, finite
            return
        values = [value]
    else:
        values = torch.stack([v.detach().reshape(()) for _, v in losses]).tolist()
    bad = [(batch_idx, value) for (batch_idx, _), value in zip(losses, values) if not math.isfinite(value)]
    if not bad:
        return
    batch_idx, value = bad[0]
    where = f" on rank {rank}" if rank is not None else ""
    more = f" ({len(bad)} of the window's {len(losses)} micro-batches)" if len(losses) > 1 else ""
    raise NonFiniteError(
        f"The training loss is {value} at epoch {epoch}, global step {step}, batch {batch_idx}{where}{more}. The run "
        f"stops here, before the optimizer steps on it (the weights are those after step {step}). {_CAUSES}"
    )


class LossCheck:
    """One fit's check (see the module docstring). ``rank``: named in the error when the job has several."""

    def __init__(self, device: torch.device, rows: int, rank: int | None) -> None:
        self.late = defers_host_reads(device)
        self._device, self._rows, self._rank = device, max(1, min(ROWS, rows)), rank
        self._buffer: torch.Tensor | None = None
        self._where: list[tuple[int, int, int, int]] = []  # per row: epoch, global step, last batch, window size
        self._sent: list[tuple[LateRead, list[tuple[int, int, int, int]]]] = []
        self._lent: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers holding a found_inf of this check

    def window(self, losses: list[tuple[int, torch.Tensor]], epoch: int, step: int, optimizer: Any) -> None:
        """The window's losses, before the optimizer step that ends it (which would be the ``step + 1``-th)."""
        if not self.late:
            check_window(losses, epoch, step, self._rank)
            return
        self.poll()
        total = losses[0][1].detach() if len(losses) == 1 else \
            torch.stack([v.detach().reshape(()) for _, v in losses]).sum()
        if self._buffer is None:
            self._buffer = torch.empty(self._rows, dtype=torch.float64, device=self._device)
        row = len(self._where)
        self._buffer[row].copy_(total.reshape(()))
        self._where.append((epoch, step + 1, losses[-1][0], len(losses)))
        if getattr(optimizer, "_step_supports_amp_scaling", False) and not hasattr(optimizer, "found_inf"):
            # torch's skip-on-device protocol (what GradScaler uses): the fused kernels leave the weights and
            # the step count alone where found_inf is nonzero. Removed again by :meth:`stepped`.
            optimizer.found_inf = (~torch.isfinite(self._buffer[row])).float()
            optimizer.grad_scale = None
            self._lent.add(optimizer)
        if row + 1 == self._rows:
            self._send()

    def stepped(self, optimizer: Any) -> None:
        """After the optimizer step: take back what :meth:`window` lent it (unless GradScaler replaced it)."""
        if optimizer in self._lent:
            self._lent.discard(optimizer)
            for name in ("found_inf", "grad_scale"):
                if hasattr(optimizer, name):
                    delattr(optimizer, name)

    def _send(self) -> None:
        if self._buffer is None or not self._where:
            return
        self._sent.append((LateRead(self._buffer[:len(self._where)]), self._where))
        self._buffer, self._where = None, []

    def poll(self) -> None:
        """Look at the losses that have arrived on the host (no wait); raise at the first non-finite one."""
        while self._sent and self._sent[0][0].ready():
            self._look(*self._sent.pop(0))

    def flush(self) -> None:
        """Read every loss not looked at yet, waiting for them (a checkpoint, a validation run, an epoch's end)."""
        if not self.late:
            return
        self._send()
        while self._sent:
            self._look(*self._sent.pop(0))

    def _look(self, read: LateRead, where: list[tuple[int, int, int, int]]) -> None:
        for value, (epoch, step, batch_idx, size) in zip(read.values(), where):
            if math.isfinite(value):
                continue
            self._sent.clear()
            on = f" on rank {self._rank}" if self._rank is not None else ""
            window = f" (an accumulation window of {size} micro-batches ending at batch {batch_idx})" if size > 1 \
                else f" (batch {batch_idx})"
            raise NonFiniteError(
                f"The training loss was {value} at epoch {epoch}, global step {step}{window}{on}. Losses are read "
                "a few steps late, so that the device never waits for them: the run stops at the first check after "
                f"it. Where the optimizer skips on found_inf (fused Adam/AdamW/SGD/Adagrad) the weights never took "
                f"that step; others took it and the steps after it. No checkpoint or snapshot holds them. {_CAUSES}"
            )
