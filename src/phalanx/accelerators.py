"""``lightning.fabric.accelerators`` names, for users (a facade: the code is phalanx.fabric.accelerators)."""

from phalanx.fabric.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator

__all__ = ["Accelerator", "CPUAccelerator", "CUDAAccelerator"]
