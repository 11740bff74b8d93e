"""Guarded, named collectives: a collective called by a subset of ranks fails fast instead of hanging.

Why this exists: gloo and NCCL wait up to the process-group timeout (30 minutes by default) when a
rank never arrives, and then report nothing useful. phalanx sequences every collective it issues and
rendezvouses on the process group's own TCPStore *before* entering the real collective, so a rank
that is gone, or that is inside a different operation, is named within ``guard_timeout`` seconds.

Design (all state lives on the ``Lockstep`` instance; the store is the one the process group uses):

* Every collective-bearing operation gets the next sequence number on every rank. Guarded ops
  (barrier, broadcast, all_gather, all_reduce, save, load, ...) publish ``(name, signature, call
  site)`` under ``op/<seq>/<rank>`` and count arrivals; the last rank to arrive compares what every
  rank published and releases them (or tells all of them what differed).
* Cheap ops that phalanx cannot pre-check without cost (DDP's gradient all-reduce inside
  ``backward``) only bump the sequence number in Python: no store traffic on the hot path.
* A daemon thread publishes a heartbeat every ``heartbeat_interval`` seconds: a beat counter, the
  sequence number, the op the rank is in, and where its main thread is. A waiting rank classifies
  each absent peer as *arriving* (same op), *behind and alive* (keeps waiting: rank 0 writing a big
  file is normal), *in a different operation* (raise at once), or *gone* (beat counter frozen for
  ``guard_timeout`` seconds, or an exit marker: raise).
"""

from __future__ import annotations

import atexit
import datetime
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]

from phalanx.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PhalanxError,
    RankGoneError,
)

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_C10D_FILE = os.path.join(_TORCH_DIR, "distributed", "distributed_c10d.py")
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__))
# Seconds any one heartbeat store call may block (the heartbeat's own client, not the data plane).
HEARTBEAT_STORE_TIMEOUT = 5.0
# How gloo/NCCL/the store word a lost peer; other errors (a shape error in backward) are not diagnosed.
_COMM_FAILURE = re.compile(r"connection|peer|socket|broken pipe|gloo|nccl|timed? ?out", re.IGNORECASE)


def _is_internal(fname: str, skip_torch: bool = True) -> bool:
    return (
        fname.startswith(_PKG_DIR)
        or (skip_torch and fname.startswith(_TORCH_DIR))
        or (fname.startswith(_STDLIB_DIR) and "site-packages" not in fname)
        or fname.startswith("<")
    )


def user_call_site(skip_torch: bool = True) -> str:
    """``file:line (function)`` of the innermost frame outside phalanx (and torch)."""
    frame = sys._getframe(1)
    while frame is not None:
        fname = frame.f_code.co_filename
        if not _is_internal(fname, skip_torch):
            return f"{os.path.basename(fname)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


def _describe_frame_stack(frame: Any) -> tuple[str, str | None]:
    """Where a (foreign) thread is: its innermost user frame, and the torch.distributed function it is
    blocked in, if any."""
    c10d_fn: str | None = None
    user: str | None = None
    while frame is not None:
        fname = frame.f_code.co_filename
        if fname == _C10D_FILE and c10d_fn is None:
            c10d_fn = frame.f_code.co_name
        if user is None and not _is_internal(fname):
            user = f"{os.path.basename(fname)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return user or "<unknown>", c10d_fn


@dataclass
class _PeerState:
    beat: int
    seq: int
    op: str
    in_op: bool
    where: str
    c10d: str | None

    @classmethod
    def parse(cls, raw: bytes) -> _PeerState:
        beat, seq, op, in_op, where, c10d = raw.decode().split("\x1f")
        return cls(int(beat), int(seq), op, in_op == "1", where, c10d or None)


class Lockstep:
    """Sequences this rank's collectives and bounds every wait for its peers (one per process group)."""

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        *,
        guard_timeout: float = 15.0,
        timeout: float = 1800.0,
        strict: bool = False,
        heartbeat_interval: float = 0.5,
        heartbeat_store: Store | None = None,
        prefix: str = "phalanx/lockstep",
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.guard_timeout = float(guard_timeout)
        self.timeout = float(timeout)
        self.strict = strict
        self.heartbeat_interval = heartbeat_interval
        self.prefix = prefix
        self.seq = 0
        self.current_op = "startup"
        self.in_op = False
        self._beat = 0
        self._hb_store = heartbeat_store
        self._stop = threading.Event()
        self._main_ident = threading.main_thread().ident
        self._thread: threading.Thread | None = None
        self._closed = False
        self._publish_heartbeat(self.store)
        if heartbeat_store is not None:
            self._thread = threading.Thread(target=self._heartbeat_loop, name="phalanx-heartbeat", daemon=True)
            self._thread.start()
        atexit.register(self.close)

    # ------------------------------------------------------------------ heartbeat
    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _publish_heartbeat(self, store: Store) -> None:
        self._beat += 1
        where, c10d = "<unknown>", None
        frame = sys._current_frames().get(self._main_ident or -1)
        if frame is not None:
            where, c10d = _describe_frame_stack(frame)
        payload = "\x1f".join(
            [str(self._beat), str(self.seq), self.current_op, "1" if self.in_op else "0", where, c10d or ""]
        )
        store.set(self._key("hb", self.rank), payload)

    def _heartbeat_loop(self) -> None:
        assert self._hb_store is not None
        while not self._stop.wait(self.heartbeat_interval):
            try:
                self._publish_heartbeat(self._hb_store)
            except Exception:
                # The store's host may be exiting at the end of a job; waiters notice a frozen beat.
                if self._stop.wait(self.heartbeat_interval * 4):
                    return

    def close(self) -> None:
        """Mark this rank as exited (so peers waiting on it fail at once) and stop the heartbeat."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        try:
            self.store.set(self._key("exit", self.rank), f"{self.seq}\x1f{self.current_op}")
        except Exception:
            pass
        if self._thread is not None:
            # The thread must be out of C++ before the interpreter finalizes: on Python <= 3.13 a daemon
            # thread that wakes from a GIL-released store call during finalization is ended with
            # pthread_exit, whose forced unwind through pybind11's noexcept GIL guard aborts the process
            # ("terminate called without an active exception") after the job's work is done. Each
            # heartbeat call is bounded by HEARTBEAT_STORE_TIMEOUT, so this join always finishes.
            bound = HEARTBEAT_STORE_TIMEOUT + 2 * self.heartbeat_interval + 1
            self._thread.join(timeout=bound)
            if self._thread.is_alive():
                warnings.warn(
                    f"phalanx: the lockstep heartbeat thread did not stop within {bound:.0f}s; "
                    "the process may abort at exit.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        atexit.unregister(self.close)

    # ------------------------------------------------------------------ sequencing
    @contextmanager
    def unguarded(self, name: str) -> Iterator[None]:
        """An op whose collectives phalanx does not pre-check (DDP's backward all-reduce): it only takes a
        sequence number, so peers waiting at a guarded op know this rank went somewhere else."""
        self.seq += 1
        self.current_op, self.in_op = name, True
        try:
            yield
        except RuntimeError as err:
            self._explain_failure(name, self.seq, err)
            raise
        finally:
            self.in_op = False

    @contextmanager
    def guarded(self, name: str, signature: str = "") -> Iterator[None]:
        """Rendezvous with every rank on ``name`` before the body runs the real collective."""
        if self._closed:
            raise RankGoneError(f"{name}: this rank's process group was already shut down")
        self.seq += 1
        seq = self.seq
        self.current_op, self.in_op = name, True
        site = user_call_site()
        try:
            self._arrive(seq, name, signature, site)
            yield
        except RuntimeError as err:
            self._explain_failure(name, seq, err)
            raise
        finally:
            self.in_op = False

    # ------------------------------------------------------------------ failures inside torch
    def _explain_failure(self, name: str, seq: int, err: RuntimeError) -> None:
        """A collective failed inside torch (gloo: "Connection closed by peer"); such errors never say which
        rank is gone. If the store shows one, raise RankGoneError naming it; otherwise let ``err`` go on."""
        if isinstance(err, PhalanxError) or not _COMM_FAILURE.search(str(err)):
            return
        gone = self._find_gone_peer()
        if gone is not None:
            first = (str(err).strip().splitlines() or [""])[0][:300]
            raise RankGoneError(
                f"{name} (collective #{seq}) failed on rank {self.rank} because {gone}. "
                f"torch reported: {type(err).__name__}: {first}"
            ) from err

    def _find_gone_peer(self) -> str | None:
        """Look for an exited or frozen peer for up to ``guard_timeout`` seconds."""
        deadline = time.monotonic() + self.guard_timeout
        frozen_after = 4 * self.heartbeat_interval  # a collective already failed: a short window suffices
        seen: dict[int, tuple[int, float]] = {}
        while True:
            now = time.monotonic()
            try:
                for r in range(self.world_size):
                    if r == self.rank:
                        continue
                    if self.store.check([self._key("exit", r)]):
                        ex_seq, ex_op = self.store.get(self._key("exit", r)).decode().split("\x1f")
                        return f"rank {r} has shut down (its last operation was {ex_op!r}, #{ex_seq})"
                    if not self.store.check([self._key("hb", r)]):
                        continue
                    peer = _PeerState.parse(self.store.get(self._key("hb", r)))
                    prev = seen.get(r)
                    if prev is None or prev[0] != peer.beat:
                        seen[r] = (peer.beat, now)
                    elif now - prev[1] > frozen_after:
                        return (
                            f"rank {r} stopped sending heartbeats (last seen in {peer.op!r} #{peer.seq} at "
                            f"{peer.where}); it was killed or crashed"
                        )
            except Exception:
                # The store lives in rank 0's process (or the launcher's agent): unreachable means it is gone.
                return None if self.rank == 0 else "rank 0 is gone (the store it hosts is unreachable)"
            if now > deadline:
                return None
            time.sleep(0.1)

    def _arrive(self, seq: int, name: str, signature: str, site: str) -> None:
        store = self.store
        store.set(self._key(seq, "op", self.rank), "\x1f".join([name, signature, site]))
        arrived = store.add(self._key(seq, "arrived"), 1)
        go_key = self._key(seq, "go")
        if arrived == self.world_size:
            verdict = self._compare(seq)
            store.set(go_key, verdict)
        else:
            self._wait_for(go_key, seq, name, site)
            verdict = store.get(go_key).decode()
        # Every rank has passed seq-1 (all of them arrived at seq): its keys can go.
        if seq > 1:
            try:
                store.delete_key(self._key(seq - 1, "op", self.rank))
                if self.rank == 0:
                    store.delete_key(self._key(seq - 1, "arrived"))
                    store.delete_key(self._key(seq - 1, "go"))
            except Exception:
                pass
        if verdict != "ok":
            raise CollectiveMismatchError(verdict)

    def _compare(self, seq: int) -> str:
        raw = self.store.multi_get([self._key(seq, "op", r) for r in range(self.world_size)])
        entries = [b.decode().split("\x1f") for b in raw]
        ref = entries[0]
        for r, entry in enumerate(entries[1:], start=1):
            if entry[0] != ref[0] or entry[1] != ref[1] or (self.strict and entry[2] != ref[2]):
                what = "operations" if entry[0] != ref[0] else (
                    "tensor shapes/dtypes" if entry[1] != ref[1] else "call sites (lockstep='strict')"
                )
                return (
                    f"Ranks called different {what} as collective #{seq}: "
                    f"rank 0 called {_fmt(ref)}, rank {r} called {_fmt(entry)}. "
                    "Every rank must issue the same collectives in the same order; look for a collective "
                    "inside a rank-dependent branch."
                )
        return "ok"

    # ------------------------------------------------------------------ waiting
    def _wait_for(self, go_key: str, seq: int, name: str, site: str) -> None:
        store = self.store
        start = time.monotonic()
        next_check = start + 0.2
        delay = 1e-4
        last_seen: dict[int, tuple[int, float]] = {}
        c10d_since: dict[int, float] = {}
        warned = False
        while True:
            try:
                if store.check([go_key]):
                    return
            except Exception as err:
                raise RankGoneError(
                    f"{name} (collective #{seq}, called at {site}): lost contact with the rendezvous store "
                    f"({type(err).__name__}: {err}). The rank hosting it (usually rank 0) has exited."
                ) from err
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.25
                warned = self._check_peers(
                    seq, name, site, start, now, last_seen, c10d_since, warned
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _check_peers(
        self,
        seq: int,
        name: str,
        site: str,
        start: float,
        now: float,
        last_seen: dict[int, tuple[int, float]],
        c10d_since: dict[int, float],
        warned: bool,
    ) -> bool:
        store = self.store
        waited = now - start
        here = f"{name} (collective #{seq}, called at {site} on rank {self.rank})"
        missing = [r for r in range(self.world_size) if not store.check([self._key(seq, "op", r)])]
        behind: list[str] = []
        for r in missing:
            if store.check([self._key("exit", r)]):
                ex_seq, ex_op = store.get(self._key("exit", r)).decode().split("\x1f")
                raise RankGoneError(
                    f"{here} is waiting for rank(s) {missing}, but rank {r} has shut down "
                    f"(its last operation was {ex_op!r}, #{ex_seq}). A collective must be called on "
                    "every rank: look for it inside `if fabric.global_rank == 0:` or a rank-dependent branch."
                )
            if not store.check([self._key("hb", r)]):
                continue
            peer = _PeerState.parse(store.get(self._key("hb", r)))
            seen = last_seen.get(r)
            if seen is None or seen[0] != peer.beat:
                last_seen[r] = (peer.beat, now)
            elif now - seen[1] > self.guard_timeout:
                raise RankGoneError(
                    f"{here} is waiting for rank(s) {missing}; rank {r} has not sent a heartbeat for "
                    f"{now - seen[1]:.1f}s (last seen in {peer.op!r} #{peer.seq} at {peer.where}). "
                    "It was killed or is frozen."
                )
            if peer.seq > seq or (peer.seq == seq and peer.op != name):
                raise CollectiveMismatchError(
                    f"{here} is waiting for rank(s) {missing}, but rank {r} is in a different operation: "
                    f"{peer.op!r} (#{peer.seq}) at {peer.where}. A collective was called on only some "
                    "ranks; look for it inside `if fabric.global_rank == 0:` or a rank-dependent branch."
                )
            if peer.c10d is not None:
                first = c10d_since.setdefault(r, now)
                if now - first > self.guard_timeout:
                    raise CollectiveMismatchError(
                        f"{here} is waiting for rank(s) {missing}, but rank {r} has been blocked for "
                        f"{now - first:.0f}s inside torch.distributed.{peer.c10d} at {peer.where}, a "
                        "collective this rank will not join. Call collectives on every rank, in the same order."
                    )
            else:
                c10d_since.pop(r, None)
            behind.append(f"rank {r} at {peer.where} (after {peer.op!r} #{peer.seq})")
        if waited > self.timeout:
            raise CollectiveTimeoutError(
                f"{here} timed out after {waited:.0f}s waiting for rank(s) {missing}: "
                f"{'; '.join(behind) or 'no heartbeat'}. Raise the strategy's `timeout` if this work is "
                "legitimately this slow."
            )
        if not warned and waited > self.guard_timeout and behind:
            print(
                f"[phalanx] rank {self.rank} has waited {waited:.0f}s in {here} for {'; '.join(behind)}; "
                f"they are alive, so waiting up to timeout={self.timeout:.0f}s.",
                file=sys.stderr,
                flush=True,
            )
            return True
        return warned


def _fmt(entry: Sequence[str]) -> str:
    name, signature, site = entry
    return f"{name}{'(' + signature + ')' if signature else ''} at {site}"


def tensor_signature(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)}:{str(tensor.dtype).removeprefix('torch.')}"


_REDUCE_OPS: dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # divided by world size afterwards: gloo has no AVG
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


class Collectives:
    """The named collectives of one process group, each behind the lockstep guard."""

    def __init__(self, guard: Lockstep, device: torch.device, group: Any = None) -> None:
        self.guard = guard
        self.device = device
        self.group = group
        self.world_size = guard.world_size

    def barrier(self, name: str = "barrier") -> None:
        with self.guard.guarded(name):
            dist.barrier(group=self.group)

    def broadcast_object(self, obj: Any, src: int = 0, name: str = "broadcast") -> Any:
        with self.guard.guarded(name, f"src={src}"):
            box = [obj]
            dist.broadcast_object_list(box, src=src, group=self.group, device=self._object_device())
            return box[0]

    def all_gather(self, tensor: torch.Tensor, name: str = "all_gather") -> torch.Tensor:
        tensor = tensor.contiguous()
        with self.guard.guarded(name, tensor_signature(tensor)):
            out = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(out, tensor, group=self.group)
        return torch.stack(out)

    def all_gather_object(self, obj: Any, name: str = "all_gather_object") -> list[Any]:
        with self.guard.guarded(name):
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean", name: str = "all_reduce") -> torch.Tensor:
        key = op.lower() if isinstance(op, str) else op
        if key not in _REDUCE_OPS:
            raise ValueError(f"Unknown reduce_op {op!r}. Choose one of {sorted(_REDUCE_OPS)}.")
        out = tensor.clone()
        with self.guard.guarded(name, f"{key}:{tensor_signature(tensor)}"):
            dist.all_reduce(out, op=_REDUCE_OPS[key], group=self.group)
        if key in ("mean", "avg"):
            out = out / self.world_size if torch.is_floating_point(out) else out.div(self.world_size)
        return out

    def all_reduce_grads(self, grads: list[torch.Tensor], name: str = "grad_all_reduce") -> None:
        """Average ``grads`` in place across ranks (coalesced: one collective per dtype)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        sig = ",".join(f"{str(d).removeprefix('torch.')}x{sum(t.numel() for t in ts)}" for d, ts in by_dtype.items())
        with self.guard.guarded(name, sig):
            for ts in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in ts])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
                flat.div_(self.world_size)
                offset = 0
                for t in ts:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view_as(t))
                    offset += n

    def _object_device(self) -> torch.device | None:
        return self.device if dist.get_backend(self.group) == "nccl" else None


def to_timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def make_store_client(host: str, port: int, timeout: float) -> Store:
    return TCPStore(host, port, None, False, to_timedelta(timeout), wait_for_workers=False)

