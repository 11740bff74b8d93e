"""Runs that survive, through the Trainer, for real (2 ranks, gloo, CPU; tests/support/survival_job.py):
a preemption signal on a random rank at a random step, a signal during a checkpoint save (and a second
one during the preemption save), a signal to the launcher under SLURM, and kill -9 of a rank under
max_restarts. Each run ends with weights bit-identical to an uninterrupted run, every sample trained
on exactly once per epoch (at most one step again after a kill), and nothing hangs."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from job_runner import JOB_PYTHONPATH, JOBS, SUPPORT, Job, assert_terminal, run_job
from run_if import run_if

from phalanx.distributed.preemption import EXIT_PREEMPTED
from phalanx.distributed.runfolder import RunClaim

JOB = SUPPORT / "survival_job.py"
STEPS = 16  # 48 samples / (2 ranks x batches of 3) = 8 optimizer steps per epoch, 2 epochs
ENV = {"PHALANX_SHOW_TRACEBACKS": "0"}

STRATEGIES = [
    "ddp",
    pytest.param("fsdp", marks=[run_if(fsdp=True), pytest.mark.slow]),
    pytest.param("deepspeed_stage_1", marks=[run_if(deepspeed=True), pytest.mark.slow]),
    pytest.param("deepspeed_stage_2", marks=[run_if(deepspeed=True), pytest.mark.slow]),
    pytest.param("deepspeed_stage_3", marks=[run_if(deepspeed=True), pytest.mark.slow]),
]

_references: dict[str, list[float]] = {}


def job(folder: Path, *args: str, timeout: float = 180) -> Job:
    folder.mkdir(exist_ok=True)
    return run_job(JOB, folder, timeout=timeout, env=ENV, args=args)


FIRST_RUN = ("[phalanx] ckpt_path='last': no last.ckpt in ['run/checkpoints'] yet; training starts from scratch (a "
             "later run with the same command resumes from the last.ckpt this one writes).")


def logs(folder: Path) -> str:
    """The run log folder of the job run in ``folder`` (under its default_root_dir), as the terminal names it."""
    (found,) = (folder / "run" / "phalanx_logs").glob("phalanx-*")
    return str(found.relative_to(folder))


def resumed_line(done: Job) -> str:
    path, step, epoch = done.reports[0]["resumed"]
    return f"Resumed from {path} at step {step} (epoch {epoch})."


def reference(tmp_path_factory: pytest.TempPathFactory, strategy: str) -> list[float]:
    """The uninterrupted run's final weights (one run per strategy per session)."""
    if strategy not in _references:
        ref = job(tmp_path_factory.mktemp(f"reference-{strategy}"), strategy, "--fresh").check()
        assert ref.reports[0]["step"] == STEPS
        _references[strategy] = ref.reports[0]["weights"]
    return _references[strategy]


def seen(folder: Path) -> collections.Counter[tuple[int, int]]:
    """How often each (epoch, sample) was trained on, over every attempt and rank."""
    lines = [line for r in (0, 1) for line in (folder / f"seen{r}.txt").read_text().splitlines() if line]
    return collections.Counter((int(line.split()[0]), int(line.split()[1])) for line in lines)


def assert_each_sample_once(folder: Path, again: int = 0) -> None:
    counts = seen(folder)
    assert set(counts) == {(e, i) for e in (0, 1) for i in range(48)}, "a sample was never trained on"
    extra = sum(n - 1 for n in counts.values())
    assert extra <= again, f"{extra} samples trained on more than once (allowed: {again})"


def digest(path: Path) -> str:
    """A hash of the checkpoint at ``path``: a file, or a sharded directory's files."""
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    return hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()


def one_attempt_and_why(done: Job, folder: Path, why: str) -> None:
    """The job failed once, was not restarted (under max_restarts=2), and its last line says ``why``."""
    assert done.returncode == 1, done.output[-3000:]
    assert "Restart" not in done.stderr and done.stderr.rstrip().endswith(f" Not restarted: {why}."), done.stderr
    run = re.search(r"Tracebacks and stderr of every rank: (\S+) ", done.stderr)
    assert run and [p.name for p in (folder / run.group(1)).glob("*/attempt_*")] == ["attempt_0"], done.stderr


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sigterm_on_a_random_rank_and_step_then_rerun(tmp_path: Path, tmp_path_factory: Any, strategy: str) -> None:
    expected = reference(tmp_path_factory, strategy)
    rank, step = random.randrange(2), random.randrange(1, STEPS)
    why = f"{strategy}: SIGTERM to rank {rank} at step {step}"
    first = job(tmp_path, strategy, "--interrupt", "SIGTERM", "--rank", str(rank), "--step", str(step))
    assert first.returncode == EXIT_PREEMPTED, (why, first.output[-3000:])
    # What the terminal shows, all of it: the stop and how to resume, in one line.
    took = r" \(\d+\.\d s after the signal\)" if rank == 0 else ""  # rank 0 prints; it knows when it got its own
    assert_terminal(first.stderr, strategy, FIRST_RUN, (
        rf"re:\[phalanx\] preempted at step {step} by SIGTERM on rank {rank}; checkpoint: run/checkpoints/last\.ckpt"
        rf"{took}\. Run the same command again to resume from it\. Logs: {re.escape(logs(tmp_path))}"))
    # A run that names another checkpoint would start over the preempted one: refused at once, naming it and both
    # ways on, and not restarted; the preempted checkpoint is unchanged.
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    kept = digest(last)
    (shutil.copytree if last.is_dir() else shutil.copy)(last, tmp_path / "other.ckpt")
    refused = job(tmp_path, strategy, "--ckpt-path", "other.ckpt", "--max-restarts", "2")
    assert (f"MisconfigurationError: The run in this folder was preempted at step {step} and its checkpoint "
            "run/checkpoints/last.ckpt waits to be resumed (run/preempted.json records it); ckpt_path='other.ckpt' "
            "would start from other.ckpt and overwrite what that run wrote. Either resume it: run with ckpt_path=None "
            "(or 'run/checkpoints/last.ckpt'); or keep it and start anew: delete run/preempted.json (the checkpoint "
            "stays), or train in another folder (Trainer(default_root_dir=...)).") in refused.stderr, refused.stderr
    one_attempt_and_why(refused, tmp_path, "a configuration error fails the same way on every attempt")
    assert digest(last) == kept
    # The same command, ckpt_path=None: it resumes the preempted run, says so, and ends bit-identical.
    second = job(tmp_path, strategy, "--interrupt", "SIGTERM", "--rank", str(rank), "--step", str(step),
                 "--fresh").check()
    assert second.reports[0]["resumed"][:2] == ["run/checkpoints/last.ckpt", step], (why, second.reports)
    assert_terminal(second.stderr, strategy, f"[phalanx] {resumed_line(second)[:-1]}: the run in this folder was "
                    "preempted there (run/preempted.json), and fit(ckpt_path=None) resumes it.")
    assert second.reports[0]["step"] == STEPS
    assert second.reports[0]["weights"] == expected, why  # bit-identical
    assert_each_sample_once(tmp_path)
    assert not (tmp_path / "run" / "preempted.json").exists()  # the resumed run ended well: the record is done
    if last.is_file():  # a damaged checkpoint: one attempt under max_restarts=2, its cause, no restart
        data = bytearray(last.read_bytes())
        data[len(data) // 2:len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 64])
        last.write_bytes(bytes(data))
        damaged = job(tmp_path, strategy, "--max-restarts", "2")
        assert "CorruptCheckpointError: Checkpoint run/checkpoints/last.ckpt is corrupt" in damaged.stderr
        one_attempt_and_why(damaged, tmp_path, "a checkpoint that cannot be used fails the same way on every attempt")


@pytest.mark.timeout(600)
def test_signal_during_a_save_and_again_during_the_preemption_save(tmp_path: Path, tmp_path_factory: Any) -> None:
    expected = reference(tmp_path_factory, "ddp")
    # Step 4's periodic checkpoint is being written when SIGTERM arrives on rank 1: the save completes, the
    # ranks stop at that boundary; a second SIGTERM while the preemption checkpoint is written changes nothing.
    first = job(tmp_path, "ddp", "--interrupt", "SIGTERM", "--rank", "1", "--step", "4", "--in-save", "--twice")
    assert first.returncode == EXIT_PREEMPTED, first.output[-3000:]
    assert (tmp_path / "twice").exists()  # the second signal did arrive during the save
    assert "[phalanx] preempted at step 4 by SIGTERM on rank 1" in first.stderr, first.stderr[-3000:]
    second = job(tmp_path, "ddp", "--interrupt", "SIGTERM", "--rank", "1", "--step", "4").check()
    assert second.reports[0]["weights"] == expected
    assert_each_sample_once(tmp_path)


def _fake_scontrol(folder: Path) -> Path:
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {folder / 'scontrol.log'}\n")
    script.chmod(0o755)
    return bin_dir


@pytest.mark.timeout(600)
def test_sigusr1_to_the_launcher_under_slurm_checkpoints_and_requeues(tmp_path: Path, tmp_path_factory: Any) -> None:
    expected = reference(tmp_path_factory, "ddp")
    (tmp_path / "job.py").write_text(JOB.read_text())
    (tmp_path / "reports").mkdir()
    env = {**os.environ, **ENV, "PHALANX_TEST_OUT": str(tmp_path / "reports"), "PYTHONPATH": JOB_PYTHONPATH,
           "SLURM_JOB_ID": "4242", "PATH": f"{_fake_scontrol(tmp_path)}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "job.py", "ddp"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 150
        while not (tmp_path / "seen0.txt").exists() or len((tmp_path / "seen0.txt").read_text().split()) < 12:
            assert proc.poll() is None and time.monotonic() < deadline, "the job ended or never started training"
            time.sleep(0.02)
        proc.send_signal(signal.SIGUSR1)  # the launching process only, as SLURM's --signal=B:USR1 does
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    # The agent passed it on to both ranks (the lower rank that had it at the step both agreed on is named); its own
    # "Received 10 death signal" is in the run's launcher.log. The stop, then the requeue: nothing else.
    stop = (r"\[phalanx\] preempted at step \d+ by SIGUSR1 on rank (0; checkpoint: run/checkpoints/last\.ckpt "
            r"\(\d+\.\d s after the signal\)|1; checkpoint: run/checkpoints/last\.ckpt)\. Run the same command again "
            rf"to resume from it\. Logs: {re.escape(logs(tmp_path))}")
    lines = stderr.splitlines()
    assert len(lines) == 3 and lines[0] == FIRST_RUN and re.fullmatch(stop, lines[1]), stderr[-3000:]
    assert lines[2] == "[phalanx] SLURM job 4242 requeued: it resumes from this checkpoint when it starts again."
    assert "Received 10 death signal" in next((tmp_path / "run" / "phalanx_logs").glob("*/launcher.log")).read_text()
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]  # once, by rank 0
    env.pop("SLURM_JOB_ID")
    rerun = job(tmp_path, "ddp").check()
    assert rerun.reports[0]["weights"] == expected
    assert_each_sample_once(tmp_path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kill_9_of_a_rank_under_max_restarts_resumes_from_the_snapshot(
    tmp_path: Path, tmp_path_factory: Any, strategy: str
) -> None:
    expected = reference(tmp_path_factory, strategy)
    rank, step = random.randrange(2), random.randrange(1, STEPS)
    why = f"{strategy}: kill -9 of rank {rank} at step {step}"
    done = job(tmp_path, strategy, "--interrupt", "KILL", "--rank", str(rank), "--step", str(step), "--max-restarts",
               "1", "--snapshot", "--fresh").check()
    assert (tmp_path / "killed").exists(), why
    # The terminal says it in one line: which rank failed and how, where the run resumed, where the logs are.
    assert_terminal(done.stderr, strategy, f"[phalanx] Restart 1 of at most 1: rank {rank} was killed by SIGKILL; "
                    f"rank {1 - rank} stopped as a consequence. {resumed_line(done)} Logs: {logs(tmp_path)}")
    # Nothing recomputed: the restart resumed from the snapshot of the step the rank died after. (These states
    # are small, so the copy was complete before the callback returned; a large state's copy overlaps the next
    # step, and losing it costs one step: tests/checkpoint/test_snapshot_writer.py.) Shared-memory snapshots are
    # named by a reference; under DeepSpeed they are checkpoint files.
    assert re.search(rf"snapshot-step={step:09d}$", done.reports[0]["resumed"][0]), (why, done.reports)
    assert done.reports[0]["resumed"][1] == step, (why, done.reports)
    assert done.reports[0]["weights"] == expected, why
    assert_each_sample_once(tmp_path)
    shm = Path(done.reports[0]["ckpt_path"]).parent
    assert not shm.exists(), "the snapshots outlived the run"


@pytest.mark.slow  # a message only; the restart machinery itself runs in the default-tier kill test
@pytest.mark.timeout(300)
def test_a_restart_without_any_checkpoint_says_it_starts_over(tmp_path: Path) -> None:
    # No ModelCheckpoint, no Snapshot: the restarted attempt trains from step 0 and says why, never silently.
    done = run_job(JOBS / "restart_without_checkpoint.py", tmp_path, timeout=180, env=ENV).check()
    (logs,) = (tmp_path / "phalanx_logs").glob("phalanx-*")
    assert done.stderr.splitlines() == [
        f"[phalanx] Restart 1 of at most 1: rank 1 exited with code 3; rank 0 stopped as a consequence. No checkpoint "
        f"to resume from in {tmp_path / 'checkpoints'}: training starts again from step 0 (add ModelCheckpoint("
        "save_last=True, every_n_train_steps=...) or phalanx.callbacks.Snapshot so that a restart continues where "
        f"the failed attempt was). Logs: {logs.relative_to(tmp_path)}"], done.stderr


def files(root: Path) -> dict[str, str]:
    """Every file under ``root`` but the launchers' logs, with a hash of its bytes."""
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(root.rglob("*"))
            if f.is_file() and "phalanx_logs" not in f.parts}


@pytest.mark.timeout(300)
def test_a_second_fit_in_the_same_root_dir_is_refused_before_it_writes_anything(tmp_path: Path) -> None:
    # Two 2-rank fits (max_restarts=2, a CSV logger, checkpoints, snapshots) in one default_root_dir. The second is
    # refused at the start of its fit, naming the first run's process, writes nothing (its launcher's own log
    # folder aside) and is not restarted; the first runs on, is never restarted, and its logs and checkpoints
    # are its own, each step once.
    root = tmp_path / "shared-root"
    script = tmp_path / "fit.py"
    script.write_text((JOBS / "two_fits_one_root.py").read_text())
    env = {**os.environ, **ENV, "PYTHONPATH": JOB_PYTHONPATH, "PHALANX_TEST_OUT": str(tmp_path)}
    first = subprocess.Popen([sys.executable, str(script), "first", str(root)], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "first-at-2").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.05)
        before = files(root)
        second = subprocess.run([sys.executable, str(script), "second", str(root)], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=120)
        after = files(root)
        (tmp_path / "second-done").touch()
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert re.search(r"MisconfigurationError: Another run \(pid \d+ on \S+, `\S*python\S* \S+fit\.py first \S+`, since "
                     r"[\d :-]+\) is running in \S*shared-root: two runs in one folder would overwrite each other's "
                     "checkpoints and logs", second.stderr), second.stderr[-3000:]
    one_attempt_and_why(Job(second.returncode, second.stdout, second.stderr, 0), tmp_path,
                        "a configuration error fails the same way on every attempt")
    assert not (tmp_path / "second-at-1").exists() and after == before  # refused before it wrote anything
    assert first.returncode == 0 and "Restart" not in err, err[-3000:]
    assert sorted(p.name for p in (root / "csv").iterdir()) == ["version_0"]
    steps = [line.split(",")[0] for line in (root / "csv" / "version_0" / "metrics.csv").read_text().splitlines()]
    assert steps[1:] == ["1", "2", "3", "4", "4", "5", "6", "6"]  # each step's row once (and each epoch's)
    assert not Path(json.loads((tmp_path / "rank0.json").read_text())["folder"]).exists()  # removed at the end
    RunClaim(root).release()  # the first let go of the folder when its fit ended


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_chaos_fifty_random_interruptions_in_a_row(tmp_path: Path, tmp_path_factory: Any) -> None:
    """50 runs, each hit by a random interruption (SIGTERM or SIGUSR1 to a rank, then a rerun; or kill -9
    under max_restarts with snapshots) at a random step: each completes identical, none hangs."""
    rng = random.Random()
    strategies = ["ddp", "fsdp"]
    for i in range(50):
        strategy, kind = rng.choice(strategies), rng.choice(["SIGTERM", "SIGUSR1", "KILL"])
        rank, step = rng.randrange(2), rng.randrange(1, STEPS)
        expected = reference(tmp_path_factory, strategy)
        folder = tmp_path / f"run{i}"
        why = f"run {i}: {strategy}, {kind} to rank {rank} at step {step}"
        start = time.monotonic()
        args = (strategy, "--interrupt", kind, "--rank", str(rank), "--step", str(step))
        if kind == "KILL":
            final = job(folder, *args, "--max-restarts", "1", "--snapshot", "--fresh", timeout=240)
        else:
            first = job(folder, *args, timeout=240)
            assert first.returncode == EXIT_PREEMPTED, (why, first.output[-2000:])
            final = job(folder, *args, timeout=240)
        assert final.returncode == 0, (why, final.output[-3000:])
        assert final.reports[0]["weights"] == expected, why
        assert_each_sample_once(folder)
        shutil.rmtree(folder, ignore_errors=True)
        print(f"{why}: ok in {time.monotonic() - start:.1f} s")


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "--max-restarts", "1"],
    "phalanx run": [sys.executable, "-m", "phalanx.cli", "run", "--devices", "2", "--max-restarts", "1"],
}


@pytest.mark.timeout(900)
@pytest.mark.slow  # the Trainer's own launcher restarts on torch's agent store too (the default-tier kill test)
@pytest.mark.parametrize("repeat", [0, 1, 2])
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_kill_9_under_torchrun_and_phalanx_run_restarts(
    tmp_path: Path, tmp_path_factory: Any, launcher: str, repeat: int
) -> None:
    # Restarted ranks share the agent's store with the failed attempt: they must neither read its stale keys
    # (they used to connect to a dead port, or freeze) nor start from step 0.
    expected = reference(tmp_path_factory, "ddp")
    step = random.randrange(1, STEPS)
    done = run_job(JOB, tmp_path, timeout=300, env=ENV, command=LAUNCHERS[launcher],
                   args=("ddp", "--interrupt", "KILL", "--rank", "1", "--step", str(step), "--snapshot", "--fresh"))
    assert done.returncode == 0, (launcher, step, done.output[-4000:])
    assert (tmp_path / "killed").exists()
    assert done.reports[0]["weights"] == expected, (launcher, step)
    assert_each_sample_once(tmp_path)
