"""Precision: how a module's parameters are stored, how its forward runs, how its loss is scaled.

One class per precision, each in its own module, all built on the contract in :mod:`phalanx.precision.base`.
``REGISTRY`` is the one table of names: a new precision is its own module plus one entry here
(docs/architecture.md, "Adding a precision"). A strategy picks which names it runs
(``Strategy.supported_precisions``) and hands the precision a :class:`Placement`; these classes know about
dtypes, autocast, loss scaling and module conversion, never about processes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from phalanx.precision.base import Placement, Precision
from phalanx.precision.double import DoublePrecision
from phalanx.precision.fp8 import Float8Precision
from phalanx.precision.half import HalfPrecision
from phalanx.precision.mixed import MixedPrecision
from phalanx.utils.errors import MisconfigurationError

#: Precision name -> how to build it. ``Fabric(precision=name)`` builds one; ``Fabric(precision=obj)`` takes
#: an instance built by the user (options such as ``Float8Precision(emulate=True)``).
REGISTRY: dict[str, Callable[[], Precision]] = {
    "32-true": Precision,
    "64-true": DoublePrecision,
    "16-mixed": partial(MixedPrecision, "16-mixed"),
    "bf16-mixed": partial(MixedPrecision, "bf16-mixed"),
    "16-true": partial(HalfPrecision, "16-true"),
    "bf16-true": partial(HalfPrecision, "bf16-true"),
    "fp8-mixed": Float8Precision,
}
PRECISIONS: tuple[str, ...] = tuple(REGISTRY)

# Lightning's short forms, so a port is an import change.
_ALIASES: dict[str | int, str] = {
    "32": "32-true", 32: "32-true",
    "64": "64-true", 64: "64-true",
    "16": "16-mixed", 16: "16-mixed",
    "bf16": "bf16-mixed",
}
# Lightning's names for what phalanx does otherwise: the name and what to use instead.
_REFUSED = {
    "transformer-engine": "phalanx trains in float8 through torchao, not NVIDIA Transformer Engine: use "
                          "precision='fp8-mixed' (float8 matmuls, bfloat16 elsewhere; see docs/fabric.md).",
    "transformer-engine-float16": "phalanx trains in float8 through torchao, not NVIDIA Transformer Engine, and "
                                  "keeps bfloat16 around the float8 matmuls: use precision='fp8-mixed'.",
}


def canonical_precision(precision: str | int) -> str:
    """The registered name ``precision`` stands for (Lightning's short forms included)."""
    if precision in _REFUSED:
        raise MisconfigurationError(f"precision={precision!r} is not supported. {_REFUSED[str(precision)]}")
    name = _ALIASES.get(precision, precision)
    if name not in REGISTRY:
        raise MisconfigurationError(
            f"Unknown precision {precision!r}. Choose one of {', '.join(map(repr, PRECISIONS))}, or pass a "
            "phalanx.precision.Precision instance."
        )
    return str(name)


def resolve_precision(precision: str | int | Precision) -> Precision:
    """The precision object for a name (a new one) or an instance (as given)."""
    if isinstance(precision, Precision):
        return precision
    if not isinstance(precision, (str, int)) or isinstance(precision, bool):
        raise MisconfigurationError(
            f"precision={precision!r}: pass a name such as 'bf16-mixed' or a phalanx.precision.Precision instance."
        )
    return REGISTRY[canonical_precision(precision)]()


def is_registered(precision: Precision) -> bool:
    """Whether ``precision`` is what its name builds (not a subclass adding behaviour): what a backend that runs
    the precision itself, by name (DeepSpeed), can honour."""
    return precision.name in REGISTRY and type(precision) is type(REGISTRY[precision.name]())


__all__ = [
    "PRECISIONS",
    "REGISTRY",
    "DoublePrecision",
    "Float8Precision",
    "HalfPrecision",
    "MixedPrecision",
    "Placement",
    "Precision",
    "canonical_precision",
    "is_registered",
    "resolve_precision",
]
