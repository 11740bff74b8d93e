"""The narrow interface between the checkpoint layer and a strategy, and what a layout's reader hands over
(``Source``: a checkpoint opened tensor by tensor).

The layer (``phalanx.checkpoint.layer``) owns everything that is the same for every backend: sorting
the state, atomic publishing, reading safely, checking keys and shapes, telling every rank about a
failure. A strategy only says how *its* tensors are gathered, scattered and sharded. Keeping the
layer ignorant of strategy classes (it never imports ``phalanx.strategies``) is what stops the two
from importing each other and copying each other's logic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.utils.errors import CheckpointError

Shapes = dict[str, tuple[int, ...] | None]

#: The kinds of entry in a ``state`` dict, as a checkpoint records them.
MODULE, OPTIMIZER, STATEFUL, PLAIN = "module", "optimizer", "stateful", "plain"


class Entry(NamedTuple):
    """One entry of the user's ``state``: ``obj`` is the user's object behind any Fabric wrapper. (A tuple:
    built for every entry of every per-step snapshot, where a frozen dataclass cost a microsecond each.)"""

    key: str
    kind: str
    obj: Any
    #: For optimizers: the module set up together with it (None if phalanx does not know it).
    module: nn.Module | None = None


class Wrapper:
    """Base of the objects that stand in a ``state`` dict for another whose state it is: Fabric's set-up module
    and optimizer (:mod:`phalanx.fabric.wrappers`). The checkpoint layer saves and loads
    :meth:`checkpoint_target` in their place. A base class, not a structural protocol, so that no user object is
    unwrapped for happening to have the same method names."""

    def checkpoint_target(self) -> Any:
        """The object whose state a checkpoint holds for this entry."""
        raise NotImplementedError

    def checkpoint_module(self) -> nn.Module | None:
        """For an optimizer: the module set up together with it (None where unknown, and for a module)."""
        return None


def of_kind(entries: Iterable[Entry], *kinds: str) -> list[Entry]:
    return [e for e in entries if e.kind in kinds]


def plain_shapes(module: nn.Module) -> Shapes:
    """key -> shape (None for non-tensor entries) of an unsharded module's state dict."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in module.state_dict().items()}


class PrecisionState(Protocol):
    @property
    def name(self) -> str: ...

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ShardIO(Protocol):
    """How a backend writes and reads the shards of a directory checkpoint. ``write``/``read`` are
    collectives (every rank calls them); ``check``/``saved_shapes`` run on rank 0 alone before a load
    and must not communicate. Reading a whole checkpoint in one plain process is not a backend's: the
    layer's one reader does it for every layout (:mod:`phalanx.checkpoint.sources`)."""

    #: Recorded in the checkpoint; picks the reader on load.
    layout: str

    def write(self, directory: Path, entries: list[Entry]) -> dict[str, Any]:
        """Write this rank's shards of the entries it handles into ``directory`` (which it may create).
        Returns plain info kept in the checkpoint, with ``"sharded"``: the keys it wrote. Entries it
        leaves out are gathered into the checkpoint's marker file."""
        ...

    def check(self, directory: Path, info: dict[str, Any], entries: list[Entry], weights_only: bool = True) -> None:
        """Raise ``CheckpointError`` if ``entries`` cannot be restored from these shards here (or, with
        ``weights_only``, if opening them could run code)."""
        ...

    def saved_shapes(self, directory: Path, info: dict[str, Any], key: str) -> Shapes | None:
        """Key -> shape of a sharded module entry as saved (None if the layout cannot tell)."""
        ...

    def read(self, directory: Path, info: dict[str, Any], entries: list[Entry], strict: bool) -> None:
        """Restore ``entries`` (all of them sharded in this checkpoint) in place."""
        ...


class StateOwner(Protocol):
    """The owner of the state a checkpoint saves and loads: it gathers each module's and optimizer's full state
    for saving, scatters it back on load, and says how its shards are written (``phalanx.strategies.Strategy``
    implements it)."""

    @property
    def name(self) -> str: ...
    @property
    def precision(self) -> PrecisionState: ...
    @property
    def loads_full_state_on_rank0(self) -> bool:
        """Single-file loads: only rank 0 reads the file and the strategy broadcasts the tensors (FSDP);
        otherwise every rank reads it."""
        ...

    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...

    def barrier(self, name: str = "barrier") -> None: ...
    def all_gather_object(self, obj: Any, name: str = "all_gather_object") -> list[Any]: ...

    def checkpoint_shards(self, layout: str | None = None) -> ShardIO | None:
        """With ``layout=None``: how to save (None: one file). Otherwise: the reader of ``layout``, or
        None if this strategy cannot read it."""
        ...

    def gather_module_state(self, module: nn.Module) -> dict[str, Any]:
        """The module's full state dict; a collective. Only rank 0's result is written."""
        ...

    def gather_optimizer_state(self, module: nn.Module | None, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's full state in torch's index-keyed layout; a collective (rank 0's is written)."""
        ...

    def scatter_module_state(self, module: nn.Module, state: dict[str, Any], strict: bool, from_rank0: bool) -> None:
        """Load a full state dict (already checked) into the module; with ``from_rank0`` only rank 0's
        ``state`` holds the values."""
        ...

    def scatter_optimizer_state(
        self, module: nn.Module | None, optimizer: Optimizer, state: dict[str, Any], from_rank0: bool
    ) -> None: ...

    def module_layout(self, module: nn.Module) -> tuple[str, Shapes]:
        """The module's name for messages and its full state-dict keys -> shapes."""
        ...

    def local_state(self, kind: str, obj: Any, module: nn.Module | None) -> dict[str, Any]:
        """This rank's part of a module's (``kind="module"``) or optimizer's state, without communicating:
        its tensors share memory with the live ones (a shard stays a DTensor)."""
        ...

    def load_local_state(self, kind: str, obj: Any, saved: dict[str, Any], strict: bool) -> None:
        """Put ``saved`` (what ``local_state`` gave, read back) into ``obj`` in place, without communicating."""
        ...


# ---------------------------------------------------------------------- what a layout's reader hands over
#: What a ``Source`` was opened from (``Source.kind``).
SINGLE, SHARDED, DEEPSPEED, PLAIN_DCP, STATE_DICT = "single", "sharded", "deepspeed", "dcp", "state_dict"
SAFETENSORS = "safetensors"


def placeholder(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    """A tensor that records shape and dtype and holds no data (its bytes are read on ``Source.load``)."""
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


@dataclass
class Source:
    """An opened checkpoint (:func:`phalanx.checkpoint.sources.open_source`): ``tree`` holds its entries, every
    tensor either real or a placeholder whose data ``load`` reads. ``kinds``: entry -> module/optimizer/...;
    ``name_keyed``: optimizer entries whose state is keyed by parameter name (DCP's form) rather than
    torch's index; ``notes``: what a conversion leaves out, said to the user."""

    path: Path
    kind: str
    meta: dict[str, Any]
    tree: dict[str, Any]
    kinds: dict[str, str]
    files: list[Path]
    name_keyed: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    loaders: dict[int, Callable[[], torch.Tensor]] = field(default_factory=dict)
    #: Told the order ``load`` will be called in (before the first call), a layout may read ahead in batches.
    expect: Callable[[list[torch.Tensor]], None] = lambda order: None
    #: Whether the recorded checksums were verified: True, False (none recorded), None (not asked to).
    verified: bool | None = None

    def load(self, tensor: torch.Tensor) -> torch.Tensor:
        """The data of a tensor of ``tree``, on the CPU and contiguous (read from disk if a placeholder)."""
        loader = self.loaders.get(id(tensor))
        out = loader() if loader is not None else tensor
        if out.is_meta:
            raise CheckpointError(f"{self.path}: a tensor of shape {tuple(out.shape)} has no data to read.")
        out = out.detach().cpu().contiguous()
        if tuple(out.shape) != tuple(tensor.shape) or out.dtype != tensor.dtype:
            raise CheckpointError(f"{self.path}: a tensor read as {tuple(out.shape)} {out.dtype}, but its metadata "
                                  f"says {tuple(tensor.shape)} {tensor.dtype}; the checkpoint is inconsistent.")
        return out

    @property
    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``tree`` with its path (``entry/key/...``)."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from tensors(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from tensors(value, f"{prefix}/{i}" if prefix else str(i))


def guess_kind(value: Any) -> str:
    """The kind of an entry in a file without phalanx's entry record."""
    if isinstance(value, dict) and {"state", "param_groups"} <= set(value):
        return OPTIMIZER
    if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        return MODULE
    return PLAIN
