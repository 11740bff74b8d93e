"""What every multi-process backend shares: joining the process group and guarded collectives.

DDP, FSDP, tensor parallelism and DeepSpeed differ in how they wrap a model, not in how a rank joins
the job, which backend it talks over, how its collectives are guarded (the lockstep guard and its
watchdog, :mod:`phalanx.distributed`) or how it leaves; that is written once, here."""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]
from torch.optim import Optimizer

from phalanx.distributed.launch import ClusterEnvironment, check_environment, record_failure, restart_count
from phalanx.distributed.lockstep import HEARTBEAT_STORE_TIMEOUT, Collectives, Lockstep, make_store_client, to_timedelta
from phalanx.strategies.base import LOCKSTEP_MODES, Strategy
from phalanx.utils.errors import GradientSyncError, MisconfigurationError
from phalanx.utils.late_reads import LateRead, on_device


class SyncRecord(Protocol):
    """What a strategy records per set-up module about its gradients' synchronisation."""

    name: str
    param_ids: frozenset[int]
    local_only: bool  # the last backward ran inside no_backward_sync: the gradients are this rank's alone
    optimizers: dict[int, bool]  # id(optimizer) -> whether it steps any of the module's parameters (cached)


def local_gradients_stepped(records: Iterable[SyncRecord], optimizer: Optimizer) -> str | None:
    """The name of a module whose gradients are local to this rank and which ``optimizer`` would step, or None."""
    for record in records:
        if not record.local_only:
            continue
        touches = record.optimizers.get(id(optimizer))
        if touches is None:
            ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
            touches = record.optimizers[id(optimizer)] = bool(ids & record.param_ids)
        if touches:
            return record.name
    return None


# How long teardown lets the backend's worker threads release finished work (see teardown).
_WORKER_DRAIN_SECONDS = 0.05


class _GroupHolder:
    """Which strategy holds the process group phalanx created in this process.

    torch's default process group is process-wide, and a script may build a second Trainer or Fabric
    after the first (fit, then a new Trainer that resumes or tests). That one takes the group, its
    guard and its watchdog over from the holder instead of failing or creating a second group that
    the peers would have to meet at the same moment. A weak reference: it keeps no strategy alive.
    """

    strategy: weakref.ref[ParallelStrategy] | None = None


_holder = _GroupHolder()


def running_job_world_size() -> int:
    """The world size of the job a phalanx strategy runs in this process right now (its process group is
    up and held); 0 when there is none. A one-process Fabric created inside such a job is a deliberate
    local one (:meth:`phalanx.strategies.single.SingleDeviceStrategy.job_environment`)."""
    holder = _holder.strategy() if _holder.strategy is not None else None
    if holder is None or not holder.holds_group or not dist.is_initialized():
        return 0
    return holder.world_size


def _default_guard_timeout() -> float:
    return float(os.environ.get("PHALANX_GUARD_TIMEOUT", "15"))


class ParallelStrategy(Strategy):
    """Base of DDP/FSDP/DeepSpeed: one process per device, a process group, guarded collectives.

    Args:
        timeout: seconds a collective may wait for ranks that are alive and on their way (rank 0
            writing a large checkpoint while the others wait is normal). Also the process group's
            timeout for the data-plane collectives phalanx cannot pre-check.
        guard_timeout: seconds after which a rank that is gone (no heartbeat), or stuck in a
            collective the others will not join, makes the waiting ranks raise. Default 15, or
            ``PHALANX_GUARD_TIMEOUT``.
        lockstep: ``"default"`` compares operation names and tensor shapes before each collective;
            ``"strict"`` also compares call sites (``PHALANX_LOCKSTEP=strict`` sets it too).
        backend: process-group backend; ``gloo`` on CPU and ``nccl`` on CUDA when None.
    """

    def __init__(
        self,
        *,
        timeout: float = 1800.0,
        guard_timeout: float | None = None,
        lockstep: str | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.timeout = float(timeout)
        self.guard_timeout = _default_guard_timeout() if guard_timeout is None else float(guard_timeout)
        self._lockstep_given = lockstep
        lockstep = lockstep or os.environ.get("PHALANX_LOCKSTEP", "default")
        if lockstep not in LOCKSTEP_MODES:
            raise MisconfigurationError(f"lockstep={lockstep!r}; choose one of {LOCKSTEP_MODES}.")
        self.lockstep = lockstep
        self.backend = backend
        self._rank = 0
        self._world_size = 1
        self._local_rank = 0
        self._node_rank = 0
        self._guard: Lockstep | None = None
        self._collectives: Collectives | None = None
        self._owns_group = False
        self._successor: weakref.ref[ParallelStrategy] | None = None

    def set_lockstep(self, mode: str) -> None:
        super().set_lockstep(mode)
        if self._lockstep_given is not None and self._lockstep_given != mode:
            raise MisconfigurationError(
                f"Fabric(lockstep={mode!r}) contradicts "
                f"{type(self).__name__}(lockstep={self._lockstep_given!r}); set the mode in one place."
            )
        if self._guard is not None:
            raise MisconfigurationError("lockstep must be chosen before fabric.launch().")
        self.lockstep = mode

    @property
    def _process_group_backend(self) -> str:
        """The process-group backend this strategy joins (read-only): ``backend``, else ``nccl`` on CUDA and
        ``gloo`` on CPU. Lightning's name for it, which its parity tests read."""
        return self.backend or ("nccl" if self.device_type == "cuda" else "gloo")

    # ------------------------------------------------------------------ environment
    def setup_environment(self, env: ClusterEnvironment | None) -> None:
        if env is None:
            if self.num_processes != 1:
                raise MisconfigurationError(
                    f"strategy={self.name!r} with {self.num_processes} processes needs a launched job: call "
                    "fabric.launch() (it starts the processes), or start the script with `phalanx run` or torchrun."
                )
            env = ClusterEnvironment("local", 0, 1, 0, 1, 0, "127.0.0.1", 0, False)
        else:
            check_environment(env, self.devices, self.num_nodes)
        self._rank, self._world_size = env.rank, env.world_size
        self._local_rank, self._node_rank = env.local_rank, env.node_rank
        if self.device_type == "cuda":
            self._root_device = torch.device("cuda", env.local_rank)
            torch.cuda.set_device(self._root_device)
        backend = self._process_group_backend
        if dist.is_initialized():
            self._take_over(env, backend)
            return
        is_master = env.rank == 0 and not env.agent_hosts_store
        store = TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master, to_timedelta(self.timeout),
            wait_for_workers=False,
        )
        # torch's agent keeps one store for every attempt of a restarting job (TORCHELASTIC_USE_AGENT_STORE):
        # keys scoped by attempt keep a restarted rank from reading the failed attempt's gloo addresses (it
        # then connected to a dead port and failed, or froze) or its guard's sequence numbers and heartbeats.
        scope = f"phalanx/attempt{restart_count()}"
        dist.init_process_group(
            backend,
            store=PrefixStore(f"{scope}/pg", store),
            rank=env.rank,
            world_size=env.world_size,
            timeout=to_timedelta(self.timeout),
        )
        self._owns_group = True
        hb_store = None
        if env.world_size > 1:
            # The watchdog's own client: its connect may be slow (many ranks starting on a loaded host), but
            # each later call is short-bounded, so teardown can always join the thread (see Lockstep.close).
            hb_store = make_store_client(env.master_addr, store.port, HEARTBEAT_STORE_TIMEOUT, self.timeout)
        self._guard = Lockstep(
            store,
            env.rank,
            env.world_size,
            guard_timeout=self.guard_timeout,
            timeout=self.timeout,
            strict=self.lockstep == "strict",
            heartbeat_store=hb_store,
            prefix=f"{scope}/lockstep",
            # NCCL's abort unblocks a collective in flight; gloo's does not (the watchdog then exits).
            abort=self._abort_group if backend == "nccl" else None,
            on_fatal=record_failure,
        )
        self._collectives = Collectives(self._guard, self.root_device)
        _holder.strategy = weakref.ref(self)

    def _take_over(self, env: ClusterEnvironment, backend: str) -> None:
        """Take the process group (and its guard) over from the Fabric that created it in this process.
        Every rank builds its new Fabric at the same point of the script, so the guard's sequence of
        operations stays in step; nothing is exchanged here."""
        previous = _holder.strategy() if _holder.strategy is not None else None
        if previous is None or not previous.holds_group:
            raise MisconfigurationError(
                "torch.distributed is already initialized in this process, but not by a phalanx Fabric that is "
                "still running. Let phalanx create the process group (remove your init_process_group call)."
            )
        differs = [
            f"{name}: {old!r} then {new!r}"
            for name, old, new in (
                ("world size", previous.world_size, env.world_size), ("rank", previous.global_rank, env.rank),
                ("backend", dist.get_backend(), backend), ("timeout", previous.timeout, self.timeout),
                ("guard_timeout", previous.guard_timeout, self.guard_timeout),
                ("lockstep", previous.lockstep, self.lockstep),
            )
            if old != new
        ]
        if differs:
            raise MisconfigurationError(
                f"A second Fabric (or Trainer) in this process shares the first one's process group, so it must "
                f"use the same settings; they differ ({'; '.join(differs)}). Give both the same, or run the "
                "second in its own job."
            )
        self._guard, self._collectives = previous.hand_group_over(self)
        self._owns_group = True
        _holder.strategy = weakref.ref(self)

    @property
    def holds_group(self) -> bool:
        """Whether this strategy runs the process group now (it joined or took it over, and has not handed it
        over or torn down)."""
        return self._guard is not None

    def hand_group_over(self, successor: ParallelStrategy) -> tuple[Lockstep, Collectives]:
        """Give the process group's guard and collectives to ``successor`` (a second Fabric of this process,
        :meth:`_take_over`); this strategy keeps no part of the group and says so if used again."""
        assert self._guard is not None and self._collectives is not None
        handed = self._guard, self._collectives
        self._guard, self._collectives, self._owns_group = None, None, False
        self._successor = weakref.ref(successor)
        return handed

    @staticmethod
    def _abort_group() -> None:
        group = dist.group.WORLD
        abort = getattr(group, "abort", None)
        if callable(abort):
            abort()

    def teardown(self, error: BaseException | None = None) -> None:
        """Leave the job: publish how this rank ended (``error``, or the exception ending the interpreter)
        so peers waiting on it fail at once naming the cause, and destroy the process group."""
        if self._guard is not None:
            ended_by = self._guard.close(error)
            self._guard = None
            if ended_by is not None:
                record_failure(ended_by)
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
            # destroy_process_group does not join gloo's worker threads, and a worker may still hold the
            # last reference to a finished work (its weak refs from a barrier included). Destroying one
            # needs the GIL (its thread-local state holds a Python object); if the interpreter is already
            # finalizing, Python ends that thread with pthread_exit, whose unwind through a noexcept
            # destructor aborts the process: "terminate called without an active exception" after a
            # correct run (seen in core dumps of plain torchrun jobs under load). Giving
            # the workers a moment with the GIL released lets them drop those references first.
            time.sleep(_WORKER_DRAIN_SECONDS)

    @property
    def guard(self) -> Lockstep:
        if self._guard is None:
            raise self._no_group()
        return self._guard

    # Bound methods, not lambdas, are handed to the precision plugin and the async saver: a strategy must
    # pickle (``fabric.launch(fn)`` sends the Fabric's arguments to new processes), and a bound method
    # pickles with its object where a lambda defined in ``__init__`` does not.
    def guarded(self, name: str) -> contextlib.AbstractContextManager[None]:
        """``self.guard.guarded(name)``, resolved when called (the guard exists once the group does)."""
        return self.guard.guarded(name)

    def unguarded(self, name: str) -> contextlib.AbstractContextManager[None]:
        """``self.guard.unguarded(name)``, resolved when called."""
        return self.guard.unguarded(name)

    @property
    def collectives(self) -> Collectives:
        if self._collectives is None:
            raise self._no_group()
        return self._collectives

    def _no_group(self) -> MisconfigurationError:
        if self._successor is not None:
            return MisconfigurationError(
                "This Fabric's process group was taken over by a Fabric (or Trainer) created after it in this "
                "process; run collectives, saves and training through the newer one."
            )
        return MisconfigurationError("The process group is not set up yet: call fabric.launch() first.")

    @property
    def global_rank(self) -> int:
        return self._rank

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def node_rank(self) -> int:
        return self._node_rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str = "barrier") -> None:
        self.collectives.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.collectives.broadcast_object(obj, src)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_gather(tensor)

    def all_gather_object(self, obj: Any, name: str = "all_gather_object") -> list[Any]:
        return self.collectives.all_gather_object(obj, name=name)

    def collectives_issued(self) -> int:
        return self._guard.seq if self._guard is not None else 0

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return self.collectives.all_reduce(tensor, op)

    def max_across_ranks(self, values: list[int], name: str) -> list[int]:
        # Unguarded (a sequence number only, like DDP's gradient all-reduce): a store round trip per step
        # would cost more than the all-reduce; the watchdog still names a rank that never arrives.
        tensor = torch.tensor(values, dtype=torch.int64, device=self.root_device)
        with self.unguarded(name):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [int(v) for v in tensor.tolist()]

    def max_across_ranks_late(self, values: list[int], name: str) -> LateRead:
        tensor = on_device(values, self.root_device)
        with self.unguarded(name):
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
        return LateRead(tensor, work)

    def verify_in_sync(
        self, named: list[tuple[str, torch.Tensor]], what: str, rtol: float = 1e-5, atol: float = 0.0
    ) -> None:
        if not named:
            return
        # Two float64 fingerprints per tensor: enough to catch any real divergence, cheap to gather.
        stats = torch.stack(
            [torch.stack([t.detach().double().sum(), t.detach().double().abs().sum()]) for _, t in named]
        ).to(self.root_device)
        gathered = self.collectives.all_gather(stats, name=f"verify_in_sync({what})").cpu()
        ref = gathered[0]
        for r in range(1, gathered.shape[0]):
            close = torch.isclose(gathered[r], ref, rtol=rtol, atol=atol).all(dim=1)
            if not bool(close.all()):
                i = int((~close).nonzero()[0])
                raise GradientSyncError(
                    f"{what} differ across ranks: first differing tensor is {named[i][0]!r} "
                    f"(rank 0: sum={ref[i, 0]:.6g}, |sum|={ref[i, 1]:.6g}; rank {r}: sum={gathered[r, i, 0]:.6g}, "
                    f"|sum|={gathered[r, i, 1]:.6g}). {int((~close).sum())} of {len(named)} tensors differ."
                )
