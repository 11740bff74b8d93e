"""Dataloaders for distributed runs: a DistributedSampler that keeps the user's choices, correct
``set_epoch`` on every pass, batches moved to the device."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from phalanx.errors import MisconfigurationError
from phalanx.utils import move_to_device

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


def distribute_dataloader(loader: DataLoader[Any], num_replicas: int, rank: int) -> DataLoader[Any]:
    """A copy of ``loader`` that reads this rank's shard (every sample once per epoch across ranks,
    padded by DistributedSampler to equal length unless ``drop_last``)."""
    if isinstance(loader.sampler, DistributedSampler) or isinstance(loader.dataset, IterableDataset):
        return loader
    shuffle = _sampler_shuffle(loader)
    # Same seed on every rank, or the shards overlap: seed_everything() sets it for all ranks.
    seed = int(os.environ.get("PHALANX_SEED", "0"))
    sampler: DistributedSampler[Any] = DistributedSampler(
        loader.dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
        drop_last=loader.drop_last,
    )
    kwargs = {name: getattr(loader, name) for name in _LOADER_ATTRS if hasattr(loader, name)}
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=sampler, drop_last=loader.drop_last, **kwargs
    )


class FabricDataLoader:
    """Iterates the (distributed) loader, calling ``set_epoch`` before each pass and moving batches."""

    def __init__(self, loader: DataLoader[Any], device: torch.device | None) -> None:
        self._loader = loader
        self._device = device
        self._epoch = 0

    @property
    def loader(self) -> DataLoader[Any]:
        return self._loader

    @property
    def sampler(self) -> Any:
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
        for batch in self._loader:
            yield batch if self._device is None else move_to_device(batch, self._device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def warn_iterable(loader: DataLoader[Any], is_global_zero: bool) -> None:
    if isinstance(loader.dataset, IterableDataset) and is_global_zero:
        print(
            "[phalanx] The dataloader wraps an IterableDataset, which no sampler can split: make sure each "
            "rank yields a different shard (see torch.utils.data.get_worker_info and fabric.global_rank).",
            file=sys.stderr,
        )
