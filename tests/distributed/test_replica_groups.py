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
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import JOB_PYTHONPATH, JOBS, Job, run_job
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


def check_kill_and_heal(tmp_path: Path, job: Job, steps: int, kill_at: int, killed: int, ranks: int,
                        groups: int = GROUPS) -> None:
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
    assert len(ends) == groups * ranks
    for rank in range(ranks):  # bit-identical weights: each rank's part (a shard under FSDP) in every group
        assert len({ends[group, rank]["crc"] for group in range(groups)}) == 1, ends
    out = job.output
    left = re.search(rf"\[phalanx\] replica group {killed} left at step (\d+); {groups - 1} of {groups} groups "
                     "continue", out)
    rejoined = re.search(rf"\[phalanx\] Restart 1 of at most 1: rank \d was killed by SIGKILL[^.]*\. replica group "
                         rf"{killed} rejoined at step (\d+), healed from group (\d) \(\d+\.\d\d MB in \d+\.\d\d s\)\.",
                         out)
    assert left and rejoined, out[-5000:]
    assert int(left[1]) == kill_at and int(rejoined[1]) >= kill_at and int(rejoined[2]) != killed
    # Each step, the group out (or healing) skipped its batch; at step 0 the other groups took group 0's weights.
    tally = ends[0, 0]["tally"]
    out_steps = int(rejoined[1]) - kill_at + 1
    per_group = BATCH * ranks
    assert tally["steps"] == steps
    assert tally["skipped"] == per_group * ((groups - 1) + out_steps), (tally, out_steps)
    assert tally["trained"] + tally["skipped"] == steps * groups * per_group
    summary = f"[phalanx] replica groups: {steps} steps committed; samples trained {tally['trained']}, skipped " \
              f"{tally['skipped']}"
    assert summary in out, out[-3000:]
    # The training: within 5 % of the uninterrupted run (group 0 alone at step 0, every group after); each rank's
    # shard is one "group" of the replay.
    uninterrupted = full_loss(reference(steps, groups * ranks, {0: set(range(ranks, groups * ranks))}))
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
    if api == "trainer":  # each group is a run in its own folder: its own metrics, nothing shared
        for group in range(GROUPS):
            metrics = tmp_path / f"replica_group_{group}" / "lightning_logs" / "version_0" / "metrics.csv"
            assert metrics.is_file() and "train" in metrics.read_text(), sorted(tmp_path.rglob("*"))
        assert not (tmp_path / "lightning_logs").exists()


@pytest.mark.slow  # CI runs the single-process groups above; this is the same kill with FSDP inside each group
def test_fsdp_groups_heal_a_killed_rank_from_the_other_group(tmp_path: Path) -> None:
    steps = 80
    kill_at = random.Random(time.time_ns()).randint(5, 30)
    job = launch(tmp_path, "--strategy", "fsdp", "--steps", str(steps), "--sleep", "0.15", "--kill-at", str(kill_at),
                 "--kill-group", "1", groups=2, devices=2, timeout=400)
    check_kill_and_heal(tmp_path, job, steps, kill_at, killed=1, ranks=2, groups=2)


@pytest.mark.slow
def test_uninterrupted_groups_train_as_one_process_on_the_concatenated_batches(tmp_path: Path) -> None:
    steps = 30
    job = launch(tmp_path, "--steps", str(steps))
    assert job.returncode == 0, job.output[-4000:]
    ends = finals(tmp_path)
    assert len({e["crc"] for e in ends.values()}) == 1
    expected = reference(steps, GROUPS, {0: set(range(1, GROUPS))})
    flat = [float(v) for p in expected.parameters() for v in p.detach().reshape(-1)]
    assert ends[0, 0]["params"] == pytest.approx(flat, rel=1e-5, abs=1e-6)
    tally = ends[0, 0]["tally"]
    skipped = BATCH * (GROUPS - 1)  # step 0: the other groups took group 0's weights
    assert tally == {"steps": steps, "trained": BATCH * GROUPS * steps - skipped, "skipped": skipped}
    assert_nothing_left(tmp_path)


class Running:
    """A launcher started in the background, to act on it mid-run."""

    def __init__(self, tmp_path: Path, *args: str, groups: int = 2) -> None:
        (tmp_path / "job.py").write_text(FABRIC_JOB.read_text())
        self.out = tmp_path / "reports"
        self.out.mkdir(exist_ok=True)
        env = {**os.environ, "PHALANX_TEST_OUT": str(self.out), "PYTHONPATH": JOB_PYTHONPATH}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "phalanx.cli", "run", "--replica-groups", str(groups), "job.py", *args],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not (self.out / "ready").exists():
            assert self.process.poll() is None and time.monotonic() < deadline, self.finish(5)
            time.sleep(0.1)

    def pid(self, group: int, rank: int = 0) -> int:
        return int((self.out / f"pid-g{group}-r{rank}").read_text())

    def finish(self, timeout: float) -> str:
        try:
            out, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
            raise AssertionError(f"the launcher did not end within {timeout} s:\n{out[-4000:]}") from None
        return out


def lighthouse_pid(folder: Path) -> int:
    for pid in processes_in(folder):
        if b"torchft_lighthouse" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError("no lighthouse runs")


@pytest.mark.slow
def test_when_the_lighthouse_dies_every_group_stops_naming_it(tmp_path: Path) -> None:
    run = Running(tmp_path, "--steps", "100000", "--sleep", "0.05", "--ready-at", "10")
    run.wait_ready()
    os.kill(lighthouse_pid(tmp_path), signal.SIGKILL)
    killed = time.monotonic()
    out = run.finish(60)
    assert time.monotonic() - killed < 30, out[-3000:]
    assert run.process.returncode == 1, out[-3000:]
    address = re.search(r"the torchft lighthouse at (http://127\.0\.0\.1:\d+) exited \(code -9\): no quorum can form, "
                        r"every replica group stops\.", out)
    assert address, out[-3000:]
    for group in (0, 1):
        assert (f"[phalanx] replica group {group} cannot reach the torchft lighthouse at {address[1]}: "
                "ConnectionRefusedError") in out, out[-3000:]
    assert_nothing_left(tmp_path)


@pytest.mark.slow
def test_a_frozen_group_is_dropped_and_the_others_go_on(tmp_path: Path) -> None:
    run = Running(tmp_path, "--steps", "400", "--sleep", "0.1", "--ready-at", "15", "--timeout", "5", groups=3)
    run.wait_ready()
    frozen = run.pid(1)
    os.kill(frozen, signal.SIGSTOP)
    time.sleep(12)  # the collective timeout (5 s) and the lighthouse's heartbeat timeout (2 s) pass
    during = {g: traces(tmp_path)[g, 0][-1]["step"] for g in (0, 2)}
    time.sleep(3)
    after = {g: traces(tmp_path)[g, 0][-1]["step"] for g in (0, 2)}
    stopped_at = traces(tmp_path)[1, 0][-1]["step"]
    os.kill(frozen, signal.SIGCONT)
    out = run.finish(240)
    assert run.process.returncode == 0, out[-4000:]
    assert all(after[g] > during[g] for g in (0, 2)), (during, after)  # they went on while group 1 was frozen
    assert re.search(r"\[phalanx\] replica group 1 left at step \d+; 2 of 3 groups continue", out), out[-3000:]
    # Woken up, it is behind: it heals in the same process (never restarted) and finishes with the others.
    healed = re.search(r"\[phalanx\] replica group 1 rejoined at step (\d+), healed from group [02]", out)
    assert healed and int(healed[1]) >= after[0], out[-3000:]
    rows = traces(tmp_path)[1, 0]
    assert {r["pid"] for r in rows} == {frozen} and rows[-1]["step"] == 400
    assert any(r["step"] > int(healed[1]) for r in rows) and stopped_at < int(healed[1])
    ends = finals(tmp_path)
    assert len({e["crc"] for e in ends.values()}) == 1
    assert_nothing_left(tmp_path)


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_group_with_a_checkpoint_a_rerun_resumes(tmp_path: Path) -> None:
    run = Running(tmp_path, "--steps", "100000", "--sleep", "0.05", "--ready-at", "10", "--ckpt", "ckpts")
    run.wait_ready()
    run.process.send_signal(signal.SIGTERM)
    out = run.finish(90)
    assert run.process.returncode == 75, out[-3000:]
    saved = re.search(r"\[phalanx\] preempted at step (\d+) by SIGTERM .* checkpoint: (ckpts/step-\d+\.ckpt)", out)
    assert saved, out[-3000:]
    checkpoint = torch.load(tmp_path / saved[2], weights_only=True)
    assert checkpoint["replica_groups"]["manager"]["step"] == checkpoint["step"] == int(saved[1])
    assert_nothing_left(tmp_path)
    step = int(saved[1])
    rerun = launch(tmp_path, "--steps", str(step + 5), "--ckpt", "ckpts", groups=2)
    assert rerun.returncode == 0, rerun.output[-3000:]
    assert re.search(rf"Resumed from ckpts/step-{step}\.ckpt at step {step}", rerun.output), rerun.output[-3000:]
    ends = finals(tmp_path)
    assert {e["step"] for e in ends.values()} == {step + 5} and len({e["crc"] for e in ends.values()}) == 1


@pytest.mark.slow
def test_sigterm_to_one_group_stops_it_with_a_checkpoint_and_the_others_finish_the_job(tmp_path: Path) -> None:
    steps = 150
    run = Running(tmp_path, "--steps", str(steps), "--sleep", "0.1", "--ready-at", "10", "--ckpt", "ckpts", groups=3)
    run.wait_ready()
    os.kill(run.pid(1), signal.SIGTERM)  # one node preempted: not the launcher
    out = run.finish(200)
    # The job is done: a 75 would make a scheduler requeue it (and a rerun resume from group 1's older checkpoint).
    assert run.process.returncode == 0, out[-4000:]
    saved = re.search(r"\[phalanx\] preempted at step (\d+) by SIGTERM on rank 0; checkpoint: (ckpts/step-\d+\.ckpt)",
                      out)
    assert saved, out[-4000:]
    stopped = int(saved[1])
    assert "Replica groups that were not preempted go on without this one; once every group has stopped, run the " \
        "same command again to resume from it." in out, out[-4000:]
    assert f"[phalanx] replica group 1 left at step {stopped}; 2 of 3 groups continue" in out, out[-4000:]
    assert "[phalanx] replica group 1 stopped for a preemption; groups 0, 2 finished the job." in out, out[-4000:]
    checkpoint = torch.load(tmp_path / saved[2], weights_only=True)
    assert checkpoint["replica_groups"]["manager"]["step"] == checkpoint["step"] == stopped
    runs = traces(tmp_path)
    assert [r["step"] for r in runs[1, 0]] == list(range(1, stopped + 1))  # not restarted: it was preempted
    for group in (0, 2):  # never stopped, never back
        assert [r["step"] for r in runs[group, 0]] == list(range(1, steps + 1)), group
        assert {r["pid"] for r in runs[group, 0]} == {run.pid(group)}
    ends = finals(tmp_path)
    assert set(ends) == {(0, 0), (2, 0)} and ends[0, 0]["crc"] == ends[2, 0]["crc"]
    assert_nothing_left(tmp_path)
