"""How the lockstep guard scales: N simulated ranks running guarded ops against one TCPStore.

Each simulated rank is a thread with its own two store clients (the rank's main client and its
watchdog's) and a real :class:`phalanx.distributed.lockstep.Lockstep` with its watchdog thread, exactly what a
rank of a job runs; the threads are spread over ``--processes`` processes. The store server runs in
this process, as rank 0's (or the launcher's) would. Every store request of every rank is counted by
a wrapper around its clients, heartbeats included.

Per N it prints::

    guard_scale N=<n> late_ms=<l> median_ms=<x> p95_ms=<y> store_requests_per_op=<z> startup_failures=<f>

``median_ms``/``p95_ms``: time a rank spends in one guarded op (arrival to release); with a late rank,
measured from the late rank's arrival (the guard's own cost, not the wait the late rank causes).
``store_requests_per_op``: all requests of all ranks during the ops, divided by the number of ops.

    python bench/guard_scale.py                       # N = 2 8 32 128 256, on time and with a 1 s late rank
    python bench/guard_scale.py --ranks 8 32 --ops 6 --late-ms 600
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch.distributed as dist

from phalanx.distributed.lockstep import Lockstep, make_store_client
from phalanx.distributed.watchdog import HEARTBEAT_STORE_TIMEOUT


class CountingStore:
    """Forwards every call to a store client and counts it."""

    def __init__(self, inner: Any, counter: list[int]) -> None:
        self._inner, self._counter = inner, counter

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self._counter[0] += 1
            return method(*args, **kwargs)

        return call


def _rank_thread(port: int, rank: int, world: int, args: argparse.Namespace, prefix: str,
                 ready: threading.Barrier, start: threading.Event, out: dict[str, Any]) -> None:
    counter = [0]
    try:
        main = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=300), wait_for_workers=False)
        hb = make_store_client("127.0.0.1", port, HEARTBEAT_STORE_TIMEOUT, 300.0)
        lock = Lockstep(CountingStore(main, counter), rank, world, guard_timeout=args.guard_timeout,  # type: ignore[arg-type]
                        heartbeat_store=CountingStore(hb, counter), prefix=prefix)  # type: ignore[arg-type]
    except Exception as err:  # a start-up failure: counted and reported
        out["startup_error"] = f"{type(err).__name__}: {err}"
        ready.abort()
        return
    ready.wait()
    start.wait()
    counter[0] = 0
    durations, arrivals, releases = [], [], []
    late = rank == world - 1 and args.late_ms > 0
    for _ in range(args.ops):
        if late:
            time.sleep(args.late_ms / 1000)
        arrive = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes of one machine
        with lock.guarded("step"):
            pass
        release = time.monotonic()
        durations.append(release - arrive)
        arrivals.append(arrive)
        releases.append(release)
    out.update(requests=counter[0], durations=durations, arrivals=arrivals, releases=releases)
    lock.close()  # every rank was released from the last op, so leaving now disturbs nobody


def _worker(port: int, ranks: list[int], world: int, args: argparse.Namespace, prefix: str, queue: Any,
            go: Any) -> None:
    results: list[dict[str, Any]] = [{} for _ in ranks]
    ready, start = threading.Barrier(len(ranks) + 1), threading.Event()
    threads = [threading.Thread(target=_rank_thread, args=(port, r, world, args, prefix, ready, start, results[i]))
               for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    try:
        ready.wait()  # every local rank is set up
    except threading.BrokenBarrierError:
        pass
    queue.put("ready")
    go.wait()  # every rank of every process is set up: start the ops (and the request counts) together
    start.set()
    for t in threads:
        t.join(600)
    queue.put(results)


def run(n: int, args: argparse.Namespace, late_ms: float) -> str:
    args = argparse.Namespace(**{**vars(args), "late_ms": late_ms})
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=300), wait_for_workers=False)
    prefix = f"bench/{n}/{late_ms:.0f}/{time.time_ns()}"
    procs_n = max(1, min(args.processes, n))
    chunks = [list(range(n))[i::procs_n] for i in range(procs_n)]
    ctx = mp.get_context("spawn")
    queue, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(server.port, chunk, n, args, prefix, queue, go)) for chunk in chunks]
    for p in procs:
        p.start()
    for _ in procs:
        assert queue.get(timeout=600) == "ready"
    go.set()
    results: list[dict[str, Any]] = []
    for _ in procs:
        results += queue.get(timeout=600)
    for p in procs:
        p.join(60)
    failures = sum(1 for r in results if "startup_error" in r)
    done = [r for r in results if "durations" in r]
    if failures or len(done) != n:
        first = next((r["startup_error"] for r in results if "startup_error" in r), "ranks missing")
        return f"guard_scale N={n} late_ms={late_ms:.0f} startup_failures={failures} first_error={first!r}"
    if late_ms > 0:
        last_arrival = [max(r["arrivals"][i] for r in done) for i in range(args.ops)]
        samples = [r["releases"][i] - last_arrival[i] for r in done for i in range(args.ops)]
    else:
        samples = [d for r in done for d in r["durations"]]
    samples_ms = sorted(1000 * s for s in samples)
    p95 = samples_ms[min(len(samples_ms) - 1, int(0.95 * len(samples_ms)))]
    per_op = sum(r["requests"] for r in done) / args.ops
    return (f"guard_scale N={n} late_ms={late_ms:.0f} median_ms={statistics.median(samples_ms):.1f} "
            f"p95_ms={p95:.1f} store_requests_per_op={per_op:.1f} startup_failures=0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 32, 128, 256])
    parser.add_argument("--ops", type=int, default=20, help="guarded ops per run")
    parser.add_argument("--late-ms", type=float, default=1000.0, help="one rank arrives this late at every op "
                                                                       "(a second run per N; 0: skip it)")
    parser.add_argument("--processes", type=int, default=4, help="processes the simulated ranks are spread over")
    parser.add_argument("--guard-timeout", type=float, default=15.0)
    args = parser.parse_args()
    for n in args.ranks:
        print(run(n, args, 0.0), flush=True)
        if args.late_ms > 0:
            print(run(n, args, args.late_ms), flush=True)


if __name__ == "__main__":
    main()
