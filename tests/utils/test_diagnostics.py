"""What a run says once (phalanx.utils.diagnostics.once_per_run): the seed and the model summary are said by the
first attempt only, and not again by a rank that re-runs the script its launcher already ran; notices go to the
stderr of the moment (a progress bar's, while it draws)."""

from __future__ import annotations

import io
import sys

import pytest

import phalanx
from phalanx.utils import diagnostics


def _said(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    said: list[str] = []
    monkeypatch.setattr(diagnostics, "info", lambda message, rank=None: said.append(message))
    return said


def test_the_seed_is_said_once_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    said = _said(monkeypatch)
    for name in ("TORCHELASTIC_RESTART_COUNT", diagnostics.RELAUNCHED_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    phalanx.seed_everything(42)  # one process, or the launching one
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv(diagnostics.RELAUNCHED_VARIABLE, "1")
    phalanx.seed_everything(42)  # a rank re-running the script before it joined the job: the launcher said it
    monkeypatch.setattr(diagnostics.dist, "is_initialized", lambda: True)
    phalanx.seed_everything(43)  # after it joined (inside fit, or a launch(fn) function): only it can say it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    phalanx.seed_everything(43)  # a restarted attempt: its run's first attempt said it
    diagnostics.once_per_run("the model summary")
    assert said == ["Seed set to 42", "Seed set to 43"]


def test_notices_go_to_the_stderr_of_the_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    screen = io.StringIO()  # what a live progress display (rich's) puts in place of sys.stderr while it draws
    monkeypatch.setattr(sys, "stderr", screen)
    diagnostics.notice("a rank is slow")
    assert "[phalanx] a rank is slow\n" in screen.getvalue()
