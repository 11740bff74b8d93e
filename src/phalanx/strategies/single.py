"""One process, one device: the strategy of ``devices=1``, so a script written against Fabric runs
unchanged without a process group (every collective is the identity, nothing is wrapped)."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from phalanx.strategies._transforms import check_compile, check_policy
from phalanx.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Runs everything in the current process on one device (CPU or one GPU).

    Args:
        activation_checkpointing_policy: set of module classes whose activations are recomputed in
            backward instead of stored.
        compile: ``True`` or a dict of ``torch.compile`` arguments: compile the module in place at setup.
    """

    name: ClassVar[str] = "single"

    def __init__(
        self,
        *,
        activation_checkpointing_policy: set[type[nn.Module]] | None = None,
        compile: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__()
        self.activation_checkpointing_policy = check_policy(activation_checkpointing_policy)
        self.compile_options = check_compile(compile)
