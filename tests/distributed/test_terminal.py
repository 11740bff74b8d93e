"""How the ranks' output reaches the launcher's terminal (:mod:`phalanx.distributed.terminal`): each rank's
lines whole, other ranks' than rank 0 labelled, nothing glued to a progress bar, tracebacks left to the log;
and, end to end, the terminal of a real 2-rank run with a progress bar, notices, a restart and a killed rank."""

from __future__ import annotations

import io
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from job_runner import JOB_PYTHONPATH, JOBS

from phalanx.distributed.terminal import Tail, Terminal, TracebackFilter

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------- what of a rank's stderr is shown
def _shown(lines: list[str]) -> str:
    f = TracebackFilter()
    return "".join(f.feed(line) for line in lines)


def test_filter_hides_tracebacks_and_shows_everything_else() -> None:
    plain = ["epoch 0\n", "Traceback (most recent call last):\n", '  File "job.py", line 3, in <module>\n',
             "    main()\n", "    ^^^^^^\n", "ValueError: boom\n", "after\n"]
    assert _shown(plain) == "epoch 0\nafter\n"
    chained = ["[rank0]: Traceback (most recent call last):\n", '[rank0]:   File "x.py", line 1, in f\n',
               "[rank0]: RuntimeError: Connection closed by peer\n", "\n",
               "[rank0]: The above exception was the direct cause of the following exception:\n", "\n",
               "[rank0]: Traceback (most recent call last):\n", '[rank0]:   File "job.py", line 9, in <module>\n',
               "[rank0]: phalanx.utils.errors.RankGoneError: rank 1 failed\n", "[rank0]: second message line\n",
               "[phalanx] rank 0 has waited 2s in save\n"]
    assert _shown(chained) == "[phalanx] rank 0 has waited 2s in save\n"
    unprefixed_chain = ["Traceback (most recent call last):\n", "  File 'a.py', line 1\n", "KeyError: 'a'\n", "\n",
                        "During handling of the above exception, another exception occurred:\n", "\n",
                        "Traceback (most recent call last):\n", "  File 'a.py', line 2\n", "ValueError: b\n", "ok\n"]
    assert _shown(unprefixed_chain) == "ok\n"
    watchdog = ["[phalanx] rank 0 is ending: RankGoneError: backward cannot complete\n",
                "[phalanx] rank 0's main thread was blocked here:\n", '  File "job.py", line 26, in <module>\n',
                "    fabric.backward(loss)\n"]
    assert _shown(watchdog) == ""
    progress = ["\r", "Epoch 0:  50%|#####     | 1/2\r", "Epoch 0: 100%|##########| 2/2\n", "warning: x\n"]
    assert _shown(progress) == "".join(progress)


def test_tail_shows_a_progress_bar_before_its_line_ends_but_holds_back_a_traceback(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    log.write_text("")
    tail = Tail(str(log), stderr=True)
    with log.open("a") as fh:
        fh.write("\rEpoch 0:  50%|#####")
        fh.flush()
        assert tail.pump(False) == [("\r", True)]  # the bar itself waits one poll, to see whether it grows
        assert tail.pump(False) == [("Epoch 0:  50%|#####", True)]
        fh.write("\rEpoch 0: 100%|##########|\nTraceback (most rec")
        fh.flush()
        # The rest of the bar's line continues what was shown; the next bar starts its line again.
        assert tail.pump(False) == [("\r", False), ("Epoch 0: 100%|##########|\n", True)]
        assert tail.pump(False) == []  # may start a traceback: not shown until its line ends
        fh.write('ent call last):\n  File "job.py", line 3\nValueError: x\ndone')
        fh.flush()
        assert tail.pump(False) == []
        fh.write("\nwritten after the mark")
        fh.flush()
        tail.mark()
        fh.write(", not read by this pump\n")
        fh.flush()
        assert tail.pump(False) == [("done\n", True)]  # up to where mark() saw the file end
    assert tail.pump(True) == [("written after the mark, not read by this pump\n", True)]
    stdout = tmp_path / "stdout.log"
    stdout.write_text("Traceback (most recent call last): printed, not raised\n")
    assert Tail(str(stdout), stderr=False).pump(False) == [(stdout.read_text(), True)]  # stdout: nothing hidden


# ---------------------------------------------------------------- the terminal
def test_lines_stay_whole_other_ranks_are_labelled_and_nothing_is_glued_to_a_bar() -> None:
    screen = io.StringIO()  # stdout and stderr in one place, as on a terminal
    terminal = Terminal(screen, screen)
    bar, out0, out1 = object(), object(), object()  # rank 0's stderr (its progress bar), rank 0's and rank 1's stdout
    terminal.show(bar, "", True, [("\r", True), ("Epoch 0:  50%", True)])
    terminal.show(out1, "[rank1]: ", False, [("rank 1 partial", True)])  # a line rank 1 has not ended yet
    terminal.show(out0, "", False, [("loss 0.6\n", True)])
    terminal.show(out1, "[rank1]: ", False, [(" and the rest\n", False)])
    terminal.show(bar, "", True, [("\r", False), ("Epoch 0: 100%", True), ("\r", False)])
    # tqdm.write: the bar cleared with spaces, the line, the bar again.
    terminal.show(bar, "", True, [("             \r", True), ("[phalanx] a notice\n", True), ("\r", True),
                                  ("Epoch 0: 100%", True)])
    terminal.show(out0, "", False, [("[rank1]: already labelled\n", True)])
    terminal.end()
    assert screen.getvalue() == (
        "\rEpoch 0:  50%\n"  # ended before another source's line
        "[rank1]: rank 1 partial\n"
        "loss 0.6\n"
        "[rank1]:  and the rest\n"  # the rest of a line another source's line ended: a line of its own, labelled
        "\rEpoch 0: 100%\r             \r[phalanx] a notice\n\rEpoch 0: 100%\n"  # a cleared bar is not ended
        "[rank1]: already labelled\n")

    out, err = io.StringIO(), io.StringIO()  # stdout elsewhere (a file): a bar on stderr is none of its business
    terminal = Terminal(out, err)
    terminal.show(bar, "", True, [("Epoch 0:  50%", True)])
    terminal.show(out0, "", False, [("loss 0.6\n", True)])
    terminal.end()  # what the launcher says next starts a line of its own
    assert (out.getvalue(), err.getvalue()) == ("loss 0.6\n", "Epoch 0:  50%\n")


# ---------------------------------------------------------------- a real 2-rank run
def _visible(line: str) -> str:
    """What a terminal shows of one line: each piece after a carriage return is drawn over it from the start."""
    shown: list[str] = []
    for piece in line.split("\r"):
        shown[:len(piece)] = piece
    return "".join(shown).rstrip()


def test_two_ranks_write_whole_lines_and_nothing_is_glued_to_a_bar(tmp_path: Path) -> None:
    """Both ranks print long lines at every step while rank 0 draws a tqdm bar and says notices (its own, the
    snapshot cadence, the restart); rank 1 is killed once mid-fit and once after it. stdout and stderr go to one
    place, as on a terminal: no line holds two ranks' text, rank 1's lines are labelled, no notice or line is
    glued to the bar, the once-per-run notices are said once (not again by the ranks or the restart), and the job
    ends with the killed rank's exit code (137), its last lines on lines of their own."""
    (tmp_path / "job.py").write_text((JOBS / "terminal_output.py").read_text())
    env = {**os.environ, "PYTHONPATH": JOB_PYTHONPATH}
    proc = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=200)
    screen = proc.stdout.decode()  # not text=True, which would turn each "\r" of the bar into a line break
    assert proc.returncode == 137, screen[-3000:]
    lines = [_visible(line) for line in screen.split("\n")]
    says = re.compile(r"(\[rank1\]: )?rank (\d) (says step \d+ \.{100} end of rank \2's line|finished at step 120)")
    printed = {0: 0, 1: 0}
    for line in lines:
        if "says step" in line or "finished at" in line:  # a line of its own, one rank's, labelled if rank 1's
            found = says.fullmatch(line)
            assert found and (found.group(1) is not None) == (found.group(2) == "1"), repr(line)
            printed[int(found.group(2))] += 1
        if "[phalanx]" in line:  # rank 0's and the launcher's: unlabelled, and not drawn over a bar
            assert line.startswith("[phalanx] ") and "it/s" not in line and "%|" not in line, repr(line)
    assert printed[0] >= 121 and printed[1] >= 121, printed  # 120 steps and the last line; redone steps print again
    assert any(line.startswith("Epoch 1: 100%|") for line in lines), screen[-3000:]
    # The notice went through the bar's own path (tqdm.write): the bar was cleared with spaces just before it.
    assert re.search(r"\r {20,}\r\[phalanx\] a notice while the bar is drawn \(step 40\)\n", screen), screen[-3000:]
    assert screen.count("Seed set to 3") == 1  # said by the launching process, not again by rank 0 nor the restart
    assert screen.count("Total params") == 1  # the model summary: the first attempt's only
    # The cadence is said once its measurements settle, which on a loaded machine may take longer than this short
    # run (test_snapshot_cadence.py holds when it is said), and again only when it changes by 4x or more (a load
    # that comes and goes can do that): never the same cadence twice in one run, restarts included.
    said = [int(found.group(1)) for line in lines
            if (found := re.match(r"\[phalanx\] Snapshots in \S+: snapshot every (\d+) steps?:", line))]
    assert all(max(a, b) >= 4 * min(a, b) for a, b in itertools.pairwise(said)), said
    restart = [line for line in lines if line.startswith("[phalanx] Restart 1 of at most 1: rank 1 was killed by ")]
    assert len(restart) == 1, screen[-3000:]
    assert lines[-2:] == ["[phalanx] job failed: rank 1 was killed by SIGKILL; rank 0 stopped as a consequence.", ""]
