"""Every rank's watchdog: heartbeats, peer diagnosis, and ending a rank that can no longer finish.

The failure this file exists to prevent: a collective blocks in C++ (gloo, NCCL, DDP's gradient
reducer, FSDP's all-gathers, a raw ``torch.distributed`` call, DeepSpeed's, torchmetrics' sync) for the
whole process-group timeout, 30 minutes by default, when a peer is dead, frozen (SIGSTOP, a debugger,
a stuck data worker) or inside a different collective, and then reports nothing about the peer. No
Python code around the call can interrupt it. So every rank runs one daemon thread that:

* publishes this rank's heartbeat every ``interval`` seconds: a beat counter, the operation it is in
  (sequence number, name, phase), where its main thread is (``file:line``, and the
  ``torch.distributed`` function if it is blocked in one), its pid and host, and at exit its final
  status (finished, or failed with which exception where);
* while the main thread waits at a phalanx rendezvous (a guarded collective), looks at the ranks that
  have not arrived; if one never can (it exited, failed, froze, or is inside another operation), it
  writes that verdict into the rendezvous key, so every waiting rank wakes up and raises it;
* while the main thread is blocked inside a collective, looks at its two ring neighbours and at the
  job's event log. If the collective can never complete, it ends this rank with the diagnosis: the
  process group is aborted where that unblocks the call (NCCL), otherwise the process prints the
  diagnosis and its main thread's stack and exits, as NCCL's own watchdog does. Before that it
  appends the cause to the event log, so every other rank names the true cause, not a symptom.

A rank that is alive and merely slow (rank 0 writing a 50 GB checkpoint) is waited for up to
``timeout``. Cost: nothing beyond the heartbeat while nobody waits; while a rank waits, O(1) store
requests per check (the missing ranks of a rendezvous, or two neighbours plus the event log), so the
job's store load grows as O(ranks), not O(ranks^2). Why neighbours suffice: if ranks are not all in
the same state, some adjacent pair on the ring differs, and a dead or frozen rank is watched by both
of its neighbours; what one rank learns it appends to the event log that all the others read.

The records ranks exchange are in :mod:`phalanx.distributed.heartbeat`, the "where is this code"
helpers in :mod:`phalanx.distributed.callsites`; this module is the thread that uses them.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from phalanx.distributed.callsites import describe_frame_stack
from phalanx.distributed.heartbeat import (
    FIELD,
    HEARTBEAT_STORE_TIMEOUT,
    RECORD,
    Event,
    Keys,
    OpState,
    PeerState,
    Verdict,
    append,
)
from phalanx.utils.diagnostics import notice

if TYPE_CHECKING:
    from torch.distributed import Store  # type: ignore[attr-defined]

# A rendezvous is checked once it has waited this long (peers normally arrive within milliseconds).
RENDEZVOUS_CHECK_AFTER = 0.2
# How long an aborted process group gets to unblock the main thread before the process exits.
ABORT_GRACE = 10.0


class Watchdog:
    """One rank's heartbeat publisher and peer watcher (see the module docstring).

    Args:
        state: returns the owner's current :class:`OpState`.
        store: a store client of its own, whose calls are bounded (HEARTBEAT_STORE_TIMEOUT).
        main_thread: ident of the thread whose location is published and watched.
        abort: unblocks a collective in flight (NCCL's abort), or None where nothing can (gloo).
        on_fatal: called with the error just before the process exits (records it for the launcher).
        exit: how the process ends (``os._exit``; tests pass a fake).
    """

    def __init__(
        self,
        *,
        store: Store,
        keys: Keys,
        rank: int,
        world_size: int,
        state: Callable[[], OpState],
        guard_timeout: float,
        timeout: float,
        interval: float,
        main_thread: int | None,
        abort: Callable[[], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        self.store, self.keys, self.rank, self.world_size = store, keys, rank, world_size
        self.state = state
        self.guard_timeout, self.timeout, self.interval = guard_timeout, timeout, interval
        # Blocked in a collective this long before looking at peers: normal collectives take milliseconds,
        # and a long backward must not cost store traffic.
        self.check_after = min(2.0, max(RENDEZVOUS_CHECK_AFTER, guard_timeout / 4))
        self.main_thread = main_thread
        self.abort, self.on_fatal, self._exit_process = abort, on_fatal, exit
        self.pid, self.host = os.getpid(), socket.gethostname()
        self.beat = 0
        self.status, self.detail = "", ""
        self.verdict: Verdict | None = None
        self.waiting_report = ""  # what the last rendezvous check saw (for a timeout message)
        self._where, self._c10d, self._c10d_since = "<unknown>", "", 0.0
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (beat, first seen at that beat)
        self._stuck: dict[int, tuple[tuple[int, str, str], float]] = {}  # rank -> (position, since)
        self._exits_seen: dict[int, float] = {}
        self._noticed: tuple[int, str] | None = None
        self._store_down_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="phalanx-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> bool:
        """Stop and join; True when the thread is out of every store call. Each call is bounded by the
        client's timeout, so this always finishes (see Lockstep.close for why it must)."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout=HEARTBEAT_STORE_TIMEOUT + 2 * self.interval + 1)
        return not self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.publish(self.store)
                self._store_down_since = None
            except Exception:
                # The store's host may be exiting at the end of a job; peers notice a frozen beat.
                now = time.monotonic()
                self._store_down_since = self._store_down_since or now
                self._store_unreachable(now)
                continue
            try:
                self.check()
            except Exception:  # a store hiccup while reading peers: look again at the next beat
                pass

    # ------------------------------------------------------------------ heartbeat
    def record(self) -> PeerState:
        state = self.state()
        frame = sys._current_frames().get(self.main_thread or -1)
        where, c10d = describe_frame_stack(frame) if frame is not None else ("<unknown>", "")
        now = time.monotonic()
        if c10d and c10d != self._c10d:
            self._c10d_since = now
        self._where, self._c10d = where, c10d
        self.beat += 1
        return PeerState(self.rank, self.beat, state.seq, state.name, state.phase, where, c10d, self.status,
                         self.detail, self.pid, self.host)

    def publish(self, store: Store) -> None:
        store.set(self.keys.hb(self.rank), self.record().encode())

    def finish(self, store: Store, status: str, detail: str) -> None:
        """Publish this rank's end (called once the thread is stopped) and log it for everyone."""
        self.status, self.detail = status, detail
        self.publish(store)
        state = self.state()
        append(store, self.keys.events, Event(self.rank, status, state.seq, state.name, detail).encode())

    # ------------------------------------------------------------------ reading peers
    def read_peers(self, ranks: Iterable[int], store: Store | None = None) -> list[PeerState]:
        ranks = list(ranks)
        if not ranks:
            return []
        raw = (store or self.store).multi_get([self.keys.hb(r) for r in ranks])
        return [PeerState.decode(r, b) for r, b in zip(ranks, raw)]

    def read_events(self, store: Store | None = None) -> list[Event]:
        return [e for e in Event.decode_all((store or self.store).get(self.keys.events)) if e.rank != self.rank]

    def _frozen_for(self, peer: PeerState, now: float) -> float:
        seen = self._beats.get(peer.rank)
        if seen is None or seen[0] != peer.beat:
            self._beats[peer.rank] = (peer.beat, now)
            return 0.0
        return now - seen[1]

    def _stuck_for(self, peer: PeerState, now: float) -> float:
        """How long ``peer`` has been blocked at its current position (0 when not blocked)."""
        if not peer.blocked:
            self._stuck.pop(peer.rank, None)
            return 0.0
        seen = self._stuck.get(peer.rank)
        if seen is None or seen[0] != peer.position():
            self._stuck[peer.rank] = (peer.position(), now)
            return 0.0
        return now - seen[1]

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        state = self.state()
        now = time.monotonic()
        if state.phase == "rendezvous":
            if now - state.since >= RENDEZVOUS_CHECK_AFTER:
                self._check_rendezvous(state, now)
            return
        if state.phase == "collective" or self._c10d:
            since = state.since if state.phase == "collective" else self._c10d_since
            if now - since >= self.check_after:
                self._check_collective(state, now, since)
            return
        self._beats.clear()
        self._stuck.clear()
        self._exits_seen.clear()

    def _check_rendezvous(self, state: OpState, now: float) -> None:
        records = self.store.get(self.keys.ops(state.seq)).decode().split(RECORD)
        arrived = {int(r.split(FIELD, 1)[0]) for r in records if r}
        missing = [r for r in range(self.world_size) if r not in arrived]
        if not missing:
            return  # the last rank is about to release everyone
        here = state.here(self.rank)
        waiting: list[str] = []
        for peer in self.read_peers(missing):
            verdict = self.assess_missing(state, peer, missing, now)
            if verdict is not None:
                self.store.compare_set(self.keys.go(state.seq), "", verdict.encode())
                return
            waiting.append(f"rank {peer.rank} at {peer.where} (after {peer.op!r} #{peer.seq})")
        self.waiting_report = "; ".join(waiting)
        waited = now - state.since
        if waited > self.guard_timeout and self._noticed != (state.seq, state.name):
            self._noticed = (state.seq, state.name)
            notice(f"rank {self.rank} has waited {waited:.0f}s in {here} for {self.waiting_report}; they are "
                   f"alive, so waiting up to timeout={self.timeout:.0f}s.")

    def assess_missing(self, state: OpState, peer: PeerState, missing: list[int], now: float) -> Verdict | None:
        """Can ``peer``, which has not arrived at this rank's rendezvous, still arrive?"""
        here = state.here(self.rank)
        r = peer.rank
        if peer.status == "failed":
            return Verdict("gone", f"{here} is waiting for rank(s) {missing}, but rank {r} {peer.ending()}. "
                                   f"That error is the cause; this rank cannot continue without rank {r}.")
        if peer.status:
            return Verdict("gone", f"{here} is waiting for rank(s) {missing}, but rank {r} {peer.ending()}. "
                                   "A collective must be called on every rank: look for it inside "
                                   "`if fabric.global_rank == 0:` or a rank-dependent branch.")
        frozen = self._frozen_for(peer, now)
        if frozen > self.guard_timeout:
            return Verdict("gone", f"{here} is waiting for rank(s) {missing}; rank {r} has not sent a heartbeat "
                                   f"for {frozen:.1f}s (last seen in {peer.describe()}, {peer.process()}). "
                                   "It was killed or is frozen.")
        if peer.seq > state.seq or (peer.seq == state.seq and peer.op != state.name):
            return Verdict("mismatch", f"{here} is waiting for rank(s) {missing}, but rank {r} is in a different "
                                       f"operation: {peer.op!r} (#{peer.seq}) at {peer.where}. A collective was "
                                       "called on only some ranks; look for it inside `if fabric.global_rank == 0:` "
                                       "or a rank-dependent branch.")
        stuck = self._stuck_for(peer, now)
        if peer.c10d and stuck > self.guard_timeout:
            return Verdict("mismatch", f"{here} is waiting for rank(s) {missing}, but rank {r} has been blocked for "
                                       f"{stuck:.0f}s inside torch.distributed.{peer.c10d} at {peer.where}, a "
                                       "collective this rank will not join. Call collectives on every rank, in "
                                       "the same order.")
        return None

    def _check_collective(self, state: OpState, now: float, since: float) -> None:
        if state.phase == "collective":
            here = state.here(self.rank, self._where)
        else:
            here = f"torch.distributed.{self._c10d} (called at {self._where} on rank {self.rank})"
        blocked = now - since
        verdict = self.assess_events(here, state, now)
        if verdict is None:
            neighbours = sorted({(self.rank - 1) % self.world_size, (self.rank + 1) % self.world_size} - {self.rank})
            for peer in self.read_peers(neighbours):
                verdict = self.assess_neighbour(here, peer, now, blocked)
                if verdict is not None:
                    break
        if verdict is None and blocked > self.timeout:
            verdict = Verdict("timeout", f"{here} has been blocked for {blocked:.0f}s, longer than timeout="
                                         f"{self.timeout:.0f}s, while its peers are alive. Raise the strategy's "
                                         "`timeout` if this work is legitimately this slow.")
        if verdict is not None:
            self.fail(verdict)

    def assess_events(self, here: str, state: OpState, now: float) -> Verdict | None:
        """The event log: a rank that failed, or that left before this collective could complete."""
        events = self.read_events()
        failed = next((e for e in events if e.kind == "failed"), None)
        if failed is not None:
            return Verdict("gone", f"{here} cannot complete: rank {failed.rank} failed: {failed.detail}")
        for event in events:
            first = self._exits_seen.setdefault(event.rank, now)
            # A rank that left after this collective's number may still have done its part of it: give the
            # transfer time to finish. One that left before it never joined.
            if event.seq < state.seq or now - first > self.guard_timeout:
                return Verdict("gone", f"{here} cannot complete: rank {event.rank} has shut down ({event.detail}; "
                                       f"its last operation was {event.op!r}, #{event.seq}). A collective must be "
                                       "called on every rank: look for it inside `if fabric.global_rank == 0:` or "
                                       "a rank-dependent branch.")
        return None

    def assess_neighbour(self, here: str, peer: PeerState, now: float, blocked: float) -> Verdict | None:
        r = peer.rank
        if peer.status:
            return Verdict("gone", f"{here} cannot complete: rank {r} {peer.ending()}")
        frozen = self._frozen_for(peer, now)
        if frozen > self.guard_timeout:
            return Verdict("gone", f"{here} cannot complete: rank {r} has not sent a heartbeat for {frozen:.1f}s "
                                   f"(last seen in {peer.describe()}, {peer.process()}). It was killed or is frozen.")
        mine = self.state()
        stuck = self._stuck_for(peer, now)
        # A neighbour behind this rank (a long forward, a slow data loader) is on its way. One blocked past
        # this collective's number, or at the same number in another collective, never joins it.
        here_pos = (mine.seq, mine.name if mine.phase != "idle" else "", self._c10d)
        ahead = peer.seq > mine.seq or (peer.seq == mine.seq and peer.position() != here_pos)
        if ahead and min(stuck, blocked) > self.guard_timeout:
            return Verdict("mismatch", f"{here} cannot complete: rank {r} has been blocked for {stuck:.0f}s in a "
                                       f"different collective, {peer.describe()}. Ranks must issue the same "
                                       "collectives in the same order; look for a collective, or a forward/backward "
                                       "of a DDP/FSDP model, that runs on only some ranks.")
        if blocked > self.guard_timeout and not peer.blocked and self._noticed != (mine.seq, here):
            self._noticed = (mine.seq, here)
            notice(f"rank {self.rank} has been blocked {blocked:.0f}s in {here}; rank {r} is alive at {peer.where} "
                   f"(after {peer.op!r} #{peer.seq}), so waiting up to timeout={self.timeout:.0f}s.")
        return None

    def _store_unreachable(self, now: float) -> None:
        state = self.state()
        down = now - (self._store_down_since or now)
        if self.rank == 0 or state.phase == "idle" or down < self.guard_timeout:
            return
        self.fail(Verdict("gone", f"{state.here(self.rank)} cannot complete: the rendezvous store has been "
                                  f"unreachable for {down:.0f}s. The process hosting it (rank 0, or the launcher) "
                                  "has exited."), publish=False)

    # ------------------------------------------------------------------ after a torch error
    def explain(self, state: OpState, store: Store, here: str | None = None) -> Verdict | None:
        """A collective failed inside torch ("Connection closed by peer" never says which rank). Look for
        a rank that failed, exited or stopped beating, for up to ``guard_timeout``."""
        here = here or state.here(self.rank)
        deadline = time.monotonic() + self.guard_timeout
        frozen_after = 4 * self.interval  # a collective already failed: a short window suffices
        beats: dict[int, tuple[int, float]] = {}
        others = [r for r in range(self.world_size) if r != self.rank]
        while True:
            now = time.monotonic()
            try:
                failed = next((e for e in self.read_events(store) if e.kind == "failed"), None)
                if failed is not None:
                    return Verdict("gone", f"{here} failed on rank {self.rank} because rank {failed.rank} failed: "
                                           f"{failed.detail}")
                for peer in self.read_peers(others, store):
                    if peer.status:
                        return Verdict("gone", f"{here} failed on rank {self.rank} because rank {peer.rank} "
                                               f"{peer.ending()}")
                    seen = beats.get(peer.rank)
                    if seen is None or seen[0] != peer.beat:
                        beats[peer.rank] = (peer.beat, now)
                    elif now - seen[1] > frozen_after:
                        return Verdict("gone", f"{here} failed on rank {self.rank} because rank {peer.rank} stopped "
                                               f"sending heartbeats (last seen in {peer.describe()}); it was killed "
                                               "or crashed")
            except Exception:
                # The store lives in rank 0's process (or the launcher's agent): unreachable means it is gone.
                if self.rank == 0:
                    return None
                return Verdict("gone", f"{here} failed on rank {self.rank} because rank 0 is gone (the store it "
                                       "hosts is unreachable)")
            if now > deadline:
                return None
            time.sleep(0.1)

    # ------------------------------------------------------------------ ending this rank
    def fail(self, verdict: Verdict, publish: bool = True) -> None:
        """End this rank: nothing can complete the collective it is blocked in."""
        self.verdict = verdict
        error = verdict.error()
        if publish:
            try:
                self.finish(self.store, "failed", f"{type(error).__name__}: {verdict.message}")
            except Exception:
                pass
        state = self.state()
        if self.abort is not None:
            try:
                self.abort()
            except Exception:
                pass
            deadline = time.monotonic() + ABORT_GRACE
            while time.monotonic() < deadline:  # the main thread's call raises; Lockstep re-raises the verdict
                if self.state() is not state:
                    self._stop.set()
                    return
                time.sleep(0.05)
        frame = sys._current_frames().get(self.main_thread or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "  <unknown>\n"
        sys.stderr.write(
            f"[phalanx] rank {self.rank} is ending: {type(error).__name__}: {verdict.message}\n"
            f"[phalanx] rank {self.rank}'s main thread was blocked here:\n{stack}"
        )
        sys.stderr.flush()
        if self.on_fatal is not None:
            try:
                self.on_fatal(error)
            except Exception:
                pass
        self._stop.set()
        self._exit_process(1)


__all__ = [
    "ABORT_GRACE",
    "HEARTBEAT_STORE_TIMEOUT",
    "RENDEZVOUS_CHECK_AFTER",
    "Event",
    "Keys",
    "OpState",
    "PeerState",
    "Verdict",
    "Watchdog",
]
