"""Reading device values on the host without making the accelerator wait.

A host read of a value that lives on a GPU (``tensor.item()``, ``float(tensor)``, ``.tolist()``, ``.cpu()``)
blocks the CPU until the GPU has computed it: every kernel queued before it runs out, and the GPU idles
while the CPU queues the next step's kernels. A training step that reads one value per step pays that
bubble every step. So the values phalanx checks or shows during training (the non-finite loss check, the
progress bar, the preemption and snapshot agreements) are read *late*: a :class:`LateRead` copies them to
pinned host memory on the device's stream and records an event; :meth:`LateRead.ready` asks the event
(no wait) and :meth:`LateRead.values` reads the host copy, waiting only for that copy. Read a step or more
after it was taken, that wait never empties the device's queue: the later steps are already queued.

On a CPU a read waits for nothing, so phalanx reads CPU values at once. ``PHALANX_DEFER_HOST_READS=1``
makes that code take the late path on a CPU too, which is how the test suite proves, on a machine without
a GPU, that a steady-state step makes no host read (tests/support/host_reads.py counts them).
"""

from __future__ import annotations

import os
from typing import Any

import torch

#: Set to 1 to read CPU values late too, as on a GPU (for tests that count host reads).
DEFER_VARIABLE = "PHALANX_DEFER_HOST_READS"


def defers_host_reads(device: torch.device) -> bool:
    """Whether values on ``device`` are read late (a GPU; a CPU under ``PHALANX_DEFER_HOST_READS=1``)."""
    return device.type != "cpu" or os.environ.get(DEFER_VARIABLE, "0") == "1"


def on_device(values: list[int] | list[float], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as a tensor on ``device``, without a host wait (a copy from pageable memory would
    synchronize the device's stream: this one is from pinned memory, which the copy keeps alive)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class LateRead:
    """A device tensor on its way to the host: started at construction, read with :meth:`values`.

    ``work``: the asynchronous collective that produces ``tensor`` (its result is only valid after it).
    On a GPU the copy is queued on the current stream after ``work`` (no host wait); on a CPU the host
    copy is the tensor itself once ``work`` completed.
    """

    __slots__ = ("_event", "_host", "_tensor", "_work")

    def __init__(self, tensor: torch.Tensor, work: Any = None) -> None:
        self._work = work
        self._tensor: torch.Tensor | None = tensor
        self._host: torch.Tensor | None = None
        self._event: Any = None
        if tensor.device.type == "cuda":
            if work is not None:
                work.wait()  # NCCL: the current stream waits for the collective, the host does not
                self._work = None
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor.detach(), non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._host, self._tensor = host, None

    def ready(self) -> bool:
        """Whether :meth:`values` would return without waiting."""
        if self._event is not None:
            return bool(self._event.query())
        return self._work is None or bool(self._work.is_completed())

    def tensor(self) -> torch.Tensor:
        """The host copy (waits for the copy, or the collective, if not :meth:`ready`)."""
        if self._host is None:
            if self._work is not None:
                self._work.wait()
                self._work = None
            assert self._tensor is not None
            self._host, self._tensor = self._tensor.detach(), None
        elif self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host

    def values(self) -> list[Any]:
        """The values as Python numbers, flattened."""
        out: list[Any] = self.tensor().reshape(-1).tolist()
        return out
