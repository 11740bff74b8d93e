"""A failed job reads once: through every launcher phalanx owns (``python train.py`` with
``fabric.launch()``, ``fabric.launch(fn)``, the Trainer with ``devices=2``, ``phalanx run``) the terminal
shows the ranks' stdout live and ends with where the log is and the cause (rank, exception, the user's
file:line), once; the ranks' full tracebacks and stderr are in the log it names."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from job_runner import JOBS, line_of, run_job

from phalanx.distributed import restarts
from phalanx.distributed.failures import CAUSE_VARIABLE, NotRestarted, failure_summary, oom_kills, restart_record
from phalanx.distributed.runlogs import RUN_VARIABLE, RunLogs, log_root
from phalanx.utils.errors import note_step

pytestmark = pytest.mark.timeout(240)

MAX_LINES = 20


def test_show_tracebacks_redirects_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PHALANX_SHOW_TRACEBACKS", "1")
    logs = RunLogs("phalanx-x", root=str(tmp_path))
    assert logs.dir is None and logs.logs_specs() is None and logs.torchrun_args() == []
    monkeypatch.delenv("PHALANX_SHOW_TRACEBACKS")
    logs = RunLogs("phalanx-x", root=str(tmp_path), dst=io.StringIO())
    assert logs.dir == str(tmp_path / "phalanx-x")
    assert logs.torchrun_args() == ["--log-dir", logs.dir, "--redirects", "3"]


# ---------------------------------------------------------------- the summary quotes each cause once
class _Failure:
    def __init__(self, exitcode: int, message: str | None, timestamp: int) -> None:
        self.exitcode, self.timestamp, self.error_file = exitcode, timestamp, ""
        self.error_file_data = {"message": {"message": message}} if message else {}


def test_summary_names_ranks_that_failed_alike_together_and_a_consequence_without_its_cause() -> None:
    cause = "ValueError: boom (raised at job.py:9 (<module>))"

    class Both:
        failures = {0: _Failure(1, cause, 11), 1: _Failure(1, cause, 10)}

    text, code = failure_summary(Both())
    assert (text, code) == (f"ranks 1 and 0 exited with code 1: {cause}", 1)

    class Consequence:
        failures = {0: _Failure(1, f"RankGoneError: barrier ... but rank 1 failed: {cause}. That error is the "
                                     "cause", 12), 1: _Failure(1, cause, 10), 2: _Failure(-signal.SIGTERM, None, 13)}

    text, _ = failure_summary(Consequence())
    assert text == f"rank 1 exited with code 1: {cause}; ranks 0 and 2 stopped as a consequence"
    assert text.count("job.py:9") == 1


def test_summary_of_a_killed_rank_reads_the_same_whichever_way_its_peer_stopped() -> None:
    gone = ("RankGoneError: stop_requested (collective #60, on rank 0) failed on rank 0 because rank 1 stopped sending "
            "heartbeats (last seen in 'backward' (#59) at job.py:12 (<module>)); it was killed or crashed.")
    # The watchdog's verdict while the peer waits inside a collective (seen under FSDP: a gradient all-reduce).
    waiting = ("RankGoneError: all_reduce (collective #81, called at job.py:124 (main) on rank 0) is waiting for "
               "rank(s) [1]; rank 1 has not sent a heartbeat for 15.0s (last seen in 'FSDP gradient-average check' "
               "(#1) at job.py:124 (main), pid 4671 on vm). It was killed or is frozen.")
    # It noticed first (in a guarded call, or waiting in a collective), or was stopped first.
    for peer in (_Failure(1, gone, 10), _Failure(1, waiting, 10), _Failure(-signal.SIGTERM, None, 10)):

        class Killed:
            failures = {0: peer, 1: _Failure(-signal.SIGKILL, None, 11)}

        # The job's exit code is the killed rank's as a shell reports it (128 + 9), as docs/faults.md's table says.
        assert failure_summary(Killed()) == ("rank 1 was killed by SIGKILL; rank 0 stopped as a consequence", 137)

    class Alone:  # the agent reported only the killed rank (a restart): the others are named from the rank count
        failures = {1: _Failure(-signal.SIGKILL, None, 11)}

    text = failure_summary(Alone(), ranks=3)[0]
    assert text == "rank 1 was killed by SIGKILL; ranks 0 and 2 stopped as a consequence"
    # The kernel's out-of-memory counter rose meanwhile: said, with what to do; never without that evidence.
    assert failure_summary(Alone(), ranks=2, oom=1)[0] == (
        "rank 1 was killed by SIGKILL (the kernel's out-of-memory killer: this cgroup's oom_kill count rose by 1; give "
        "the job more memory or use less, e.g. a smaller batch or fewer dataloader workers); rank 0 stopped as a "
        "consequence")
    assert "memory" not in failure_summary(Alone(), ranks=2, oom=0)[0]


def test_summary_of_a_frozen_rank_is_its_peers_report() -> None:
    # Rank 1 froze (alive, silent): rank 0's watchdog reported it, and torch's agent SIGKILLed rank 1 only after
    # SIGTERM's 30 s grace. The report, naming the frozen rank and the operation, comes first.
    report = ("RankGoneError: backward (DDP gradient all-reduce) (collective #13, called at job.py:39 (<module>) on "
              "rank 0) is waiting for rank(s) [1]; rank 1 has not sent a heartbeat for 3.0s. "
              "It was killed or is frozen.")

    class Frozen:
        failures = {0: _Failure(1, report, 100), 1: _Failure(-signal.SIGKILL, None, 130)}

    assert failure_summary(Frozen()) == (f"rank 0 exited with code 1: {report}; rank 1 was killed by SIGKILL", 1)


def test_summary_of_a_corrupt_checkpoint_on_two_ranks_states_the_cause_once() -> None:
    # What a 2-rank fit(ckpt_path=...) of a corrupt file recorded: rank 1's error quotes rank 0's, cut off at 500
    # characters by the error record.
    corrupt = ("Checkpoint run/checkpoints/last.ckpt is corrupt: tensor 'net.0.weight' of entry 'model' does not match "
               "its checksum (crc32 0x923608df saved, 0xd6d42956 now). Its bytes changed after phalanx saved it (a "
               "failing disk, a damaged copy), so loading it would silently give wrong values; it was refused. Use the "
               "previous checkpoint, run/checkpoints/epoch=0-step=4.ckpt.")
    own = f"CorruptCheckpointError: {corrupt} (raised at format.py:175 (read_file), called from job.py:5 (<module>))"
    quoted = f"CorruptCheckpointError: Loading run/checkpoints/last.ckpt failed on rank 0: {corrupt}"[:500]

    class Both:
        failures = {0: _Failure(1, own, 10), 1: _Failure(1, quoted + " (raised at layer.py:77 (_raise_failure))", 10)}

    assert failure_summary(Both()) == (f"rank 0 exited with code 1: {own}; rank 1 stopped as a consequence", 1)


def test_the_kernels_out_of_memory_count_is_read_from_the_cgroup(tmp_path: Path) -> None:
    (tmp_path / "cgroup").write_text("4:memory:/job/a\n0::/job/a\n")
    v1 = tmp_path / "fs" / "memory" / "job" / "a"
    v1.mkdir(parents=True)
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert oom_kills(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == 2
    (tmp_path / "cgroup").write_text("0::/job/b\n")
    v2 = tmp_path / "fs" / "job" / "b"
    v2.mkdir(parents=True)
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n")
    assert oom_kills(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == 1
    assert oom_kills(str(tmp_path / "none"), str(tmp_path / "fs")) is None


def test_a_failed_attempt_is_handed_to_the_restarted_ranks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The launcher's recorder turns torch's agent record of a failed attempt into the summary the restarted rank 0
    quotes in its one line (through the environment the agent gives the ranks)."""
    monkeypatch.delenv(CAUSE_VARIABLE, raising=False)
    monkeypatch.setenv("PHALANX_LOG_DIR", str(tmp_path))
    logs = RunLogs("phalanx-x", dst=io.StringIO(), ranks=2)
    attempt = tmp_path / "phalanx-x" / "phalanx-x_abc" / "attempt_0"
    (attempt / "0").mkdir(parents=True)
    gone = "RankGoneError: backward failed on rank 0 because rank 1 stopped sending heartbeats; it was killed"
    (attempt / "0" / "error.json").write_text(json.dumps({"message": {"message": gone}}))
    with logs:
        assert os.environ[RUN_VARIABLE] == str(tmp_path / "phalanx-x")
        record = logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, "api.py", 1,
                                   "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                                   (-9, 1, 4242, "python"), None)
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").handle(record)
        assert os.environ[CAUSE_VARIABLE] == "rank 1 was killed by SIGKILL; rank 0 stopped as a consequence"
    assert CAUSE_VARIABLE not in os.environ and RUN_VARIABLE not in os.environ  # this process may go on


def _failed(attempt: Path, rank: int, error: BaseException | None, exitcode: int = 1) -> logging.LogRecord:
    """Rank ``rank`` of ``attempt`` ended with ``error`` (recorded as phalanx records it; None: killed by a signal):
    the record torch's agent logs about it."""
    (attempt / str(rank)).mkdir(parents=True, exist_ok=True)
    if error is not None:
        extra = {"timestamp": "1", "phalanx": restart_record(error)}
        (attempt / str(rank) / "error.json").write_text(json.dumps({"message": {"message": str(error),
                                                                                "extraInfo": extra}}))
    return logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, "api.py", 1,
                             "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                             (exitcode, rank, 4242, "python"), None)


def _raised(error: BaseException, step: int | None = None) -> BaseException:
    try:
        raise error
    except BaseException as err:
        if step is not None:
            note_step(err, step)
        return err


def test_only_what_a_restart_can_fix_is_restarted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The launcher's recorder stops torch's agent from restarting after an error that will repeat (a configuration
    error, a checkpoint that cannot be used, a preemption) and after an exception that repeats at the same step;
    it lets a killed rank, a lost peer and an exception at another step be restarted."""
    monkeypatch.setenv("PHALANX_LOG_DIR", str(tmp_path))
    agent = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    run = tmp_path / "phalanx-x" / "phalanx-x_abc"

    def attempts(*ranks_errors: tuple[int, BaseException | None, int], max_restarts: int = 2) -> list[str]:
        """Feed one failed attempt per item; what the recorder decided for each ('' restarted, else why not)."""
        for old in run.glob("attempt_*"):
            for file in old.glob("*/error.json"):
                file.unlink()
        decided = []
        with RunLogs("phalanx-x", dst=io.StringIO(), ranks=2, max_restarts=max_restarts):
            for n, (rank, error, code) in enumerate(ranks_errors):
                try:
                    agent.handle(_failed(run / f"attempt_{n}", rank, error, code))
                    decided.append("")
                except NotRestarted as stop:
                    decided.append(stop.why)
                    assert sorted(stop.failures) == [rank]
        return decided

    from phalanx.distributed.preemption import Preempted
    from phalanx.utils.errors import CheckpointError, MisconfigurationError, RankGoneError

    assert attempts((1, _raised(MisconfigurationError("bad")), 1)) == [
        "a configuration error fails the same way on every attempt"]
    assert attempts((0, _raised(CheckpointError("corrupt")), 1)) == [
        "a checkpoint that cannot be used fails the same way on every attempt"]
    assert attempts((0, Preempted("preempted at step 3"), 75)) == [
        "the job was preempted: it ends so that it can be moved, and its rerun resumes"]
    same = "attempt 1 failed with the same ValueError at step 3 as attempt 0, so a restart would fail the same way " \
           "again"
    assert attempts((1, _raised(ValueError("x"), 3), 1), (1, _raised(ValueError("y"), 3), 1)) == ["", same]
    assert attempts((1, _raised(ValueError("x"), 3), 1), (1, _raised(ValueError("x"), 4), 1),
                    (1, _raised(KeyError("x"), 4), 1)) == ["", "", ""]  # another step, another type: restarted
    assert attempts((1, None, -9), (1, None, -9), (1, None, -9)) == ["", "", ""]  # killed: as often as allowed
    gone = _raised(RankGoneError("rank 1 is gone"), 3)
    assert attempts((0, gone, 1), (0, gone, 1)) == ["", ""]  # a lost peer or a collective timeout: restarted
    assert attempts((1, _raised(MisconfigurationError("bad")), 1), max_restarts=0) == [""]  # no restart to refuse


def test_a_signal_to_the_launcher_is_said_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The ranks saved and rank 0 said so: the launcher adds nothing (exit code 75). No rank saved (a loop that never
    asks fabric.stop_requested()): the launcher says so, naming the logs, and exits as SIGTERM would (143)."""
    monkeypatch.chdir(tmp_path)
    logs = RunLogs("phalanx-x", root=str(tmp_path / "phalanx_logs"), dst=io.StringIO())
    rank0 = tmp_path / "phalanx_logs" / "phalanx-x" / "phalanx-x_abc" / "attempt_0" / "0"
    rank0.mkdir(parents=True)
    assert logs.report_signal(signal.SIGTERM) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == (
        "[phalanx] The launcher received SIGTERM and passed it on to the ranks; no rank saved a checkpoint (a Fabric "
        "loop saves when fabric.stop_requested() says so). Logs: phalanx_logs/phalanx-x\n")
    (rank0 / "error.json").write_text(json.dumps({"message": {"message": "Preempted: preempted at step 5 by ..."}}))
    assert logs.report_signal(signal.SIGTERM) == 75 and capsys.readouterr().err == ""


def test_a_restarted_attempt_says_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    monkeypatch.setattr(restarts.diagnostics, "notice", lambda text, rank=None: said.append(text))
    monkeypatch.setattr(restarts, "_pending", None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv(CAUSE_VARIABLE, "rank 1 exited with code 3; rank 0 stopped as a consequence")
    monkeypatch.setenv(RUN_VARIABLE, os.path.abspath("run/phalanx_logs/phalanx-x"))
    assert restarts.pending()
    restarts.resumed("run/checkpoints/last.ckpt", 8, 1, rank=0)
    restarts.started_over("never said: the attempt said where it resumed", rank=0)
    restarts.resumed("run/checkpoints/last.ckpt", 9, None, rank=0)  # a later fit in the same process
    assert said == ["Restart 2 of at most 3: rank 1 exited with code 3; rank 0 stopped as a consequence. Resumed from "
                    "run/checkpoints/last.ckpt at step 8 (epoch 1). Logs: run/phalanx_logs/phalanx-x",
                    "Resumed from run/checkpoints/last.ckpt at step 9."]
    assert not restarts.pending()


def test_the_run_logs_go_under_the_runs_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import phalanx
    from phalanx.loggers import CSVLogger

    monkeypatch.delenv("PHALANX_LOG_DIR", raising=False)
    assert phalanx.Trainer(accelerator="cpu", default_root_dir=tmp_path / "t").fabric.root_dir == tmp_path / "t"
    fabric = phalanx.Fabric(accelerator="cpu", loggers=CSVLogger(root_dir=tmp_path / "f"))
    assert fabric.root_dir == tmp_path / "f"
    assert log_root(fabric.root_dir) == str(tmp_path / "f" / "phalanx_logs")
    assert phalanx.Fabric(accelerator="cpu").root_dir is None and log_root(None) == os.path.join(".", "phalanx_logs")
    given = phalanx.Fabric(accelerator="cpu", root_dir=tmp_path / "g", loggers=CSVLogger(root_dir=tmp_path / "f"))
    assert given.root_dir == tmp_path / "g"  # an explicit root_dir wins over the loggers'
    monkeypatch.setenv("PHALANX_LOG_DIR", str(tmp_path / "elsewhere"))  # the user's choice wins
    assert log_root(tmp_path / "f") == str(tmp_path / "elsewhere")


# ---------------------------------------------------------------- real 2-rank jobs that crash
FABRIC_LOOP = JOBS / "crashing_fabric_loop.py"
TRAINER = JOBS / "crashing_trainer.py"
WHO = {"rank 1": "rank1", "both ranks": "both"}
PATHS = {"python train.py": "script", "launch(fn)": "function", "Trainer": "trainer", "phalanx run": "run"}


def _crash(tmp_path: Path, how: str, who: str, env: dict[str, str] | None = None) -> tuple[Any, int]:
    job_file, args = (TRAINER, (WHO[who],)) if how == "Trainer" else (FABRIC_LOOP, (PATHS[how], WHO[who]))
    line = line_of(job_file, "the line the summary names")
    command = [sys.executable, "-m", "phalanx.cli", "run", "--devices", "2"] if how == "phalanx run" else None
    job = run_job(job_file, tmp_path, timeout=180, env=env, command=command, args=args)
    return job, line


def _cases() -> list[Any]:
    # CI: rank 1 failing under every launch path but `phalanx run` (the launcher `python train.py` runs), and both
    # ranks failing under `python train.py`; the rest go through the same summary code (PHALANX_TEST_ALL=1).
    return [pytest.param(who, how, id=f"{who}-{how}",
                         marks=[pytest.mark.slow] if (who == "both ranks" and how != "python train.py")
                         or (who, how) == ("rank 1", "phalanx run") else [])
            for who in WHO for how in PATHS]


@pytest.mark.parametrize(("who", "how"), _cases())
def test_a_crashed_job_shows_its_cause_once_and_the_tracebacks_are_in_the_log(tmp_path: Path, how: str,
                                                                              who: str) -> None:
    job, line = _crash(tmp_path, how, who)
    out = job.output
    assert job.returncode == 1, out[-3000:]
    assert len(out.splitlines()) <= MAX_LINES, out
    assert "step 1" in job.stdout or "batch 1" in job.stdout  # the ranks' stdout still reaches the terminal
    where = f"job.py:{line}"
    assert out.count(where) == 1, out
    assert out.count("ValueError: bad batch at step 2") == 1, out
    # No rank's traceback, no torch error block; fabric.launch(fn) raises in the launching process, whose own
    # traceback (a few lines, uncaught here) ends with the cause.
    assert out.count("Traceback (most recent") == (how == "launch(fn)"), out
    assert "ChildFailedError" not in out and "Sending process" not in out, out
    # "[rankN]: " only labels rank 1's own lines (its prints), never torch's rank-prefixed traceback lines.
    assert all(re.match(r"\[rank1\]: rank 1 (step|batch) \d", ln) for ln in out.splitlines() if "[rank" in ln), out
    if how == "launch(fn)":  # the launching process raises; its own short traceback ends with the cause
        assert out.strip().splitlines()[-1].startswith("phalanx.utils.errors.PhalanxError: fabric.launch(train) "
                                                       "failed: "), out
    else:
        assert out.strip().splitlines()[-1].startswith("[phalanx] job failed: "), out
    first = "rank 1" if who == "rank 1" else r"ranks? [01]"
    assert re.search(rf"{first}.* exited with code 1: ValueError: bad batch at step 2 \(raised at {where} ", out), out
    # The log it names: every failed rank's stderr, its full traceback included.
    named = re.search(r"Tracebacks and stderr of every rank: (\S+) \(rank (\d): (\S+?)[;)]", out)
    assert named, out
    run_dir = tmp_path / named.group(1)
    assert (tmp_path / named.group(3)).is_file()
    logs = {int(p.parent.name): p.read_text() for p in run_dir.glob("*/attempt_*/*/stderr.log")}
    assert sorted(logs) == [0, 1], list(run_dir.rglob("*"))
    failed = [1] if who == "rank 1" else [0, 1]
    for rank in failed:
        assert "Traceback (most recent call last)" in logs[rank], logs[rank]
        assert f'line {line}, in ' in logs[rank] and "ValueError: bad batch at step 2" in logs[rank], logs[rank]


def test_an_exception_that_repeats_at_the_same_step_is_restarted_once(tmp_path: Path) -> None:
    """Trainer(max_restarts=2), rank 1 raising at step 2 of every attempt: attempt 1 fails like attempt 0, so
    the launcher does not try a third; its last line says why."""
    job = run_job(TRAINER, tmp_path, timeout=180, args=("rank1", "2"))
    assert job.returncode == 1, job.output[-3000:]
    (run,) = (tmp_path / "phalanx_logs").glob("phalanx-*")
    assert sorted(p.name for p in run.glob("*/attempt_*")) == ["attempt_0", "attempt_1"]
    cause = (f"rank 1 exited with code 1: ValueError: bad batch at step 2 (raised at job.py:"
             f"{line_of(TRAINER, 'the line the summary names')} (training_step)); rank 0 stopped as a consequence")
    lines = job.stderr.splitlines()
    assert len(lines) == 3 and lines[0].startswith(f"[phalanx] Restart 1 of at most 2: {cause}. No checkpoint to "
                                                   "resume from in "), job.stderr
    assert lines[1].startswith(f"[phalanx] Tracebacks and stderr of every rank: {run.relative_to(tmp_path)} "), lines
    assert lines[2] == (f"[phalanx] job failed: {cause}. Not restarted: attempt 1 failed with the same ValueError at "
                        "step 2 as attempt 0, so a restart would fail the same way again."), lines


def test_show_tracebacks_prints_them_inline(tmp_path: Path) -> None:
    job, line = _crash(tmp_path, "python train.py", "rank 1", env={"PHALANX_SHOW_TRACEBACKS": "1"})
    assert job.returncode == 1
    assert "Traceback (most recent call last)" in job.stderr and f'line {line}, in ' in job.stderr
    assert job.stderr.strip().splitlines()[-1].startswith("[phalanx] job failed: rank 1 exited with code 1: "
                                                          "ValueError: bad batch at step 2")
    assert not (tmp_path / "phalanx_logs").exists()


def test_log_dir_comes_from_the_environment_and_stderr_stays_live(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    for handled in (False, True):
        job = run_job(JOBS / "stderr_shown_live.py", tmp_path, args=(str(handled),), timeout=180,
                      env={"PHALANX_LOG_DIR": str(logs)})
        job.check()
        for rank in (0, 1):
            assert f"stdout of rank {rank}" in job.stdout and f"stderr of rank {rank}" in job.stderr, job.output
        assert "Traceback" not in job.output, job.output
        files = sorted(logs.glob("phalanx-*/*/attempt_0/*/stderr.log"))
        if not handled:  # all of it was shown: nothing is left behind
            assert not logs.exists(), list(logs.rglob("*"))
        else:  # the traceback the terminal left out is in rank 1's log
            assert [p.parent.name for p in files] == ["0", "1"]
            assert "OSError: retrying the download" in files[1].read_text()
    assert not (tmp_path / "phalanx_logs").exists()


def test_phalanx_run_takes_show_tracebacks() -> None:
    from phalanx.cli.commands import build_parser

    assert build_parser().parse_args(["run", "--show-tracebacks", "job.py"]).show_tracebacks is True
    assert build_parser().parse_args(["run", "job.py"]).show_tracebacks is False
