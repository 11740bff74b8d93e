"""``LitLogger``: Lightning's logger for the Lightning.ai cloud. phalanx uploads nothing, so the name imports
(a program that only mentions it starts) and constructing it says which logger to use instead."""

from __future__ import annotations

from typing import Any

from phalanx.utils.errors import MisconfigurationError


class LitLogger:
    """Refused at construction (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise MisconfigurationError(
            "LitLogger (Lightning.ai's hosted experiment tracking) is not available in phalanx: phalanx uploads "
            "nothing. Use CSVLogger or TensorBoardLogger (local files), or WandbLogger / MLFlowLogger for a tracking "
            "server, all from phalanx.loggers (e.g. CSVLogger(root_dir='logs'))."
        )
