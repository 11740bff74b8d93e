"""Fault-tolerant replica groups on torchft (``phalanx run --replica-groups N``, ``Fabric(fault_tolerance=...)``):
real jobs of 3 groups on gloo, one group killed with SIGKILL at a random step. The other groups are never restarted and
never go back; the killed one restarts, heals from a live group over the network (there is no checkpoint anywhere)
and takes part again; at the end every group holds the same bytes, and the loss is that of an uninterrupted run.

The uninterrupted run is computed here, in this process (tests/support/replica_models.py replays what the groups
train); the slow tier also runs it for real and compares it with the replay (the equivalence test)."""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from job_runner import JOBS, Job, run_job
from replica_models import BATCH, full_loss, reference
from run_if import run_if

pytestmark = run_if(module="torchft")

JOB = {"fabric": JOBS / "replica_groups_fabric.py", "trainer": JOBS / "replica_groups_trainer.py"}
FABRIC_JOB = JOB["fabric"]
GROUPS = 3


def launch(tmp_path: Path, *args: str, groups: int = GROUPS, devices: int = 1, restarts: int = 1,
           timeout: float = 240, job: Path = FABRIC_JOB) -> Job:
    command = [sys.executable, "-m", "phalanx.cli", "run", "--replica-groups", str(groups), "--devices", str(devices),
               "--max-restarts", str(restarts)]
    return run_job(job, tmp_path, command=command, args=args, timeout=timeout)


def traces(tmp_path: Path) -> dict[tuple[int, int], list[dict[str, Any]]]:
    out = {}
    for path in (tmp_path / "reports").glob("trace-g*-r*.jsonl"):
        group, rank = map(int, re.findall(r"\d+", path.stem))
        out[group, rank] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def finals(tmp_path: Path) -> dict[tuple[int, int], dict[str, Any]]:
    out = {}
    for path in (tmp_path / "reports").glob("final-g*-r*.json"):
        group, rank = map(int, re.findall(r"\d+", path.stem))
        out[group, rank] = json.loads(path.read_text())
    return out


def processes_in(folder: Path) -> list[int]:
    """Live processes whose working directory is ``folder`` (the launcher, its agents, ranks and lighthouse)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            zombie = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            if Path(os.readlink(entry / "cwd")) == folder and not zombie:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def assert_nothing_left(folder: Path) -> None:
    deadline = time.monotonic() + 10
    while (left := processes_in(folder)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes outlived the job: {left}"


def check_kill_and_heal(tmp_path: Path, job: Job, steps: int, kill_at: int, killed: int, ranks: int) -> None:
    """Everything the kill of one rank of group ``killed`` at step ``kill_at`` must leave behind (see the module)."""
    assert job.returncode == 0, job.output[-5000:]
    runs = traces(tmp_path)
    for (group, rank), rows in runs.items():
        steps_seen = [r["step"] for r in rows]
        if group != killed:  # never restarted, never back
            assert {r["pid"] for r in rows} == {rows[0]["pid"]}, (group, rank)
            assert steps_seen == list(range(1, steps + 1)), (group, rank, steps_seen)
            continue
        first = [r for r in rows if r["attempt"] == 0]
        second = [r for r in rows if r["attempt"] == 1]
        assert [r["step"] for r in first] == list(range(1, kill_at + 1)), (group, rank)
        # Healed: the restarted attempt's counter continues from its peers' (it never trained from step 1 again).
        assert second and second[0]["step"] > kill_at and [r["step"] for r in second] == list(
            range(second[0]["step"], steps + 1)), (group, rank, [r["step"] for r in second])
        started = json.loads((tmp_path / "reports" / f"start-g{group}-r{rank}-a1.json").read_text())["time"]
        assert second[0]["time"] - started < 15, "the restarted group took part again more than 15 s after its start"
    # Not from disk: nothing was ever written to one (no checkpoint, no snapshot folder of this run).
    assert not [p for p in tmp_path.rglob("*") if p.suffix in (".ckpt", ".pt") or "checkpoint" in p.name]
    ends = finals(tmp_path)
    assert len(ends) == GROUPS * ranks
    assert len({e["crc"] for e in ends.values()}) == 1, ends  # bit-identical weights on every rank of every group
    out = job.output
    left = re.search(rf"\[phalanx\] replica group {killed} left at step (\d+); {GROUPS - 1} of {GROUPS} groups "
                     "continue", out)
    rejoined = re.search(rf"\[phalanx\] Restart 1 of at most 1: rank \d was killed by SIGKILL\. replica group {killed} "
                         rf"rejoined at step (\d+), healed from group (\d) \(\d+\.\d\d MB in \d+\.\d\d s\)\.", out)
    assert left and rejoined, out[-5000:]
    assert int(left[1]) == kill_at and int(rejoined[1]) >= kill_at and int(rejoined[2]) != killed
    # Each step, the group out (or healing) skipped its batch; at step 0 the other groups took group 0's weights.
    tally = ends[0, 0]["tally"]
    out_steps = int(rejoined[1]) - kill_at + 1
    per_group = BATCH * ranks
    assert tally["steps"] == steps
    assert tally["skipped"] == per_group * ((GROUPS - 1) + out_steps), (tally, out_steps)
    assert tally["trained"] + tally["skipped"] == steps * GROUPS * per_group
    summary = f"[phalanx] replica groups: {steps} steps committed; samples trained {tally['trained']}, skipped " \
              f"{tally['skipped']}"
    assert summary in out, out[-3000:]
    # The training: within 5 % of the uninterrupted run (group 0 alone at step 0, every group after).
    uninterrupted = full_loss(reference(steps, GROUPS, {0: set(range(1, GROUPS))}))
    assert abs(ends[0, 0]["loss"] - uninterrupted) <= 0.05 * uninterrupted, (ends[0, 0]["loss"], uninterrupted)
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("api", ["fabric", "trainer"])
def test_a_killed_group_heals_from_a_peer_while_the_others_go_on(tmp_path: Path, api: str) -> None:
    # The steps left after the kill (0.15 s each) outlast the restart (starting Python and torch): the group rejoins.
    steps = 80
    kill_at = random.Random(time.time_ns()).randint(5, 35)  # printed on failure: the job's arguments
    job = launch(tmp_path, "--steps", str(steps), "--sleep", "0.15", "--kill-at", str(kill_at), "--kill-group", "1",
                 job=JOB[api])
    check_kill_and_heal(tmp_path, job, steps, kill_at, killed=1, ranks=1)
