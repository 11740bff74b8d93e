"""What is in a ``state`` dict, and whether a checkpoint fits it: one sorting, one strict check and
one mismatch report for every strategy and layout.

A load that silently loads nothing is the failure this file exists to prevent: a mismatch names the
keys, ``strict=False`` says what it skipped, and a load where nothing matches is refused.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from phalanx.checkpoint.format import META_KEY
from phalanx.checkpoint.protocol import MODULE, OPTIMIZER, PLAIN, STATEFUL, Entry, Wrapper, plain_shapes
from phalanx.utils import diagnostics
from phalanx.utils.errors import CheckpointError

_BUILTINS = frozenset({dict, list, tuple, int, float, str, bool, bytes, type(None)})
_A = {MODULE: "a module", OPTIMIZER: "an optimizer", STATEFUL: "an object with state_dict()", PLAIN: "a plain value"}


def kind_of(value: Any) -> str:
    raw = value.checkpoint_target() if isinstance(value, Wrapper) else value
    if isinstance(raw, nn.Module):
        return MODULE
    if isinstance(raw, Optimizer):
        return OPTIMIZER
    if callable(getattr(raw, "state_dict", None)) and callable(getattr(raw, "load_state_dict", None)):
        return STATEFUL
    return PLAIN


def sort_state(state: dict[str, Any]) -> list[Entry]:
    """The entries of ``state`` by kind (modules, optimizers, objects with state_dict, plain values)."""
    out = []
    for key, value in state.items():
        if key == META_KEY:
            raise CheckpointError(f"{META_KEY!r} is reserved for phalanx's own metadata; rename that key.")
        if not isinstance(key, str):
            raise CheckpointError(f"State keys must be strings, got {key!r} ({type(key).__name__}).")
        if type(value) in _BUILTINS:  # most entries of a Trainer's state (classified on every snapshot)
            out.append(Entry(key, PLAIN, value))
            continue
        kind = kind_of(value)
        if isinstance(value, Wrapper):
            out.append(Entry(key, kind, value.checkpoint_target(), value.checkpoint_module()))
        else:
            out.append(Entry(key, kind, value))
    return out


# ---------------------------------------------------------------------- checking a checkpoint against state
def _clip(items: list[str], n: int = 12) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def check_entries(
    entries: list[Entry], saved: dict[str, str], strict: bool, path: Any, raw_state_dict: bool = False
) -> list[Entry]:
    """The one strict check: which requested entries the checkpoint (``saved``: key -> kind, or
    "unknown" for files without a record) can restore. Raises when an entry is missing under
    ``strict``, when nothing requested is there, or when an entry was saved as another kind."""
    missing = [e.key for e in entries if e.key not in saved]
    if raw_state_dict and missing:
        raise CheckpointError(
            f"{path} holds a plain state dict ({len(saved)} tensors such as {next(iter(saved))!r}), not a "
            f"checkpoint with the entries {missing}: it looks like the output of torch.save(model.state_dict()). "
            "Load it with fabric.load_raw(path, model)."
        )
    present = sorted(saved)
    if missing and strict:
        raise CheckpointError(
            f"The checkpoint {path} has no entry for {missing}; it holds {present}. Pass strict=False to load "
            "only what is present (the others are left unchanged)."
        )
    if missing and len(missing) == len(entries):
        raise CheckpointError(
            f"Nothing to load: the checkpoint {path} has none of the entries {missing}; it holds {present}. "
            "Use the keys it was saved with."
        )
    if missing:
        diagnostics.warn(f"fabric.load(strict=False): {path} has no entry for {missing}; they are left unchanged.")
    found = [e for e in entries if e.key in saved]
    for e in found:
        was = saved[e.key]
        tensors = {MODULE, OPTIMIZER}
        if was != "unknown" and was != e.kind and (was in tensors or e.kind in tensors):
            raise CheckpointError(
                f"Entry {e.key!r} of {path} was saved as {_A[was]} but is loaded into {_A[e.kind]}. Pass the "
                "matching object (or fabric.load(path) without state to read everything as it was saved)."
            )
    return found


def module_mismatch(
    name: str, expected: dict[str, tuple[int, ...] | None], given: dict[str, Any], strict: bool
) -> str | None:
    """The one mismatch report: ``given`` (a state dict, or key -> shape) against the module's ``expected``
    key -> shape (None for non-tensor entries). Returns the error message, or None when it loads; warns
    what ``strict=False`` skips."""
    if any(hasattr(v, "placements") and hasattr(v, "to_local") for v in given.values()):
        return (
            f"The state for {name} holds DTensor shards, not full tensors: it was probably saved with "
            "torch.save(model.state_dict()) under FSDP, which keeps only one rank's shards. Save with "
            "fabric.save(path, {'model': model}) on every rank instead."
        )

    def shape(v: Any) -> tuple[int, ...] | None:
        return v if isinstance(v, tuple) else tuple(v.shape) if hasattr(v, "shape") else None

    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    shapes = [
        f"{k}: checkpoint {shape(v)} vs model {expected[k]}"
        for k, v in given.items()
        if k in expected and expected[k] is not None and shape(v) is not None and shape(v) != expected[k]
    ]
    matched = len(given) - len(unexpected)
    if shapes or (strict and (missing or unexpected)) or (matched == 0 and expected):
        parts = [f"{what}: [{_clip(items)}]" for what, items in
                 (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)) if items]
        if shapes or strict:
            hint = "" if shapes else " Pass strict=False to load the matching entries only."
        else:
            hint = " strict=False loads matching keys, and none match."
        return f"The checkpoint does not match {name}: {'; '.join(parts)}. Is it a checkpoint of another model?{hint}"
    if missing or unexpected:
        diagnostics.warn(
            f"strict=False: loaded {matched} of {len(expected)} entries of {name}; skipped "
            + "; ".join(f"{what} [{_clip(items)}]" for what, items in
                        (("missing from the checkpoint:", missing), ("not in the model:", unexpected)) if items)
        )
    return None


def load_into_module(module: nn.Module, state: dict[str, Any], strict: bool) -> None:
    """Load a full state dict into an unsharded module, through the one mismatch report."""
    error = module_mismatch(type(module).__name__, plain_shapes(module), state, strict)
    if error:
        raise CheckpointError(error)
    module.load_state_dict(state, strict=strict)
