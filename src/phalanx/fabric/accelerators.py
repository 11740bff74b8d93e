"""Lightning's accelerator classes, for code that asks them questions (``CUDAAccelerator.auto_device_count()``)
or passes one as ``Fabric(accelerator=CUDAAccelerator())``. phalanx itself only needs the device type, so
these are small: each names its device type and answers availability and device counts."""

from __future__ import annotations

from typing import ClassVar

import torch

from phalanx.distributed.accelerator import resolve_devices


class Accelerator:
    """Base class; ``Fabric(accelerator=obj)`` uses ``obj.name`` (``"cpu"`` or ``"cuda"``)."""

    name: ClassVar[str] = "cpu"

    @staticmethod
    def is_available() -> bool:
        raise NotImplementedError

    @staticmethod
    def auto_device_count() -> int:
        raise NotImplementedError

    @classmethod
    def get_device_type(cls) -> str:
        return cls.name

    @classmethod
    def parse_devices(cls, devices: int | str) -> int:
        """``devices=`` as Fabric reads it for this accelerator: a count of processes per node."""
        return resolve_devices(devices, cls.name)

    @classmethod
    def get_parallel_devices(cls, devices: int | str) -> list[torch.device]:
        count = cls.parse_devices(devices)
        return [torch.device(cls.name, i) if cls.name != "cpu" else torch.device("cpu") for i in range(count)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CPUAccelerator(Accelerator):
    name: ClassVar[str] = "cpu"

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def auto_device_count() -> int:
        return 1


class CUDAAccelerator(Accelerator):
    name: ClassVar[str] = "cuda"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def auto_device_count() -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0


def accelerator_name(accelerator: str | Accelerator) -> str:
    """An :class:`Accelerator` object -> its name; anything else unchanged (Fabric validates strings)."""
    return accelerator.name if isinstance(accelerator, Accelerator) else accelerator
