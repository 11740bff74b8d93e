"""Resolving ``accelerator=`` and ``devices=`` into a device type and a process count per node."""

from __future__ import annotations

import torch

from phalanx.utils.errors import MisconfigurationError

ACCELERATORS = ("auto", "cpu", "cuda", "gpu")


def resolve_accelerator(accelerator: str) -> str:
    """Map the user's string to ``"cpu"`` or ``"cuda"``."""
    if not isinstance(accelerator, str) or accelerator.lower() not in ACCELERATORS:
        raise MisconfigurationError(
            f"Unknown accelerator {accelerator!r}. Choose one of {', '.join(map(repr, ACCELERATORS))}."
        )
    accelerator = accelerator.lower()
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator in ("cuda", "gpu"):
        if not torch.cuda.is_available():
            raise MisconfigurationError(
                f"accelerator={accelerator!r} was requested but no CUDA device is available "
                f"(torch {torch.__version__}, cuda build: {torch.version.cuda is not None}). "
                "Use accelerator='cpu' or 'auto', or install a CUDA build of torch."
            )
        return "cuda"
    return "cpu"


def resolve_devices(devices: int | str, device_type: str) -> int:
    """Number of processes (devices) per node."""
    if isinstance(devices, str):
        if devices == "auto":
            return torch.cuda.device_count() if device_type == "cuda" else 1
        if devices.strip().lstrip("-").isdigit():
            devices = int(devices)
        else:
            raise MisconfigurationError(
                f"devices={devices!r} is not understood. Pass a positive integer or 'auto'."
            )
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise MisconfigurationError(f"devices must be a positive integer or 'auto', got {devices!r}.")
    if device_type == "cuda":
        available = torch.cuda.device_count()
        if devices > available:
            raise MisconfigurationError(
                f"devices={devices} but only {available} CUDA device(s) are visible on this node. "
                f"Pass devices<={available} (or devices='auto')."
            )
    return devices
