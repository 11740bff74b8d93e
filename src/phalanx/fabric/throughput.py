"""Throughput and model FLOPs utilisation, over a window of recent updates (Lightning's names).

``measure_flops(model, forward_fn, loss_fn=None)`` counts the floating-point operations of one
forward (and backward, with ``loss_fn``) with ``torch.utils.flop_counter``; it works on a model on the
meta device, so a large model can be measured without memory. ``ThroughputMonitor(fabric)`` turns
cumulative counters (elapsed time, batches, samples, items) and per-update FLOPs into rates over the
last ``window_size`` updates and logs them through ``fabric.log_dict``.

Metrics (``/`` is the ``separator``): ``time``, ``batches``, ``samples`` (and ``lengths``) are the
totals of the last update; ``device/batches_per_sec``, ``device/samples_per_sec``,
``device/items_per_sec`` (with ``lengths``), ``device/flops_per_sec`` (with ``flops``) and
``device/mfu`` (when the device's peak FLOPs are known) are this device's rates over the window; with
more than one device, ``batches_per_sec``, ``samples_per_sec``, ``items_per_sec`` and
``flops_per_sec`` are those rates times the world size. Rates appear once ``window_size`` updates were
made. On a GPU, synchronise before reading the clock you pass as ``time``, or it measures launches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from phalanx.fabric.fabric import Fabric

# Peak dense tensor-core FLOP/s per GPU from the vendors' data sheets (no sparsity), by dtype (the precision's
# compute_dtype). "tf32" is used for float32 when torch.get_float32_matmul_precision() allows TF32.
_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h200": {"float64": 67e12, "float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12,
             "float8_e4m3fn": 1978.9e12},
    "h100 pcie": {"float64": 51e12, "float32": 51e12, "tf32": 378e12, "bfloat16": 756e12, "float16": 756e12,
                  "float8_e4m3fn": 1513e12},
    "h100": {"float64": 67e12, "float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12,
             "float8_e4m3fn": 1978.9e12},
    "a100": {"float64": 19.5e12, "float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
    "l4": {"float32": 30.3e12, "tf32": 60e12, "bfloat16": 121e12, "float16": 121e12, "float8_e4m3fn": 242.5e12},
    "v100": {"float64": 7.8e12, "float32": 15.7e12, "float16": 125e12},
    "t4": {"float32": 8.1e12, "float16": 65e12},
}


def get_available_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of one ``device`` computing in ``dtype``; None where unknown (CPUs, unlisted GPUs)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    gpu = torch.cuda.get_device_name(device).lower()
    key = str(dtype).removeprefix("torch.")
    if key == "float32" and torch.get_float32_matmul_precision() != "highest":
        key = "tf32"
    for name, table in _PEAK_FLOPS.items():  # most specific names first
        if name in gpu:
            return table.get(key)
    return None


def measure_flops(
    model: nn.Module,
    forward_fn: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """FLOPs of ``forward_fn()`` and, with ``loss_fn``, of ``loss_fn(output).backward()`` too. ``model`` is the
    module ``forward_fn`` runs (kept for Lightning's signature; the count covers everything the calls do)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        output = forward_fn()
        if loss_fn is not None:
            loss_fn(output).backward()
    return int(counter.get_total_flops())


class Throughput:
    """Rates over the last ``window_size`` calls of :meth:`update` (see the module docstring).

    Args:
        available_flops: peak FLOP/s of one device (for ``mfu``); None leaves MFU out.
        world_size: devices in the job; above 1, job-wide rates are added.
        window_size: how many updates the rates span (at least 2).
        separator: between ``device`` and the metric name.
    """

    def __init__(
        self, available_flops: float | None = None, world_size: int = 1, window_size: int = 100, separator: str = "/"
    ) -> None:
        if window_size < 2:
            raise ValueError(f"window_size must be at least 2 (a rate needs two updates), got {window_size}.")
        self.available_flops = available_flops
        self.world_size = world_size
        self.separator = separator
        self._time: deque[float] = deque(maxlen=window_size)
        self._batches: deque[int] = deque(maxlen=window_size)
        self._samples: deque[int] = deque(maxlen=window_size)
        self._lengths: deque[int] = deque(maxlen=window_size)
        self._flops: deque[float] = deque(maxlen=window_size)

    def update(
        self, *, time: float, batches: int, samples: int, lengths: int | None = None, flops: float | None = None
    ) -> None:
        """Record totals so far on this device: ``time`` (seconds since the start), ``batches``, ``samples`` and
        ``lengths`` (items, e.g. tokens) seen, each non-decreasing; ``flops``: FLOPs done since the previous
        update (e.g. ``measure_flops(...)`` times the batches since then)."""
        if self._time:
            for what, new, old in (("time", time, self._time[-1]), ("batches", batches, self._batches[-1]),
                                   ("samples", samples, self._samples[-1])):
                if new < old:
                    raise ValueError(f"Throughput.update: {what} must not decrease (it is a running total), "
                                     f"got {new} after {old}.")
            if (lengths is None) != (not self._lengths):
                raise ValueError("Throughput.update: pass lengths= in every update or in none.")
        if lengths is not None and lengths < samples:
            raise ValueError(f"Throughput.update: lengths ({lengths}) counts items of the samples, so it cannot be "
                             f"smaller than samples ({samples}).")
        self._time.append(float(time))
        self._batches.append(int(batches))
        self._samples.append(int(samples))
        if lengths is not None:
            self._lengths.append(int(lengths))
        if flops is not None:
            self._flops.append(float(flops))

    def compute(self) -> dict[str, float | int]:
        """The metrics of the module docstring (empty before the first update)."""
        if not self._time:
            return {}
        sep = self.separator
        metrics: dict[str, float | int] = {
            "time": self._time[-1], "batches": self._batches[-1], "samples": self._samples[-1],
        }
        if self._lengths:
            metrics["lengths"] = self._lengths[-1]
        if len(self._time) < (self._time.maxlen or 0):
            return metrics
        elapsed = self._time[-1] - self._time[0]
        if elapsed <= 0:
            return metrics
        rates = {
            "batches_per_sec": (self._batches[-1] - self._batches[0]) / elapsed,
            "samples_per_sec": (self._samples[-1] - self._samples[0]) / elapsed,
        }
        if len(self._lengths) == len(self._time):
            rates["items_per_sec"] = (self._lengths[-1] - self._lengths[0]) / elapsed
        if len(self._flops) == len(self._time):
            # Each entry counts the FLOPs since the update before it: the first one precedes the window.
            rates["flops_per_sec"] = sum(list(self._flops)[1:]) / elapsed
        for name, value in rates.items():
            metrics[f"device{sep}{name}"] = value
            if self.world_size > 1:
                metrics[name] = value * self.world_size
        if "flops_per_sec" in rates and self.available_flops:
            metrics[f"device{sep}mfu"] = rates["flops_per_sec"] / self.available_flops
        return metrics

    def reset(self) -> None:
        for window in (self._time, self._batches, self._samples, self._lengths, self._flops):
            window.clear()


def peak_flops(fabric: Fabric) -> float | None:
    """Peak FLOP/s of one of the Fabric's devices in its precision's compute dtype (what MFU divides by)."""
    return get_available_flops(fabric.device, fabric.strategy.precision.compute_dtype)


class ThroughputMonitor(Throughput):
    """:class:`Throughput` for a Fabric: world size and peak FLOPs (for MFU) from its device and precision,
    metrics logged with ``compute_and_log`` through ``fabric.log_dict`` (on rank 0, as every Fabric log)."""

    def __init__(self, fabric: Fabric, **kwargs: Any) -> None:
        kwargs.setdefault("available_flops", peak_flops(fabric))
        super().__init__(world_size=fabric.world_size, **kwargs)
        self._fabric = fabric
        self.step = -1

    def compute_and_log(self, step: int | None = None, **kwargs: Any) -> dict[str, float | int]:
        """``compute()``, then log the metrics at ``step`` (default: one more than the last logged step)."""
        self.step = self.step + 1 if step is None else step
        metrics = self.compute()
        self._fabric.log_dict(metrics=metrics, step=self.step, **kwargs)
        return metrics
