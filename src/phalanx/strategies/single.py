"""One process, one device."""

from __future__ import annotations

from typing import ClassVar

from phalanx.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Runs everything in the current process on one device (CPU or one GPU)."""

    name: ClassVar[str] = "single"
