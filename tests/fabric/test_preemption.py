"""fabric.stop_requested / exit_preempted / latest_checkpoint / save_snapshot, in a hand-written loop under
real signals and kills (2 ranks, gloo, CPU): a signal on either rank stops both at the same step and the
rerun continues from the checkpoint; kill -9 of a rank under Fabric(max_restarts=1) resumes from the per-step
snapshot; the final weights equal an uninterrupted run's bit for bit. And, in one process, the record of a
preempted run: no fresh start saves over its checkpoint, and the run that resumed it removes it."""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from pathlib import Path

import pytest
import torch
from job_runner import JOBS, assert_terminal, run_job
from run_if import run_if

import phalanx
from phalanx.distributed.preemption import EXIT_PREEMPTED, Preempted
from phalanx.utils.errors import MisconfigurationError

LOOP = JOBS / "preemption_loop.py"

_references: dict[str, list[float]] = {}


def logs(folder: Path) -> str:
    """The job's run log folder as the terminal names it: a Fabric without loggers keeps it in the working
    directory."""
    (found,) = (folder / "phalanx_logs").glob("phalanx-*")
    return str(found.relative_to(folder))


def reference(tmp_path_factory: pytest.TempPathFactory, strategy: str) -> list[float]:
    """The uninterrupted run's final weights (one run per strategy per session)."""
    if strategy not in _references:
        folder = tmp_path_factory.mktemp(f"reference-{strategy}")
        job = run_job(LOOP, folder, timeout=120, args=(strategy, "-1", "0", "none")).check()
        _references[strategy] = job.reports[0]["weights"]
    return _references[strategy]


STRATEGIES = [
    "ddp",
    pytest.param("fsdp", marks=[run_if(fsdp=True), pytest.mark.slow]),
    *(pytest.param(f"deepspeed_stage_{n}", marks=[run_if(deepspeed=True), pytest.mark.slow]) for n in (1, 2, 3)),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_signal_on_one_rank_stops_both_at_the_same_step_and_the_rerun_matches(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, strategy: str
) -> None:
    rank, step = random.randrange(2), random.randrange(1, 19)
    expected = reference(tmp_path_factory, strategy)
    job = run_job(LOOP, tmp_path, timeout=120, args=(strategy, str(rank), str(step), "signal"))
    why = f"SIGTERM to rank {rank} after step {step}"
    assert job.returncode == EXIT_PREEMPTED, (why, job.output[-3000:])
    for r in (0, 1):  # both ranks stopped at the step the signal came, and agree on who got it
        assert job.reports[r]["stopped_at"] == step, (why, job.reports)
        assert job.reports[r]["stop"] == f"SIGTERM on rank {rank}"
    # All the terminal shows: the stop and how to resume, in one line; the rerun says where it resumed.
    took = r" \(\d+\.\d s after the signal\)" if rank == 0 else ""  # rank 0 prints; it knows when it got its own
    assert_terminal(job.stderr, strategy, rf"re:\[phalanx\] preempted at step {step} by SIGTERM on rank {rank}; "
                    rf"checkpoint: ckpts/step-{step}\.ckpt{took}\. Run the same command again to resume from it\. "
                    f"Logs: {re.escape(logs(tmp_path))}")
    rerun = run_job(LOOP, tmp_path, timeout=120, args=(strategy, str(rank), str(step), "signal")).check()
    assert_terminal(rerun.stderr, strategy, f"[phalanx] Resumed from ckpts/step-{step}.ckpt at step {step}.")
    assert rerun.reports[0]["resumed_at"] == step
    assert rerun.reports[0]["weights"] == expected, why  # bit-identical


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kill_9_under_max_restarts_resumes_from_the_snapshot(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, strategy: str
) -> None:
    rank, step = random.randrange(2), random.randrange(1, 19)
    expected = reference(tmp_path_factory, strategy)
    job = run_job(LOOP, tmp_path, timeout=180, args=(strategy, str(rank), str(step), "kill"))
    why = f"{strategy}: kill -9 of rank {rank} after step {step}"
    assert job.returncode == 0, (why, job.output[-3000:])
    # Small states are copied before save_snapshot returns, so nothing is recomputed (a large state's copy
    # overlaps the next step; losing it costs one step: tests/checkpoint/test_snapshot_writer.py).
    assert job.reports[0]["attempt"] == 1 and job.reports[0]["resumed_at"] == step, (why, job.reports)
    # Shared-memory snapshots are named by a reference; under DeepSpeed they are checkpoint files.
    assert re.search(rf"snapshot-step={step:09d}$", job.reports[0]["resumed_from"]), (why, job.reports)
    # The restart is said in one line: what failed, where the loop resumed (fabric.load of what
    # fabric.latest_checkpoint found), where the logs are.
    said = (f"[phalanx] Restart 1 of at most 1: rank {rank} was killed by SIGKILL; rank {1 - rank} stopped as a "
            f"consequence. Resumed from {job.reports[0]['resumed_from']} at step {step}. Logs: {logs(tmp_path)}")
    assert_terminal(job.stderr, strategy, said)
    assert job.reports[0]["weights"] == expected, why  # bit-identical, no step lost
    assert not Path(job.reports[0]["snapshots"]).exists()  # removed when the job ended well


def test_a_preempted_runs_checkpoint_is_kept_until_a_run_resumes_it(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delattr(sys, "last_value", raising=False)  # a failure of an earlier test is not this run's
    model = torch.nn.Linear(2, 1)
    state = {"model": model, "step": 3}
    fabric = phalanx.Fabric(accelerator="cpu", devices=1)
    fabric.save("ckpts/step-3.ckpt", state)
    with pytest.raises(Preempted, match=r"^preempted at step 3 by request; checkpoint: ckpts/step-3\.ckpt\. Run the "
                                        r"same command again to resume from it\.$"):
        fabric.exit_preempted("ckpts/step-3.ckpt", step=3)
    fabric.teardown()
    record = json.loads((tmp_path / "preempted.json").read_text())  # the working directory: no root_dir given
    assert (record["checkpoint"], record["step"]) == (str(tmp_path / "ckpts" / "step-3.ckpt"), 3)
    kept = hashlib.sha256((tmp_path / "ckpts" / "step-3.ckpt").read_bytes()).hexdigest()

    rerun = phalanx.Fabric(accelerator="cpu", devices=1)  # a fresh start may save elsewhere, not over it
    with pytest.raises(MisconfigurationError, match=re.escape(
            "fabric.save('ckpts/step-3.ckpt') would overwrite the checkpoint of the run preempted at step 3 in this "
            "folder (preempted.json records it), which this run has not resumed. Either resume it")):
        rerun.save("ckpts/step-3.ckpt", state)
    rerun.save("ckpts/elsewhere.ckpt", state)
    assert hashlib.sha256((tmp_path / "ckpts" / "step-3.ckpt").read_bytes()).hexdigest() == kept
    rerun.teardown()
    assert (tmp_path / "preempted.json").exists()  # it did not resume the preempted run

    resumed = phalanx.Fabric(accelerator="cpu", devices=1)
    resumed.load("ckpts/step-3.ckpt", state)
    state["step"] = 4
    resumed.save("ckpts/step-3.ckpt", state)  # once resumed, the run's own checkpoint
    resumed.teardown()
    assert not (tmp_path / "preempted.json").exists()  # it resumed the run and ended well
