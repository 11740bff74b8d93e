"""Fault-tolerant replica groups on torchft: a job is N replica groups, each an ordinary phalanx job inside (one
process, DDP or FSDP); gradients are averaged across groups through torchft's fault-tolerant process group, so a
group that dies stops nobody else, and a group that (re)joins takes the live state from a peer over the network.

Everything that agrees across groups is torchft's (``torchft.Manager``: the quorum with the lighthouse, the
reconfigurable process group, ``should_commit``, the checkpoint transport). What phalanx adds here:

* :class:`FaultTolerance`, the settings (``Fabric(fault_tolerance=...)``, ``Trainer(fault_tolerance=...)``), and
  the environment that names the job's lighthouse and this process's group (:func:`environment`);
* :class:`ReplicaGroups`, one per process: per optimizer step, a quorum, one all-reduce of every gradient across
  the groups that take part (with the count of groups that contributed carried in the same buffer: torchft 0.2.0
  divides by the quorum's size, which counts a group that is healing and contributes zeros), and ``should_commit``
  before the step;
* the state a healing group receives is built and checked by :mod:`phalanx.checkpoint.peer` (checksums, format
  version), sent by :class:`PeerTransport`: torchft's HTTP transport, opened with ``weights_only=True`` (the
  payload is plain values and tensors only, so unpickling it runs no code);
* one line per event (a group left, a group rejoined and how much it received), the count of samples trained
  and skipped, and torchft's own logs in the run's log folder instead of the terminal.

Costs per optimizer step (see docs/faults.md): one quorum request to the group's manager (an RPC; the lighthouse
answers at once when every previous participant asks again), one cross-group all-reduce of the gradients (not
overlapped with backward), and ``should_commit`` (an RPC agreement of the group's ranks). On a GPU, torchft's
``should_commit`` synchronizes the device once per step (torchft 0.2.0, manager.py): the host waits for the
all-reduce there. phalanx itself reads the participants' count late (:class:`~phalanx.utils.late_reads.LateRead`).
"""

from __future__ import annotations

import io
import logging
import os
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from phalanx.distributed import restarts
from phalanx.distributed.launch import record_failure
from phalanx.utils import diagnostics
from phalanx.utils.errors import MisconfigurationError, PhalanxError
from phalanx.utils.late_reads import LateRead

#: torchft's variable: the lighthouse's address (``http://host:port``).
LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"
#: This process's replica group (0 .. NUM_REPLICA_GROUPS-1), and how many groups the job has.
GROUP_VARIABLE = "REPLICA_GROUP_ID"
GROUPS_VARIABLE = "NUM_REPLICA_GROUPS"
#: Set by ``phalanx run --replica-groups N``: fault tolerance on, with at least this many groups per step.
MIN_GROUPS_VARIABLE = "PHALANX_MIN_REPLICA_GROUPS"
#: The pinned torchft release (pyproject's ``ft`` extra).
TORCHFT_VERSION = "0.2.0"


class LighthouseError(PhalanxError):
    """The lighthouse cannot be reached: no quorum can form, so no group can go on."""


@dataclass(frozen=True)
class FaultTolerance:
    """Run this job as one of several fault-tolerant replica groups (torchft).

    Args:
        min_replica_groups: a step commits only when at least this many groups took part in it.
        timeout: seconds a cross-group all-reduce, ``should_commit`` or a state transfer may take; a group that
            froze is dropped after it (its peers' step fails, and the next quorum goes on without it).
        quorum_timeout: seconds a quorum may take to form (a group waits this long for the lighthouse).
        lighthouse: the lighthouse's address; None: ``$TORCHFT_LIGHTHOUSE`` (``phalanx run --replica-groups``
            starts one and sets it).
        replica_group: this process's group; None: ``$REPLICA_GROUP_ID``.
        num_replica_groups: how many groups the job has (each reads its own shard of the data); None:
            ``$NUM_REPLICA_GROUPS``.
    """

    min_replica_groups: int = 1
    timeout: float = 30.0
    quorum_timeout: float = 120.0
    lighthouse: str | None = None
    replica_group: int | None = None
    num_replica_groups: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.min_replica_groups, int) or self.min_replica_groups < 1:
            raise MisconfigurationError(f"FaultTolerance(min_replica_groups={self.min_replica_groups!r}): give a "
                                        "whole number >= 1.")
        if self.timeout <= 0 or self.quorum_timeout <= 0:
            raise MisconfigurationError("FaultTolerance timeouts must be > 0 seconds.")


@dataclass(frozen=True)
class GroupEnvironment:
    """Where this process's group sits in the fault-tolerant job."""

    lighthouse: str
    group: int
    groups: int


def _env_int(name: str, given: int | None) -> int:
    if given is not None:
        return int(given)
    value = os.environ.get(name)
    if value is None:
        raise MisconfigurationError(
            f"fault_tolerance is on but {name} is not set: start the job with `phalanx run --replica-groups N "
            f"script.py` (it starts the lighthouse and sets {LIGHTHOUSE_VARIABLE}, {GROUP_VARIABLE} and "
            f"{GROUPS_VARIABLE} for each group), or set them yourself for each group (docs/faults.md)."
        )
    try:
        return int(value)
    except ValueError:
        raise MisconfigurationError(f"{name}={value!r} is not an integer.") from None


def environment(config: FaultTolerance) -> GroupEnvironment:
    """The lighthouse and this process's group, from ``config`` or the environment."""
    lighthouse = config.lighthouse or os.environ.get(LIGHTHOUSE_VARIABLE)
    groups = _env_int(GROUPS_VARIABLE, config.num_replica_groups)
    group = _env_int(GROUP_VARIABLE, config.replica_group)
    if not lighthouse:
        raise MisconfigurationError(
            f"fault_tolerance is on but no lighthouse is named: set {LIGHTHOUSE_VARIABLE}=http://host:29510 (start "
            f"one with `torchft_lighthouse --min_replicas 1`), or start the job with `phalanx run --replica-groups N`."
        )
    if groups < 1 or not 0 <= group < groups:
        raise MisconfigurationError(f"{GROUP_VARIABLE}={group} must be in [0, {GROUPS_VARIABLE}={groups}).")
    if config.min_replica_groups > groups:
        raise MisconfigurationError(f"min_replica_groups={config.min_replica_groups} but the job has {groups} "
                                    "replica groups: no step could ever commit.")
    return GroupEnvironment(lighthouse, group, groups)


def from_launcher() -> FaultTolerance | None:
    """The settings ``phalanx run --replica-groups`` passes to the script (None when it did not)."""
    value = os.environ.get(MIN_GROUPS_VARIABLE)
    return FaultTolerance(min_replica_groups=int(value)) if value else None


def resolve_fault_tolerance(given: Any) -> FaultTolerance | None:
    """``fault_tolerance=``: a :class:`FaultTolerance`, True (the defaults) or None/False; ``phalanx run
    --replica-groups N`` turns it on for a script that does not (its settings then come from the launcher)."""
    if isinstance(given, FaultTolerance):
        return given
    if given is True:
        return from_launcher() or FaultTolerance()
    if given not in (None, False):
        raise MisconfigurationError(f"fault_tolerance={given!r}: pass phalanx.FaultTolerance(...), True or None.")
    return None if given is False else from_launcher()


def group_folder(root: Path, fault_tolerance: Any) -> Path:
    """Where a Trainer writes (its loggers, checkpoints, its claim on the folder, a preemption record) when it is
    one of several replica groups: ``<root>/replica_group_<i>``. Each group is a run of its own, restarted on its
    own; in one folder the groups would write the same files and the claim would refuse all but the first.
    ``root`` itself without replica groups (``fault_tolerance=`` as :func:`resolve_fault_tolerance` reads it)."""
    config = resolve_fault_tolerance(fault_tolerance)
    return root if config is None else root / f"replica_group_{environment(config).group}"


def require_torchft() -> ModuleType:
    """torchft, or an error that says how to install it."""
    try:
        import torchft as module
    except ImportError as err:
        raise MisconfigurationError(
            f"fault_tolerance needs torchft, which is not installed ({err}). Install it with "
            f"`pip install 'phalanx[ft]'` (torchft=={TORCHFT_VERSION}), or run without fault_tolerance."
        ) from None
    return module  # type: ignore[no-any-return]


def torchft_logs(folder: Path | None, group: int, rank: int) -> None:
    """torchft's Python logs (its quorums, commits, errors) go to ``folder`` (the run's log folder), never to the
    terminal; without a folder they are dropped below WARNING as torchft's own default does."""
    logger = logging.getLogger("torchft")
    logger.propagate = False
    if folder is None or any(isinstance(h, logging.FileHandler) for h in logger.handlers):
        return
    folder.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(folder / f"torchft-group{group}-rank{rank}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


class _WritableReads(io.BytesIO):
    """A stream whose reads are ``bytearray``: torch's streaming loader makes each tensor's storage from the bytes
    it reads, and a tensor on an immutable ``bytes`` object must never be written to (an optimizer's state is)."""

    def read(self, size: int | None = -1) -> bytes:
        return bytearray(super().read(size))  # type: ignore[return-value]


def load_payload(data: bytes) -> Any:
    """A payload as a peer sent it (torch's streaming format), opened with ``weights_only=True``."""
    from torch.distributed._serialization import _streaming_load

    return _streaming_load(_WritableReads(data), weights_only=True)


def _peer_transport(torchft: ModuleType, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, opened with ``weights_only=True`` (torchft opens with False: its
    payloads may hold any object). phalanx's payload holds tensors and plain values only
    (:func:`phalanx.checkpoint.peer.build`), so nothing a peer sends can run code here."""
    from torchft.checkpointing import HTTPTransport

    class PeerTransport(HTTPTransport):  # type: ignore[misc]
        received_bytes = 0
        received_seconds = 0.0

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            import urllib.request

            start = time.perf_counter()
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                data = f.read()
            value = load_payload(data)
            cls.received_bytes, cls.received_seconds = len(data), time.perf_counter() - start
            return value

    return PeerTransport(timeout=timeout, num_chunks=0)


@dataclass
class Tally:
    """What the job did with its samples, counted on every group the same way (and handed to a healing group with
    the state): steps committed, samples trained, and samples skipped: the share of a group that was out or
    healing, and every group's share of a step that did not commit. A group's share of a step is what its ranks
    drew for it (this rank's count times the group's size)."""

    steps: int = 0
    trained: int = 0
    skipped: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps, "trained": self.trained, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps, self.trained, self.skipped = int(state["steps"]), int(state["trained"]), int(state["skipped"])

    def add(self, committed: bool, present: int, groups: int, share: int) -> None:
        if committed:
            self.steps += 1
            self.trained += present * share
            self.skipped += (groups - present) * share
        else:
            self.skipped += groups * share


class ReplicaGroups:
    """This process's part of the fault-tolerant job: torchft's Manager and process group, the per-step agreement,
    and the lines that say what happened.

    ``share(value)`` broadcasts an int from the group's rank 0 to its other ranks (the strategy's broadcast);
    ``send()`` builds the payload a healing peer receives, ``receive(payload)`` checks and applies one.
    """

    def __init__(self, config: FaultTolerance, env: GroupEnvironment, rank: int, world_size: int,
                 device: torch.device, share: Callable[[int], int], log_folder: Path | None) -> None:
        torchft = require_torchft()
        self.config, self.env, self.rank, self.world_size, self.device = config, env, rank, world_size, device
        torchft_logs(log_folder, env.group, rank)
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        # A store of this attempt's own (the group's rank 0 hosts it): torchft's Manager publishes its server's
        # address there, and a restarted attempt must never read the failed one's.
        host = "127.0.0.1" if device.type == "cpu" and os.environ.get("MASTER_ADDR") in (None, "127.0.0.1",
                                                                                          "localhost") else _hostname()
        self._store = TCPStore(host, 0, world_size, rank == 0, wait_for_workers=False) if rank == 0 else None
        port = share(self._store.port if self._store is not None else 0)
        timeout = timedelta(seconds=config.timeout)
        pg = torchft.ProcessGroupGloo(timeout=timeout) if device.type == "cpu" else \
            torchft.ProcessGroupBabyNCCL(timeout=timeout)
        self._transport = _peer_transport(torchft, timeout)
        self.sent: Callable[[], dict[str, Any]] | None = None
        self.received: Callable[[dict[str, Any]], None] | None = None
        self._tally = Tally()
        self._drawn = 0  # samples this rank drew since the last step
        #: Samples one group trains per step, where the loop knows it (the Trainer); else counted from what the
        #: set-up dataloaders drew (:meth:`drew`).
        self.samples_per_step: int | None = None
        self.healed: tuple[int, int, int, float] | None = None  # (step, source group, bytes, seconds)
        self._contributors: set[int] | None = None
        # The last step's contributions, read at the next step's start (a step later: no host wait for them), then
        # whether it committed and the samples a group drew for it.
        self._pending: tuple[LateRead, int] | None = None
        self._last: tuple[LateRead, int, bool, int] | None = None
        host_port = _host_port(env.lighthouse)
        try:  # torchft would retry for its connect timeout; a lighthouse that is not there is said at once
            socket.create_connection(host_port, timeout=min(config.timeout, 10.0)).close()
        except OSError as err:
            raise self._lighthouse_error(err) from None
        self._in_quorum = False
        self._watch = threading.Thread(target=self._watch_lighthouse, name="phalanx-lighthouse-watch", daemon=True)
        try:
            self.manager = torchft.Manager(
                pg=pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=config.min_replica_groups,
                use_async_quorum=True, timeout=timeout, quorum_timeout=timedelta(seconds=config.quorum_timeout),
                connect_timeout=timedelta(seconds=min(config.timeout, 30.0)), rank=rank, world_size=world_size,
                store_addr=host, store_port=port, lighthouse_addr=env.lighthouse,
                replica_id=f"phalanx_group_{env.group}", hostname=host, checkpoint_transport=self._transport,
            )
        except Exception as err:
            raise self._lighthouse_error(err) from None
        self._closed = threading.Event()
        self._watch.start()

    def _watch_lighthouse(self) -> None:
        """While this group waits for a quorum, ask the lighthouse's port every second: a quorum cannot form without
        it, and torchft would wait its whole quorum timeout. Two failed asks in a row end this rank with the error
        (the main thread is blocked inside torchft's wait, which nothing can interrupt; as phalanx's watchdog does for
        a collective that will never complete)."""
        host, port = _host_port(self.env.lighthouse)
        failures = 0
        while not self._closed.wait(1.0):
            if not self._in_quorum:
                failures = 0
                continue
            try:
                socket.create_connection((host, port), timeout=2.0).close()
                failures = 0
            except OSError as err:
                failures += 1
                if failures >= 2 and self._in_quorum:
                    fatal = self._lighthouse_error(err)
                    record_failure(fatal)
                    sys.stderr.write(f"[phalanx] {fatal}\n")
                    sys.stderr.flush()
                    os._exit(1)

    # ------------------------------------------------------------------ the step
    def average(self, grads: list[torch.Tensor]) -> None:
        """Start this step's quorum and average ``grads`` (this rank's gradients, a shard's local part under FSDP)
        over the groups that take part in it, in place. A healing group contributes nothing; the count of groups
        that contributed travels in the same buffer."""
        self._account()  # the previous step, before this one's quorum: what a healing peer receives includes it
        manager = self.manager
        self._in_quorum = True
        try:
            manager.start_quorum()
            manager.wait_quorum()
        except Exception as err:
            raise self._lighthouse_error(err) from None
        finally:
            self._in_quorum = False
        groups = self.env.groups
        flat = [g.reshape(-1) for g in grads]
        dtype = grads[0].dtype if grads else torch.float32
        me = torch.zeros(groups, dtype=dtype, device=self.device)
        me[self.env.group] = 1
        buffer = torch.cat([*flat, me]) if flat else me
        # A healing group (not participating) has its buffer zeroed by torchft: its flag too.
        work = manager.allreduce(buffer, reduce_op=torch.distributed.ReduceOp.SUM)
        work.wait()
        flags = buffer[-groups:]
        count = flags.sum().clamp(min=1)
        if flat:
            buffer[:-groups].div_(count)
            offset = 0
            for g, f in zip(grads, flat):
                g.copy_(buffer[offset:offset + f.numel()].view_as(g))
                offset += f.numel()
        self._pending = (LateRead(flags.detach().clone()), manager.current_step())

    def commit(self) -> bool:
        """torchft's ``should_commit``: whether this group may take the optimizer step (every rank of the group
        gets the same answer). A healing group receives the peer's state in here, before it steps."""
        try:
            ok = bool(self.manager.should_commit())
        except Exception as err:
            raise self._lighthouse_error(err) from None
        if self._pending is not None:
            read, step = self._pending
            share = self.samples_per_step if self.samples_per_step is not None else self._drawn * self.world_size
            self._last, self._pending, self._drawn = (read, step, ok, share), None, 0
        return ok

    def _account(self) -> None:
        """Count the last step (its contributing groups, read late) and say which groups left."""
        last, self._last = self._last, None
        if last is None:
            return
        read, step, committed, share = last
        flags = read.values()
        present = {g for g in range(self.env.groups) if float(flags[g]) > 0}
        self._tally.add(committed, len(present), self.env.groups, share)
        previous, self._contributors = self._contributors, present
        speaker = min(present) if present else None
        if self.rank != 0 or previous is None or speaker != self.env.group:
            return
        for gone in sorted(previous - present):
            diagnostics.notice(f"replica group {gone} left at step {step}; {len(present)} of {self.env.groups} groups "
                               "continue")

    # ------------------------------------------------------------------ healing (torchft's callbacks)
    def _state(self) -> dict[str, Any]:
        if self.sent is None:
            raise PhalanxError("A peer group needs this group's state, but none was registered: call "
                               "fabric.join_replica_groups(state) before the loop.")
        payload = self.sent()
        payload["replica_group"] = self.env.group
        payload["tally"] = self._tally.state_dict()
        return payload

    def _load(self, payload: dict[str, Any]) -> None:
        if self.received is None:
            raise PhalanxError("This group must heal from a peer, but no state was registered to receive it: call "
                               "fabric.join_replica_groups(state) before the loop.")
        self.received(payload)
        self._last = None  # what this group did before it was behind is not the job's: the peer's tally is
        self._tally.load_state_dict(payload["tally"])
        transport = type(self._transport)
        step = self.manager.current_step()
        source = int(payload["replica_group"])
        self.healed = (step, source, int(transport.received_bytes), float(transport.received_seconds))
        mb = transport.received_bytes / 2**20
        restarts.healed(f"replica group {self.env.group} {'rejoined' if step else 'joined'} at step "
                        f"{step}, healed from group {source} ({mb:.2f} MB in {transport.received_seconds:.2f} s)",
                        self.rank)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the job (``fabric.save`` adds it): torchft's manager state (its step and batch
        counts) and the tally."""
        return {"manager": dict(self.manager.state_dict()), "tally": self.tally.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state["manager"])
        self._last = None
        self._tally.load_state_dict(state["tally"])

    @property
    def tally(self) -> Tally:
        """What the job trained and skipped so far (every step counted, the last one included)."""
        self._account()
        return self._tally

    def drew(self, samples: int) -> None:
        """A set-up dataloader drew a batch of ``samples`` on this rank."""
        self._drawn += samples

    # ------------------------------------------------------------------ end
    def summary(self) -> str:
        t = self.tally
        return (f"replica groups: {t.steps} steps committed; samples trained {t.trained}, skipped {t.skipped} "
                "(the share of a group that was out or healing, and of steps that did not commit)")

    def close(self, failed: bool) -> None:
        """Stop torchft's manager; the group that speaks for the job (the lowest that took part in the last step)
        says what was trained, once, after a run that did not fail."""
        self._account()
        present = self._contributors or set()
        if not failed and self.rank == 0 and present and min(present) == self.env.group:
            diagnostics.notice(self.summary())
        self._closed.set()
        self.manager.shutdown(wait=False)

    def _lighthouse_error(self, err: BaseException) -> LighthouseError:
        return LighthouseError(
            f"replica group {self.env.group} cannot reach the torchft lighthouse at {self.env.lighthouse}: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. No quorum can form without it, "
            "so this group stops. Restart the lighthouse (or the job) and run again."
        )


def _hostname() -> str:
    return socket.gethostname()


def _host_port(address: str) -> tuple[str, int]:
    """``http://host:port`` (or ``host:port``) -> (host, port)."""
    parsed = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    return parsed.hostname or "127.0.0.1", parsed.port or 29510


__all__ = ["FaultTolerance", "GroupEnvironment", "LighthouseError", "ReplicaGroups", "Tally", "environment",
           "from_launcher", "load_payload", "require_torchft"]
