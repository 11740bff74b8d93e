"""What ranks publish to each other through the store: the records and their wire format.

Each rank's heartbeat (:class:`PeerState`), what its main thread is doing (:class:`OpState`), the job's
event log (:class:`Event`), a rendezvous' verdict (:class:`Verdict`) and the store keys of one lockstep
group (:class:`Keys`). They are a protocol between processes, read by the watchdog thread and written
by the lockstep guard on the main thread, so they live apart from both: either side can change how it
decides without touching the format the other side parses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from phalanx.utils.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, RankGoneError

if TYPE_CHECKING:
    from torch.distributed import Store  # type: ignore[attr-defined]

FIELD, RECORD = "\x1f", "\x1e"
# Seconds any one heartbeat store call may block (the heartbeat's own client, not the data plane).
HEARTBEAT_STORE_TIMEOUT = 5.0

PHASES = ("idle", "rendezvous", "collective")


def append(store: Store, key: str, value: str) -> None:
    """``store.append`` (TCPStore and HashStore have it; torch's type stubs do not list it)."""
    store.append(key, value)  # type: ignore[attr-defined]


def _clean(text: str) -> str:
    return text.replace(FIELD, " ").replace(RECORD, " ")


@dataclass(frozen=True)
class OpState:
    """What this rank's main thread is doing, replaced as a whole (so other threads read it atomically)."""

    seq: int
    name: str
    phase: str  # one of PHASES
    site: str
    since: float  # time.monotonic() when this phase began

    def here(self, rank: int, where: str | None = None) -> str:
        at = where if where is not None else self.site
        called = f"called at {at} " if at else ""  # unguarded ops (DDP's all-reduce) record no call site
        return f"{self.name} (collective #{self.seq}, {called}on rank {rank})"


@dataclass(frozen=True)
class PeerState:
    """One rank's heartbeat record as the others read it."""

    rank: int
    beat: int
    seq: int
    op: str
    phase: str
    where: str
    c10d: str
    status: str  # "" while running, "exited" or "failed" at the end
    detail: str
    pid: int
    host: str

    def encode(self) -> str:
        return FIELD.join(_clean(str(v)) for v in (
            self.beat, self.seq, self.op, self.phase, self.where, self.c10d, self.status, self.detail, self.pid,
            self.host,
        ))

    @classmethod
    def decode(cls, rank: int, raw: bytes) -> PeerState:
        beat, seq, op, phase, where, c10d, status, detail, pid, host = raw.decode().split(FIELD)
        return cls(rank, int(beat), int(seq), op, phase, where, c10d, status, detail, int(pid), host)

    @property
    def blocked(self) -> bool:
        return self.phase != "idle" or bool(self.c10d)

    def position(self) -> tuple[int, str, str]:
        return (self.seq, self.op if self.phase != "idle" else "", self.c10d)

    def describe(self) -> str:
        inside = f" inside torch.distributed.{self.c10d}" if self.c10d else ""
        return f"{self.op!r} (#{self.seq}){inside} at {self.where}"

    def process(self) -> str:
        return f"pid {self.pid} on {self.host}"

    def ending(self) -> str:
        """How this rank ended, for other ranks' messages."""
        if self.status == "failed":
            return f"failed: {self.detail}"
        return f"has shut down ({self.detail}; its last operation was {self.op!r}, #{self.seq})"


@dataclass(frozen=True)
class Event:
    """A line of the job's event log: a rank finished, failed, or diagnosed another rank."""

    rank: int
    kind: str  # "exited" or "failed"
    seq: int
    op: str
    detail: str

    def encode(self) -> str:
        return FIELD.join(_clean(str(v)) for v in (self.rank, self.kind, self.seq, self.op, self.detail)) + RECORD

    @classmethod
    def decode_all(cls, raw: bytes) -> list[Event]:
        out = []
        for record in raw.decode().split(RECORD):
            if record:
                rank, kind, seq, op, detail = record.split(FIELD)
                out.append(cls(int(rank), kind, int(seq), op, detail))
        return out


@dataclass(frozen=True)
class Verdict:
    """Why a wait can never end: what kind of error and its message."""

    kind: str  # "gone", "mismatch", "timeout"
    message: str

    _ERRORS = {"gone": RankGoneError, "mismatch": CollectiveMismatchError, "timeout": CollectiveTimeoutError}

    def error(self) -> CollectiveError:
        return self._ERRORS[self.kind](self.message)

    def encode(self) -> str:
        return f"{self.kind}{FIELD}{self.message}"

    @classmethod
    def decode(cls, raw: bytes) -> Verdict | None:
        """None for the rendezvous' "ok"."""
        kind, _, message = raw.decode().partition(FIELD)
        return None if kind == "ok" else cls(kind, message)


OK = "ok"


class Keys:
    """Store keys of one lockstep group."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def hb(self, rank: int) -> str:
        return f"{self.prefix}/hb/{rank}"

    @property
    def events(self) -> str:
        return f"{self.prefix}/events"

    def ops(self, seq: int) -> str:
        return f"{self.prefix}/{seq}/ops"

    def arrived(self, seq: int) -> str:
        return f"{self.prefix}/{seq}/arrived"

    def go(self, seq: int) -> str:
        return f"{self.prefix}/{seq}/go"


__all__ = [
    "FIELD",
    "HEARTBEAT_STORE_TIMEOUT",
    "OK",
    "PHASES",
    "RECORD",
    "Event",
    "Keys",
    "OpState",
    "PeerState",
    "Verdict",
    "append",
]
