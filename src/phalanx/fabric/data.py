"""Dataloaders for distributed runs: a DistributedSampler that keeps the user's choices, correct
``set_epoch`` on every pass, batches moved to the device."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from phalanx.utils.diagnostics import warn
from phalanx.utils.errors import CollectiveMismatchError, MisconfigurationError
from phalanx.utils.tensors import move_to_device

if TYPE_CHECKING:
    from phalanx.strategies.base import Strategy

_LOADER_ATTRS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
    "multiprocessing_context", "generator", "persistent_workers", "pin_memory_device",
)


def _sampler_shuffle(loader: DataLoader[Any]) -> bool:
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise MisconfigurationError(
            f"The dataloader uses a custom batch sampler ({type(batch_sampler).__name__}) that phalanx cannot "
            "split across ranks. Make it rank-aware yourself and pass use_distributed_sampler=False to "
            "setup_dataloaders, or use a plain sampler."
        )
    sampler = loader.sampler
    if isinstance(sampler, SequentialSampler):
        return False
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler._num_samples is not None:
            raise MisconfigurationError(
                "The dataloader uses RandomSampler(replacement=True or num_samples=...), which a "
                "DistributedSampler cannot reproduce. Pass use_distributed_sampler=False and give each rank its "
                "own sampler."
            )
        return True
    raise MisconfigurationError(
        f"The dataloader uses a custom sampler ({type(sampler).__name__}) that phalanx cannot split across "
        "ranks without changing what it samples. Make it rank-aware (e.g. draw from "
        "range(rank, len(dataset), world_size)) and pass use_distributed_sampler=False to setup_dataloaders."
    )


def shared_seed(broadcast: Callable[[int], int]) -> int:
    """The seed of every rank's sampler: torch's seed on rank 0 (``torch.initial_seed()``, which
    ``seed_everything`` sets), sent to all ranks with ``broadcast``. Ranks that seeded torch
    differently still draw one permutation, so their shards never overlap. Seeds from
    ``seed_everything`` (< 2**32) pass unchanged."""
    return int(broadcast(torch.initial_seed() % 2**32))


class ResumableSampler(Sampler[int]):
    """A sampler whose next pass starts ``skip`` indices in (the indices only: no sample is read to skip it)."""

    def __init__(self, inner: DistributedSampler[Any]) -> None:
        self.inner, self.skip = inner, 0

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.inner), skip, None)

    def __len__(self) -> int:
        return len(self.inner)


def distribute_dataloader(loader: DataLoader[Any], num_replicas: int, rank: int, seed: int = 0,
                          resumable: bool = False) -> DataLoader[Any]:
    """A copy of ``loader`` that reads this rank's shard (every sample once per epoch across ranks,
    padded by DistributedSampler to equal length unless ``drop_last``). ``seed`` must be the same on
    every rank (see :func:`shared_seed`), or the shards overlap. ``resumable``: the sampler can start a pass
    part of the way in (:class:`ResumableSampler`)."""
    if isinstance(loader.sampler, DistributedSampler) or isinstance(loader.dataset, IterableDataset):
        return loader
    shuffle = _sampler_shuffle(loader)
    sampler: DistributedSampler[Any] = DistributedSampler(
        loader.dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
        drop_last=loader.drop_last,
    )
    kwargs = {name: getattr(loader, name) for name in _LOADER_ATTRS if hasattr(loader, name)}
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=ResumableSampler(sampler) if resumable else sampler,
        drop_last=loader.drop_last, **kwargs
    )


_BALANCE_HINT = (
    "Every rank must run the same number of steps: with unequal shards the gradient all-reduces of "
    "different steps pair up, and the rank with extra batches hangs in its last one. If you shard the data "
    "yourself (use_distributed_sampler=False, or an IterableDataset), give every rank the same number of "
    "batches (truncate to the shortest shard, or pad), or let phalanx shard it with its DistributedSampler."
)


def check_pass_length(strategy: Strategy, count: int) -> None:
    """After a pass over a dataloader that communicated, make sure every rank ran ``count`` batches.

    The rank that runs out first waits here while a rank with batches left enters its next gradient
    all-reduce, which the guard reports at once as a different operation; ranks that both reach the end
    compare their counts."""
    rank = strategy.global_rank
    try:
        counts = strategy.all_gather_object(count, name="end of dataloader pass")
    except CollectiveMismatchError as err:
        raise CollectiveMismatchError(
            f"Rank {rank}'s dataloader ran out after {count} batches while another rank still had batches "
            f"and went on training. {_BALANCE_HINT} (What the lockstep guard saw: {err})"
        ) from err
    if len(set(counts)) > 1:
        per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        raise CollectiveMismatchError(
            f"Ranks ran different numbers of batches in one pass over a dataloader ({per_rank}). {_BALANCE_HINT}"
        )


class FabricDataLoader:
    """Iterates the (distributed) loader, calling ``set_epoch`` before each pass and moving batches.

    With ``strategy`` (multi-process runs), a pass that issued collectives ends with a check that every
    rank ran the same number of batches (see :func:`check_pass_length`); a pass without collectives (a
    loader read on one rank only) is not checked."""

    def __init__(
        self, loader: DataLoader[Any], device: torch.device | None, strategy: Strategy | None = None,
        drew: Callable[[int], None] | None = None,
    ) -> None:
        self._loader = loader
        self._device = device
        self._epoch = 0
        self._open = False  # a pass has begun and not run to its end
        self._strategy = strategy
        # Replica groups (a ResumableSampler): the position inside a pass is part of the state, and a healed
        # group jumps to its peer's at the next batch.
        sampler = loader.sampler
        self._resumable: ResumableSampler | None = sampler if isinstance(sampler, ResumableSampler) else None
        self._drawn = 0  # batches drawn in the open pass
        self._seek: tuple[int, int] | None = None
        self._drew = drew  # told how many samples each batch holds (replica groups count what was trained)

    @property
    def loader(self) -> DataLoader[Any]:
        return self._loader

    @property
    def sampler(self) -> Sampler[Any] | Iterable[Any]:
        return self._loader.sampler

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch used by the next pass (it otherwise counts passes)."""
        self._epoch = epoch

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        for sampler in (getattr(self._loader, "sampler", None), getattr(self._loader.batch_sampler, "sampler", None)):
            if sampler is not None and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self._epoch)
                break
        self._epoch += 1
        self._open = True
        strategy = self._strategy
        issued = strategy.collectives_issued() if strategy is not None else 0
        count = 0
        if self._resumable is not None:
            yield from self._resumable_pass()
            count = self._drawn
        else:
            for batch in self._loader:
                count += 1
                yield batch if self._device is None else move_to_device(batch, self._device)
        self._open = False
        # Only a pass that ran to its end (a `break` never gets here) and that communicated is checked.
        if strategy is not None and strategy.collectives_issued() != issued:
            check_pass_length(strategy, count)

    def _resumable_pass(self) -> Iterator[Any]:
        """One pass that follows a seek (:meth:`load_state_dict` while the pass is open) at its next batch."""
        while True:
            for batch in self._loader:
                self._drawn += 1
                if self._drew is not None:
                    self._drew(_batch_size(batch, self._loader.batch_size))
                yield batch if self._device is None else move_to_device(batch, self._device)
                if self._seek is not None:
                    break
            else:
                return
            epoch, drawn = self._seek
            self._seek = None
            self._position(epoch, drawn)

    def _position(self, epoch: int, drawn: int) -> None:
        """The next batch drawn is batch ``drawn`` of pass ``epoch``."""
        assert self._resumable is not None
        self._resumable.set_epoch(epoch)
        self._resumable.skip = drawn * int(self._loader.batch_size or 1)
        self._epoch, self._drawn = epoch + 1, drawn

    def state_dict(self) -> dict[str, Any]:
        """What ``fabric.save`` keeps of the loader (as for any object with ``state_dict``): the epoch
        of the next pass (a pass left unfinished counts as not run) and, when the wrapped loader has
        state of its own (torchdata's ``StatefulDataLoader``, litdata's ``StreamingDataLoader``), that
        state too. A plain ``DataLoader`` has no position to save, so a run resumed from a mid-pass
        checkpoint begins that pass again (Lightning pickles the loader object itself and restores no
        position either)."""
        if self._resumable is not None:  # replica groups: the exact position, inside a pass too
            # The seed too: a group that joins takes its peers' permutation, whatever it seeded itself.
            return {"epoch": self._epoch - 1 if self._open else self._epoch,
                    "batches": self._drawn if self._open else 0, "seed": int(self._resumable.inner.seed)}
        state: dict[str, Any] = {"epoch": self._epoch - 1 if self._open else self._epoch}
        loader: Any = self._loader
        if _stateful(loader):
            state["loader"] = loader.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._resumable is not None and "batches" in state:
            self._resumable.inner.seed = int(state.get("seed", self._resumable.inner.seed))
            if self._open:  # a group healed mid-pass: it goes on from its peer's position at the next batch
                self._seek = (int(state["epoch"]), int(state["batches"]))
                return
            self._epoch, self._drawn = int(state["epoch"]), int(state["batches"])
            self._resumable.skip = self._drawn * int(self._loader.batch_size or 1)
            return
        self._epoch, self._open = int(state["epoch"]), False
        loader: Any = self._loader
        if "loader" in state and _stateful(loader):
            loader.load_state_dict(state["loader"])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def setup_dataloader(strategy: Strategy, loader: Any, use_distributed_sampler: bool, move_to_device: bool,
                     broadcast: Callable[[int], int]) -> FabricDataLoader:
    """``fabric.setup_dataloaders`` for one loader: sharded across ranks (a DistributedSampler seeded alike on
    every rank through ``broadcast``) when the strategy splits data, its batches moved to the device."""
    if not isinstance(loader, DataLoader):
        raise MisconfigurationError(f"setup_dataloaders expects DataLoaders, got {type(loader).__name__}.")
    several = strategy.world_size > 1
    sampler_kwargs = strategy.train_sampler_kwargs()
    groups = strategy.fault_tolerance is not None
    if use_distributed_sampler and sampler_kwargs is not None and (several or groups):
        warn_iterable(loader, strategy.global_rank)
        # Replica groups: each group seeds its own sampler; a group that joins takes its peers' seed with the state.
        seed = shared_seed(broadcast) if several else torch.initial_seed() % 2**32
        loader = distribute_dataloader(loader, **sampler_kwargs, seed=seed, resumable=groups)
    replicas = strategy.replica_groups
    return FabricDataLoader(loader, strategy.root_device if move_to_device else None, strategy if several else None,
                            replicas.drew if replicas is not None else None)


def _batch_size(batch: Any, default: int | None) -> int:
    """The number of samples in ``batch``: the first dimension of its first tensor."""
    stack = [batch]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor) and item.dim() > 0:
            return int(item.shape[0])
        if isinstance(item, dict):
            stack += item.values()
        elif isinstance(item, (list, tuple)):
            stack += item
    return int(default or 1)


def _stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def warn_iterable(loader: DataLoader[Any], rank: int) -> None:
    """Say (on rank 0) that phalanx cannot shard an IterableDataset: each rank must yield its own part."""
    if isinstance(loader.dataset, IterableDataset):
        warn(
            "The dataloader wraps an IterableDataset, which no sampler can split: make sure each data-parallel "
            "rank yields a different shard (see torch.utils.data.get_worker_info and "
            "fabric.strategy.distributed_sampler_kwargs(), whose 'rank' is the global rank except under tensor "
            "parallelism, where the ranks of one model replica must yield the same data).",
            rank=rank,
        )
