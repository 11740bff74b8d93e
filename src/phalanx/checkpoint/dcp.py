"""Checkpoints of DTensor-sharded modules (FSDP2) through ``torch.distributed.checkpoint`` (DCP).

Two things live here, both torch's own machinery behind a small surface:

* :class:`DCPShards`, the shard layout of a directory checkpoint (``.metadata`` + ``__<rank>_0.distcp``):
  every rank writes its shards; a checkpoint written on N ranks loads on M (DCP reshards). Reading one
  in a plain process, tensor by tensor, is the layer's reader's (:mod:`phalanx.checkpoint.sources`).
* full-state gather/scatter for single files: the unsharded state gathered to rank 0's CPU, and a
  full state dict broadcast from rank 0 with each rank keeping its shard.

Optimizer state in a single file uses torch's index-keyed layout (what ``optimizer.state_dict()``
gives unsharded), so any strategy or plain torch reads it; in DCP it is keyed by parameter name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import pathlib
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.optim import Optimizer

from phalanx.checkpoint.format import DCP_LAYOUT
from phalanx.checkpoint.protocol import MODULE, OPTIMIZER, Entry, Shapes
from phalanx.utils.compat import FSDPModule
from phalanx.utils.errors import CheckpointError

METADATA = ".metadata"
CollectiveScope = Callable[[str], contextlib.AbstractContextManager[Any]]


def class_name(module: nn.Module) -> str:
    """The user's class name (fully_shard swaps a module's class for ``FSDP<name>``)."""
    name = type(module).__name__
    return name[4:] if isinstance(module, FSDPModule) and name.startswith("FSDP") else name


# ---------------------------------------------------------------------- optimizer layouts
def _param_fqns(module: nn.Module, optimizer: Optimizer) -> list[str]:
    names = {id(p): n for n, p in module.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    f"{type(optimizer).__name__} updates a parameter that is not part of {class_name(module)}, "
                    "so its state cannot be named. Give each module its own optimizer."
                )
            out.append(names[id(p)])
    return out


def to_index_keyed(osd: dict[str, Any]) -> dict[str, Any]:
    """Name-keyed optimizer state (DCP's form) -> torch's index-keyed form."""
    order = [fqn for group in osd["param_groups"] for fqn in group["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    return {
        "state": {index[fqn]: value for fqn, value in osd["state"].items()},
        "param_groups": [{**g, "params": [index[f] for f in g["params"]]} for g in osd["param_groups"]],
    }


def to_name_keyed(osd: dict[str, Any], fqns: list[str]) -> dict[str, Any]:
    ids = [i for group in osd["param_groups"] for i in group["params"]]
    if len(ids) != len(fqns) or any(not isinstance(i, int) or not 0 <= i < len(fqns) for i in ids):
        raise CheckpointError(
            f"The checkpoint's optimizer state covers {len(ids)} parameters, but this optimizer has {len(fqns)}. "
            "Is it the optimizer of another model?"
        )
    return {
        "state": {fqns[i]: value for i, value in osd["state"].items()},
        "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in osd["param_groups"]],
    }


def _require_module(module: nn.Module | None, optimizer: Optimizer) -> nn.Module:
    if module is None:
        raise CheckpointError(
            f"Sharded optimizer state is named after its model's parameters, but phalanx does not know which model "
            f"this {type(optimizer).__name__} belongs to. Set them up together: `model, optimizer = "
            "fabric.setup(model, optimizer)`, and pass the optimizer object returned by fabric."
        )
    return module


# ---------------------------------------------------------------------- full state (single files)
def full_model_state(module: nn.Module, rank0_only: bool) -> dict[str, Any]:
    """Unsharded model state; with ``rank0_only`` it lands on rank 0's CPU and other ranks get {}."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))


def full_optimizer_state(module: nn.Module | None, optimizer: Optimizer, rank0_only: bool) -> dict[str, Any]:
    """Unsharded optimizer state in torch's index-keyed form (rank 0 only with ``rank0_only``)."""
    if not optimizer.state:
        # Nothing is sharded yet; the state-dict helpers would initialize the state with a zero step.
        return optimizer.state_dict()
    osd = get_optimizer_state_dict(
        _require_module(module, optimizer), optimizer,
        options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only),
    )
    return to_index_keyed(osd) if osd else {}


def load_full_model_state(module: nn.Module, state: dict[str, Any], strict: bool, broadcast: bool) -> None:
    """Shard a full state dict into ``module`` (checked by the caller). With ``broadcast`` only rank 0
    passes the state (others pass {})."""
    options = StateDictOptions(full_state_dict=True, strict=strict, broadcast_from_rank0=broadcast)
    set_model_state_dict(module, state, options=options)


def load_full_optimizer_state(
    module: nn.Module | None, optimizer: Optimizer, state: dict[str, Any], broadcast: bool
) -> None:
    """Load index-keyed optimizer state (a full file's) into a possibly sharded optimizer."""
    if broadcast and not state:  # not rank 0: the tensors arrive from rank 0 inside the helper
        named: dict[str, Any] = {}
    elif not state.get("state"):
        try:
            optimizer.load_state_dict(state)  # hyperparameters only: nothing to shard
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"Cannot load the optimizer state: {err}") from err
        return
    else:
        named = to_name_keyed(state, _param_fqns(_require_module(module, optimizer), optimizer))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    set_optimizer_state_dict(_require_module(module, optimizer), optimizer, named, options=options)


# ---------------------------------------------------------------------- shards (directories)
class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` (a plain pickle that torch loads with ``pickle.load``) allowing only the
    inert types DCP puts there: its own dataclasses and enums, dtypes, sizes, layouts and paths. A
    file naming anything else could run code when torch opens it, so it is refused before torch does."""

    _PLAIN = {("collections", "OrderedDict"): OrderedDict, ("builtins", "set"): set,
              ("builtins", "frozenset"): frozenset, ("torch", "Size"): torch.Size,
              ("torch.serialization", "_get_layout"): torch.serialization._get_layout}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._PLAIN:
            return self._PLAIN[(module, name)]
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        if module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
            return getattr(pathlib, name)
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
            ):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name}")


def check_metadata(directory: Path) -> None:
    """Refuse a ``.metadata`` that names anything but DCP's plain types (see ``_MetadataUnpickler``)."""
    try:
        with open(directory / METADATA, "rb") as fh:
            _MetadataUnpickler(fh).load()
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{directory / METADATA} names {err}, which torch.distributed.checkpoint's metadata never holds, so the "
            "checkpoint was not opened: unpickling it could run code. If you trust where it comes from, load it "
            "with weights_only=False."
        ) from err
    except Exception as err:
        raise CheckpointError(f"{directory / METADATA} is truncated or corrupt: {type(err).__name__}: {err}") from err


def _first_cause(err: BaseException) -> str:
    """DCP's error lists every rank's traceback; the first rank's exception says what went wrong."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (exc, _) = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return f"{type(err).__name__}: {err}"


def plain_failure(err: BaseException) -> RuntimeError:
    """DCP gathers every rank's failure and raises the same on all of them, as a BaseException listing
    every traceback: an ordinary error naming the first rank's exception (raise it ``from err``, so the
    checkpoint layer still finds the operating system's cause behind it)."""
    return RuntimeError(_first_cause(err))


class DCPShards:
    """The ``torch.distributed.checkpoint`` layout (see the module docstring).

    Args:
        collective: context for phases that run torch's own collectives (the strategy's guard
            records them, so a rank stuck elsewhere is named); a no-op outside a process group.
    """

    layout = DCP_LAYOUT

    def __init__(self, collective: CollectiveScope | None = None) -> None:
        self._collective: CollectiveScope = collective or (lambda name: contextlib.nullcontext())

    def _tensors(self, entries: list[Entry], with_state_only: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for e in entries:
            if e.kind == MODULE:
                out[e.key] = get_model_state_dict(e.obj)
            elif e.kind == OPTIMIZER and (e.obj.state or not with_state_only):
                out[e.key] = get_optimizer_state_dict(_require_module(e.module, e.obj), e.obj)
        return out

    def state_dicts(self, entries: list[Entry]) -> tuple[dict[str, Any], dict[str, Any]]:
        """What DCP writes for ``entries`` (this rank's shards, live) and the info ``write`` returns."""
        # An optimizer that has not stepped has no tensors to shard (and the helpers would invent a
        # zero step): it goes into the marker as a plain state dict.
        tensors = self._tensors(entries, with_state_only=True)
        return tensors, {"sharded": list(tensors), "optimizers": [e.key for e in entries if e.key in tensors
                                                                  and e.kind == OPTIMIZER]}

    def write(self, directory: Path, entries: list[Entry]) -> dict[str, Any]:
        tensors, info = self.state_dicts(entries)
        with self._collective("save: writing shards (torch.distributed.checkpoint)"):
            try:
                dcp_save(tensors, storage_writer=FileSystemWriter(str(directory)))
            except CheckpointException as err:
                raise plain_failure(err) from err
        return info

    def check(self, directory: Path, info: dict[str, Any], entries: list[Entry], weights_only: bool = True) -> None:
        if not (directory / METADATA).is_file():
            raise CheckpointError(
                f"{directory} is not a complete sharded checkpoint: {METADATA} is missing. Use an earlier checkpoint."
            )
        if weights_only:
            check_metadata(directory)

    def saved_shapes(self, directory: Path, info: dict[str, Any], key: str) -> Shapes | None:
        md = FileSystemReader(str(directory)).read_metadata()
        shapes: Shapes = {}
        for flat, where in md.planner_data.items():
            if len(where) == 2 and where[0] == key:
                size = getattr(md.state_dict_metadata[flat], "size", None)
                shapes[where[1]] = tuple(size) if size is not None else None
        return shapes

    def read(self, directory: Path, info: dict[str, Any], entries: list[Entry], strict: bool) -> None:
        with self._collective("load: reading shards (torch.distributed.checkpoint)"):
            template = self._tensors(entries, with_state_only=False)
            try:
                with warnings.catch_warnings():
                    # Loading in one process (no process group) is intended here, not an accident.
                    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
                    dcp_load(template, storage_reader=FileSystemReader(str(directory)),
                             planner=DefaultLoadPlanner(allow_partial_load=not strict))
            except (Exception, CheckpointException) as err:  # DCP raises the same failure on every rank
                raise CheckpointError(f"Reading the sharded checkpoint {directory} failed: "
                                      f"{_first_cause(err)}") from err
            for e in entries:
                if e.kind == MODULE:
                    set_model_state_dict(e.obj, template[e.key], options=StateDictOptions(strict=strict))
                else:
                    set_optimizer_state_dict(_require_module(e.module, e.obj), e.obj, template[e.key])
