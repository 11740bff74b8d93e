"""The bottom layer: helpers every other layer may use, with no process state and no phalanx imports above.

``errors`` (the exceptions), ``diagnostics`` (how phalanx speaks outside exceptions), ``seed`` (RNG
capture), ``compat`` (torch APIs that moved between supported versions), ``tensors`` (nested tensor
helpers), ``exiting`` (leaving without the final garbage collection). See docs/architecture.md for the layers.
"""

from phalanx.utils.tensors import apply_to_tensors, move_to_device, optional_module

__all__ = ["apply_to_tensors", "move_to_device", "optional_module"]
