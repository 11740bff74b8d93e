"""The ``phalanx`` command line: ``phalanx run`` (the launcher), ``phalanx fit|validate|test|predict``
and ``LightningCLI`` (``config``), and the checkpoint commands (``ckpt``: ``phalanx ckpt inspect|convert``
and ``phalanx consolidate``)."""

from __future__ import annotations

from typing import Any

from phalanx.cli.commands import main

__all__ = ["LightningCLI", "SaveConfigCallback", "main"]


def __getattr__(name: str) -> Any:
    # jsonargparse is an extra: LightningCLI's module is imported when the name is first used.
    if name in ("LightningCLI", "SaveConfigCallback", "instantiate_class"):
        from phalanx.cli import config

        return getattr(config, name)
    raise AttributeError(f"module 'phalanx.cli' has no attribute {name!r}")
