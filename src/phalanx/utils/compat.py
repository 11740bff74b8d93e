"""torch APIs that moved between the torch versions phalanx supports (>= 2.5), imported in one place:
without it, a move breaks ``strategy="fsdp"`` at import on one end of the range (scripts/torch_matrix.sh
runs the suite on both ends)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
else:
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.5 kept FSDP2 under _composable (public in torch.distributed.fsdp from 2.6)
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

#: FSDP2 on CPU (gloo): torch 2.5's fully_shard needs CUDA streams, 2.6's calls record_event on the CPU
#: stream stub, which has it from torch 2.7 on.
FSDP_ON_CPU = hasattr(torch.cpu.Stream, "record_event")

__all__ = ["FSDP_ON_CPU", "CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "fully_shard"]
