"""``FabricConfig``: what a ``Fabric`` was asked for, typed and frozen, each default written here once.

``Fabric(...)`` keeps Lightning's keyword arguments (their defaults are this class's), checks and normalises
them into one FabricConfig and keeps it as ``fabric.config``. Two readers need the arguments after the
constructor: the connector, which turns them into a configured strategy and tells a script whose argument
``phalanx run``'s flags override that it differs from the default, and the launcher, which builds the same
Fabric in every process it starts (:meth:`FabricConfig.arguments`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.strategies import Strategy


@dataclass(frozen=True)
class FabricConfig:
    """The arguments of :class:`phalanx.Fabric` (documented there) after their checks: ``accelerator`` is a
    name, ``loggers`` and ``callbacks`` are tuples, ``precision`` None is the default, ``max_restarts`` is
    checked, ``root_dir`` a Path."""

    accelerator: str = "auto"
    devices: int | str = "auto"
    num_nodes: int = 1
    strategy: str | Strategy = "auto"
    precision: str | int = "32-true"
    loggers: tuple[Any, ...] = ()
    callbacks: tuple[Any, ...] = ()
    lockstep: str | None = None
    detect_anomaly: bool = False
    warn_nonfinite_loss: bool = True
    max_restarts: int = 0
    preemption_signals: Any = None
    root_dir: Path | None = None

    def arguments(self) -> dict[str, Any]:
        """``Fabric(**config.arguments())`` builds a Fabric with this configuration. Shallow: the loggers,
        callbacks and strategy object are the same objects (``dataclasses.asdict`` would deep-copy them)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def is_default(self, name: str) -> bool:
        """Whether argument ``name`` holds its default value."""
        return bool(getattr(self, name) == getattr(DEFAULT, name))


DEFAULT = FabricConfig()


def as_tuple(value: Any) -> tuple[Any, ...]:
    """One object or an iterable of them (not a string) as a tuple; None as ()."""
    if value is None:
        return ()
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return tuple(value)
    return (value,)
