"""How the Trainer feeds data: samplers that resume exactly and evaluate every sample once.

* Training: :class:`TrainSampler` orders the dataset by ``seed + epoch`` (the same permutation on
  every rank and for every world size), pads it to a multiple of the world size and gives rank ``r``
  every ``W``-th index. Two ranks with batch ``B`` therefore see exactly the samples one process
  with batch ``2B`` sees, and a resumed run can skip the samples already consumed without reading
  them, whatever the global batch size of either run (a position at or past the last real sample
  leaves nothing: the padding is never trained on after a resume).
* Evaluation: :class:`EvalBatchSampler` gives rank ``r`` the indices ``r, r+W, ...`` with no
  padding (each sample scored once), cut into the same number of batches on every rank, so
  strategies whose forward communicates (FSDP, DDP buffer broadcast) stay in lockstep.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

from phalanx.fabric.data import shared_seed, warn_iterable
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.fabric.fabric import Fabric

# DataLoader settings carried over when the Trainer rebuilds a loader around its own sampler.
_KEEP = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
         "generator", "persistent_workers", "pin_memory_device")


def _pad(order: list[int], multiple: int) -> list[int]:
    if not order:
        return order
    total = math.ceil(len(order) / multiple) * multiple
    while len(order) < total:
        order = order + order[: total - len(order)]
    return order


class TrainSampler(Sampler[int]):
    """Rank-aware, epoch-seeded, resumable sampler for training data."""

    def __init__(self, length: int, num_replicas: int, rank: int, shuffle: bool, seed: int) -> None:
        self.length, self.num_replicas, self.rank = length, num_replicas, rank
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.skip = 0  # global samples to skip on the next pass only (resuming mid-epoch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(self.length, generator=gen).tolist()
        else:
            order = list(range(self.length))
        if self.skip >= self.length:
            # Every real sample of the epoch was consumed (a checkpoint after its last batch): what is left
            # is padding at most, and training on it would repeat samples already trained on.
            return []
        # Pad before skipping, then again after: every rank gets the same count in both cases.
        padded = _pad(order, self.num_replicas)
        return _pad(padded[self.skip:], self.num_replicas) if self.skip else padded

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle and not self.skip and self.length % self.num_replicas == 0:
            # The dataset's own order, nothing to pad or skip: a range (what torch's SequentialSampler
            # iterates), not a list of every index built each epoch (one int object per sample).
            return iter(range(self.rank, self.length, self.num_replicas))
        order = self._order()
        self.skip = 0
        return iter(order if self.num_replicas == 1 else order[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        # What _order() yields per rank, without drawing the permutation: pad, skip, pad again.
        if self.skip >= self.length:
            return 0
        padded = math.ceil(self.length / self.num_replicas) * self.num_replicas
        return math.ceil((padded - self.skip) / self.num_replicas)


class EvalBatchSampler(Sampler[list[int]]):
    """Each sample exactly once across ranks; the same number of batches on every rank."""

    def __init__(self, length: int, num_replicas: int, rank: int, batch_size: int) -> None:
        mine = list(range(rank, length, num_replicas))
        most = math.ceil(length / num_replicas)
        n_batches = math.ceil(most / batch_size)
        if len(mine) < n_batches:
            raise MisconfigurationError(
                f"Evaluation data of {length} samples cannot be split across {num_replicas} ranks into equal "
                f"numbers of batches without scoring a sample twice (rank {rank} would get {len(mine)} samples "
                f"for {n_batches} batches). Use a batch size of at least 2 and at least {num_replicas} samples."
            )
        sizes = [batch_size] * (len(mine) // batch_size) + ([len(mine) % batch_size] if len(mine) % batch_size else [])
        while len(sizes) < n_batches:  # split the largest batch until the counts match
            i = max(range(len(sizes)), key=lambda j: sizes[j])
            sizes[i : i + 1] = [sizes[i] - sizes[i] // 2, sizes[i] // 2]
        self.batches: list[list[int]] = []
        start = 0
        for size in sizes:
            self.batches.append(mine[start : start + size])
            start += size

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _standard(loader: DataLoader[Any]) -> bool:
    """Whether phalanx can replace the loader's sampler without changing what it samples."""
    sampler = loader.sampler
    plain_random = isinstance(sampler, RandomSampler) and not sampler.replacement and sampler._num_samples is None
    return (
        not isinstance(loader.dataset, IterableDataset)
        and type(loader.batch_sampler) is BatchSampler
        and (type(sampler) is SequentialSampler or plain_random)
    )


def rebuild_loader(loader: DataLoader[Any], **kwargs: Any) -> DataLoader[Any]:
    """A new DataLoader over ``loader``'s dataset with its settings (workers, collate_fn, ...) and ``kwargs``."""
    keep = {name: getattr(loader, name) for name in _KEEP if hasattr(loader, name)}
    if loader.num_workers > 0:
        keep["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **keep, **kwargs)


def _custom_sampler_error(loader: DataLoader[Any], what: str) -> MisconfigurationError:
    kind = type(loader.batch_sampler).__name__ if type(loader.batch_sampler) is not BatchSampler else type(
        loader.sampler).__name__
    return MisconfigurationError(
        f"The {what} dataloader uses a custom sampler ({kind}) that phalanx cannot split across ranks without "
        "changing what it samples. Make it rank-aware (e.g. draw from range(rank, len(dataset), world_size)) "
        "and pass Trainer(use_distributed_sampler=False)."
    )


def data_split(fabric: Fabric) -> tuple[int, int]:
    """How many distinct data shards there are and which one this rank reads. Not always the world:
    the tensor-parallel ranks of one model replica must read the same batch (the strategy says so)."""
    kwargs = fabric.strategy.distributed_sampler_kwargs()
    if kwargs is None:
        return 1, 0
    return int(kwargs["num_replicas"]), int(kwargs["rank"])


def prepare_train_loader(
    loader: DataLoader[Any], fabric: Fabric, use_distributed_sampler: bool
) -> tuple[Any, TrainSampler | None]:
    """The loader training iterates, and the Trainer's sampler inside it (None when the user's own
    sampler is kept: then resuming mid-epoch re-reads and discards the consumed batches)."""
    if not isinstance(loader, DataLoader):
        raise MisconfigurationError(f"train_dataloaders must be a torch DataLoader, got {type(loader).__name__}.")
    if isinstance(loader.dataset, IterableDataset):
        warn_iterable(loader, fabric.global_rank)
        return fabric.setup_dataloaders(loader, use_distributed_sampler=False), None
    if not _standard(loader):
        if use_distributed_sampler and fabric.world_size > 1:
            raise _custom_sampler_error(loader, "training")
        return fabric.setup_dataloaders(loader, use_distributed_sampler=False), None
    world, rank = data_split(fabric) if use_distributed_sampler else (1, 0)
    seed = shared_seed(fabric.broadcast)
    sampler = TrainSampler(len(loader.dataset), world, rank, isinstance(loader.sampler, RandomSampler), seed)  # type: ignore[arg-type]
    rebuilt = rebuild_loader(loader, batch_size=loader.batch_size, sampler=sampler, drop_last=loader.drop_last)
    return fabric.setup_dataloaders(rebuilt, use_distributed_sampler=False), sampler


def prepare_eval_loader(loader: DataLoader[Any], fabric: Fabric, use_distributed_sampler: bool) -> Any:
    if not isinstance(loader, DataLoader):
        raise MisconfigurationError(f"Evaluation dataloaders must be torch DataLoaders, got {type(loader).__name__}.")
    if fabric.world_size == 1 or not use_distributed_sampler:
        return fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    if isinstance(loader.dataset, IterableDataset):
        warn_iterable(loader, fabric.global_rank)
        return fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    if not _standard(loader):
        raise _custom_sampler_error(loader, "evaluation")
    replicas, rank = data_split(fabric)
    batch_sampler = EvalBatchSampler(len(loader.dataset), replicas, rank, loader.batch_size or 1)  # type: ignore[arg-type]
    return fabric.setup_dataloaders(rebuild_loader(loader, batch_sampler=batch_sampler), use_distributed_sampler=False)


def as_list(loaders: Any) -> list[Any]:
    if loaders is None:
        return []
    if isinstance(loaders, (list, tuple)):
        return list(loaders)
    return [loaders]


def num_batches(loader: Any, limit: int | float) -> int | None:
    """Batches per pass after ``limit`` (int: a count; float: a fraction); None if the loader has no length."""
    try:
        total = len(loader)
    except TypeError:
        return int(limit) if isinstance(limit, int) else None
    if isinstance(limit, float):
        return int(total * limit) if limit < 1.0 else total
    return min(total, limit)


def empty_loader_error(what: str, loader: Any, limit_name: str, limit: int | float, world_size: int) -> Exception:
    """The error for a loader that yields no batches (a training loop over it would spin through
    ``max_epochs`` empty epochs and checkpoint an untrained model; an empty validation would leave
    every monitored metric missing)."""
    raw = getattr(loader, "loader", loader)
    facts = []
    dataset = getattr(raw, "dataset", None)
    try:
        facts.append(f"{len(dataset)} samples")  # type: ignore[arg-type]
    except TypeError:
        facts.append("no length (an iterable dataset)")
    if getattr(raw, "batch_size", None) is not None:
        facts.append(f"batch_size={raw.batch_size}, drop_last={raw.drop_last}")
    if world_size > 1:
        facts.append(f"split across {world_size} ranks")
    if limit != 1.0:
        facts.append(f"{limit_name}={limit}")
    fix = f" or raise {limit_name}" if limit != 1.0 else ""
    skip = (" To skip validation, pass no validation loader or Trainer(limit_val_batches=0)."
            if what == "validation" else "")
    return MisconfigurationError(
        f"The {what} dataloader yields 0 batches ({', '.join(facts)}). Check the dataset split and the batch size "
        f"(drop_last=True drops a last partial batch, which may be all there is){fix}.{skip}"
    )
