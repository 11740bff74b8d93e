"""``self.save_hyperparameters()`` and ``self.hparams``, with Lightning's meaning.

``self.hparams`` reads by attribute and by key (``self.hparams.lr``), and what is recorded is the
``__init__`` arguments, so a checkpoint can rebuild the model (``load_from_checkpoint``).

What is recorded: the arguments of every ``__init__`` of the object that is running when
``save_hyperparameters`` is called (a subclass's arguments override its base class's; ``**kwargs``
are merged in, ``*args`` are not), minus ``ignore``; or only the named ones; or one dict /
``argparse.Namespace`` / mapping passed as the single non-string argument.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types
from argparse import Namespace
from collections.abc import MutableMapping, Sequence
from typing import Any

from torch import nn

from phalanx.utils import diagnostics
from phalanx.utils.errors import MisconfigurationError

_PRIMITIVES = (bool, int, float, complex, str)


class AttributeDict(dict):  # type: ignore[type-arg]
    """A dict whose keys are also attributes: ``hparams.lr`` is ``hparams["lr"]``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as err:
            raise AttributeError(f"'{type(self).__name__}' has no attribute {key!r}") from err

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        try:
            del self[key]
        except KeyError as err:
            raise AttributeError(key) from err

    def __repr__(self) -> str:
        if not self:
            return ""
        quoted = {k: f'"{k}"' for k in self}
        width = max(len(q) for q in quoted.values())
        return "\n".join(f"{quoted[k]:>{width}}: {v}" for k, v in sorted(self.items(), key=lambda kv: str(kv[0])))


def _init_args_of(frame: types.FrameType, obj: Any) -> dict[str, Any] | None:
    """The arguments of ``frame`` if it is an ``__init__`` running on ``obj``; None otherwise."""
    code = frame.f_code
    if code.co_name != "__init__" or code.co_argcount == 0:
        return None
    names = code.co_varnames
    local = frame.f_locals
    if local.get(names[0]) is not obj:
        return None
    n_named = code.co_argcount + code.co_kwonlyargcount
    args = {name: local[name] for name in names[1:n_named] if name in local}
    extra = n_named
    if code.co_flags & inspect.CO_VARARGS:
        extra += 1  # *args have no names: Lightning drops them too
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs = local.get(names[extra], {})
        if isinstance(kwargs, dict):
            args.update(kwargs)
    return args


def collect_init_args(frame: types.FrameType | None, obj: Any) -> dict[str, Any]:
    """Arguments of every ``__init__`` of ``obj`` on the stack, from ``frame`` outwards (the outermost,
    i.e. the most derived class, wins)."""
    levels: list[dict[str, Any]] = []
    started = False
    while frame is not None:
        args = _init_args_of(frame, obj)
        if args is not None:
            levels.append(args)
            started = True
        elif started:
            break
        frame = frame.f_back
    merged: dict[str, Any] = {}
    for level in levels:
        merged.update(level)
    return merged


def to_hparams(value: Any) -> AttributeDict | MutableMapping[str, Any]:
    if isinstance(value, Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return AttributeDict(value)
    if isinstance(value, _PRIMITIVES):
        raise MisconfigurationError(
            f"save_hyperparameters({value!r}): a single {type(value).__name__} is not a set of hyperparameters. "
            "Pass argument names as strings, or a dict / argparse.Namespace."
        )
    if isinstance(value, MutableMapping):
        return value
    raise MisconfigurationError(
        f"save_hyperparameters() got a {type(value).__name__}; pass a dict, an argparse.Namespace or a mapping "
        "(for a dataclass config, take it as an __init__ argument and call save_hyperparameters() with no "
        "arguments)."
    )


class HyperparametersMixin:
    """``save_hyperparameters``, ``hparams`` and ``hparams_initial`` (shared by Module and DataModule)."""

    #: Whether the Trainer sends ``hparams`` to its loggers when a fit starts (``save_hyperparameters(logger=)``).
    hparams_to_loggers: bool = True

    def save_hyperparameters(
        self,
        *args: Any,
        ignore: Sequence[str] | str | None = None,
        frame: types.FrameType | None = None,
        logger: bool = True,
    ) -> None:
        """Record hyperparameters in ``self.hparams`` (sent to the loggers when ``logger``, stored in
        checkpoints, used by ``load_from_checkpoint``).

        * no arguments: every ``__init__`` argument (minus ``ignore``);
        * names: ``save_hyperparameters("lr", "hidden")`` records those arguments;
        * one dict / Namespace: ``save_hyperparameters(config)`` records its entries.
        """
        self.hparams_to_loggers = logger
        if len(args) == 1 and not isinstance(args[0], str) and not args[0]:
            return  # an empty container: nothing to record
        if frame is None:
            here = inspect.currentframe()
            frame = here.f_back if here is not None else None
        if dataclasses.is_dataclass(self):
            init_args = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        else:
            init_args = collect_init_args(frame, self)
        skip = [ignore] if isinstance(ignore, str) else [n for n in (ignore or []) if isinstance(n, str)]
        init_args = {k: v for k, v in init_args.items() if k not in skip}
        objects = [a for a in args if not isinstance(a, str)]
        if not args:
            chosen: Any = init_args
            self._hparams_name = "kwargs" if init_args else None
        elif len(objects) == 1:
            chosen = objects[0]
            # Which __init__ argument it was, so load_from_checkpoint passes it back as that argument.
            self._hparams_name = next((k for k, v in init_args.items() if v is chosen), None)
        else:
            self._hparams_name = "kwargs"
            missing = [a for a in args if isinstance(a, str) and a not in init_args]
            if missing:
                raise MisconfigurationError(
                    f"save_hyperparameters{tuple(args)}: {missing} are not arguments of {type(self).__name__}.__init__ "
                    f"(its arguments: {sorted(init_args)})."
                )
            chosen = {a: init_args[a] for a in args if isinstance(a, str)}
        hp = to_hparams(chosen)
        current = self.hparams
        if isinstance(hp, dict) and isinstance(current, dict):
            current.update(hp)
        else:
            self._hparams = hp
        for key in skip:
            self._hparams.pop(key, None)
        for key, value in self._hparams.items():
            if isinstance(value, nn.Module):
                diagnostics.warn(
                    f"Hyperparameter {key!r} is an nn.Module; its weights are already in the checkpoint. Use "
                    f"self.save_hyperparameters(ignore=[{key!r}]).", stacklevel=2,
                )
        self._hparams_initial = copy.deepcopy(self._hparams)

    @property
    def hparams(self) -> Any:
        """The recorded hyperparameters (an :class:`AttributeDict`; mutable)."""
        if "_hparams" not in self.__dict__:
            self._hparams = AttributeDict()
        return self.__dict__["_hparams"]

    @property
    def hparams_initial(self) -> AttributeDict:
        """A frozen copy of what ``save_hyperparameters`` recorded (later edits of hparams not included)."""
        initial = self.__dict__.get("_hparams_initial")
        return AttributeDict(copy.deepcopy(dict(initial))) if initial is not None else AttributeDict()

    def remove_ignored_hparams(self, ignore_list: list[str]) -> None:
        for key in ignore_list:
            self.hparams.pop(key, None)
