"""Materializing a sharded meta-device model with the values one process would give it.

``fabric.init_module(empty_init=True)`` under FSDP or ModelParallelStrategy creates the model on the meta
device; ``setup`` shards it (every parameter becomes a DTensor without storage) and then initializes it.
Drawing each rank's shard on its own cannot give single-process values: torch has no DTensor
random-number tracker on CPU meshes, so every rank fills its rows with the same numbers (repeated rows),
and separate per-rank streams give numbers no single process draws. Either way an N-rank run starts from
different weights than the same script on one process, and parameters that no checkpoint overwrites
(LoRA's ``lora_A``) train differently.

So each module that owns parameters or buffers is initialized whole, in ``named_modules()`` order, from
the random state every rank shares after ``seed_everything``: its sharded parameters are swapped for
full-size temporaries, its ``reset_parameters()`` fills them (the same draws on every rank, the draws a
single process makes when it materializes the same meta model with :func:`phalanx.utils.init.
materialize_meta_tensors`), and each rank keeps its own slice. Extra memory is one module's full
parameters at a time, as FSDP1 and torchtitan initialize unit by unit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from phalanx.utils.errors import MisconfigurationError


def owners(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules holding parameters or buffers of their own, in ``named_modules()`` order; each must
    define ``reset_parameters()`` (refused by name otherwise, before anything is allocated)."""
    found = [
        (name or type(m).__name__, m) for name, m in module.named_modules()
        if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False))
    ]
    missing = [name for name, m in found if not callable(getattr(m, "reset_parameters", None))]
    if missing:
        raise MisconfigurationError(
            f"Modules {missing} were created with empty_init=True but define no reset_parameters(), so "
            "phalanx cannot initialize their shards. Add a reset_parameters() that fills their parameters "
            "and buffers, or create the model with empty_init=False."
        )
    return found


def materialize_sharded(module: nn.Module, device: torch.device) -> None:
    """Allocate ``module``'s (sharded) meta tensors on ``device`` and initialize them with the values a
    single process would draw from the current random state (see the module docstring). Every rank must
    start from the same random state (``seed_everything``); nothing is communicated."""
    found = owners(module)
    module.to_empty(device=device)  # on the root: FSDP2 allocates each shard's padded storage
    with torch.no_grad():
        for _, owner in found:
            with _full_size(owner, device):
                owner.reset_parameters()  # type: ignore[operator]


@contextmanager
def _full_size(owner: nn.Module, device: torch.device) -> Iterator[None]:
    """While active, ``owner``'s own DTensor parameters and buffers are full-size plain tensors on
    ``device``; on exit each DTensor takes its slice of what was written there and is put back."""
    swapped: list[tuple[dict[str, torch.Tensor | None], str, DTensor, torch.Tensor]] = []
    tables: list[dict[str, torch.Tensor | None]] = [owner._parameters, owner._buffers]  # type: ignore[list-item]
    for table in tables:
        for name, tensor in list(table.items()):
            if not isinstance(tensor, DTensor):
                continue  # plain tensors (buffers, unsharded parameters) are written in place, as on one process
            full = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            stand_in = nn.Parameter(full, requires_grad=tensor.requires_grad) if table is owner._parameters else full
            swapped.append((table, name, tensor, full))
            table[name] = stand_in
    try:
        yield
    finally:
        for table, name, tensor, full in swapped:
            table[name] = tensor
            tensor.to_local().copy_(_local_slice(full, tensor))


def _local_slice(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` laid out as ``like``: replicated on its mesh, then redistributed to
    its placements (from a replica, every shard placement is a local slice: no communication)."""
    mesh = like.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements).to_local()


__all__ = ["materialize_sharded", "owners"]
