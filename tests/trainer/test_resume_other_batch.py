"""Resuming with another global batch size (ranks x batch x accumulation): the data position is global.

The checkpoint stores how many samples of the epoch's order were consumed; a run with another global batch
continues at that sample (its first batch starts there even where the position is no multiple of the new
batch), counts its batches from there, says in one message how the steps relate, and never trains on the
padding that made the first run's ranks even.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import JOBS, run_job
from survival_job import Indexed
from torch.utils.data import DataLoader
from trainer_support import Regressor, quiet

import phalanx
from phalanx.trainer.loaders import TrainSampler
from phalanx.trainer.loops import windows

pytestmark = pytest.mark.timeout(240)


class Seen(Regressor):
    """Records each (epoch, sample index) it trains on."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam")
        self.seen: list[tuple[int, int]] = []
        self.batch_indices: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.seen += [(self.trainer.current_epoch, int(i)) for i in idx]
        self.batch_indices.append(batch_idx)
        return super().training_step((x, y), batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch[:2], batch_idx)


class SaveAt:
    """Writes a checkpoint right after optimizer step ``step`` (mid-epoch)."""

    def __init__(self, step: int, path: Path | str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and not trainer.in_window:
            trainer.save_checkpoint(self.path)


@pytest.fixture
def notices() -> Iterator[list[str]]:
    """The batch-size messages of the ``phalanx`` logger while the test runs."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("The checkpoint was written with"):
                messages.append(record.getMessage())

    handler, log = Keep(), logging.getLogger("phalanx")
    log.addHandler(handler)
    try:
        yield messages
    finally:
        log.removeHandler(handler)


def _fit(n: int, batch: int, accumulate: int = 1, ckpt_path: Any = None, **kwargs: Any) -> tuple[Any, Seen]:
    phalanx.seed_everything(3, verbose=False)  # the same epoch order in every attempt
    trainer = phalanx.Trainer(accumulate_grad_batches=accumulate, **quiet(**kwargs))
    model = Seen()
    trainer.fit(model, DataLoader(Indexed(n, torch.float64), batch_size=batch, shuffle=True), ckpt_path=ckpt_path)
    return trainer, model


def test_windows_after_a_start_inside_a_window() -> None:
    got = [(i, size, boundary) for i, _, size, boundary in windows(iter(range(3, 10)), 3, 10, 2)]
    assert got == [(3, 1, True), (4, 2, False), (5, 2, True), (6, 2, False), (7, 2, True), (8, 2, False),
                   (9, 2, True)]
    unknown = [(i, size, boundary) for i, _, size, boundary in windows(iter(range(3, 8)), 3, None, 2)]
    assert unknown == [(3, 1, True), (4, 2, False), (5, 2, True), (6, 2, False), (7, 2, True)]


def test_a_position_past_the_last_sample_leaves_no_padding() -> None:
    # 51 samples consumed in batches of 3 on one process; two ranks would pad to 52 (the epoch's first sample).
    for skip in (51, 52):
        samplers = [TrainSampler(51, 2, rank, shuffle=True, seed=0) for rank in (0, 1)]
        for sampler in samplers:
            sampler.skip = skip
        assert [len(s) for s in samplers] == [0, 0]
        assert [list(s) for s in samplers] == [[], []]
    sampler = TrainSampler(51, 2, 0, shuffle=True, seed=0)
    sampler.skip = 50
    assert len(sampler) == 1 == len(list(sampler))  # the last real sample (rank 1: the padding)


def test_single_process_resumes_twice_with_other_batches_and_accumulation(tmp_path: Path, notices: list[str]) -> None:
    n = 50
    _, first = _fit(n, 4, max_steps=5, callbacks=[SaveAt(5, tmp_path / "a.ckpt")])  # 20 samples
    # Batch 3, accumulation 2: sample 20 is 6 batches and 2 samples in; counted from the end of the epoch
    # (17 batches, 10 left) the run continues at batch 7, a window of its own before the aligned ones.
    trainer, second = _fit(n, 3, 2, ckpt_path=tmp_path / "a.ckpt", max_steps=8,
                           callbacks=[SaveAt(8, tmp_path / "b.ckpt")])
    assert notices == [
        "The checkpoint was written with 4 samples per optimizer step (1 rank x batch 4 x accumulation 1) and this "
        "run takes 6 (1 rank x batch 3 x accumulation 2): it continues at sample 20 of epoch 0 (batch 7 of 17 at "
        "the new size, the first one starting at that sample); global_step continues from 5, each further step "
        "consuming 6 samples."
    ]
    assert second.batch_indices == [7, 8, 9, 10, 11]  # batch 7 (a window of its own), then (8, 9), (10, 11)
    saved = torch.load(tmp_path / "b.ckpt", weights_only=True)["loops"]
    assert saved["batches_done"] == 12 and saved["samples_consumed"] == 35 and saved["global_step"] == 8
    # The same size again (b.ckpt is at batch 12 and sample 35 of this grid): the next checkpoint still
    # counts the true position, 35 + 2 x 3.
    _, same = _fit(n, 3, 2, ckpt_path=tmp_path / "b.ckpt", max_steps=9, callbacks=[SaveAt(9, tmp_path / "c.ckpt")])
    assert same.batch_indices == [12, 13]
    assert torch.load(tmp_path / "c.ckpt", weights_only=True)["loops"]["samples_consumed"] == 41
    trainer, third = _fit(n, 5, ckpt_path=tmp_path / "b.ckpt", max_epochs=2)
    assert "it continues at sample 35 of epoch 0 (batch 7 of 10 at the new size)" in notices[-1]
    assert trainer.global_step == 8 + 3 + 10
    seen = first.seen + second.seen + third.seen
    assert Counter(i for e, i in seen if e == 0) == Counter(range(n))
    assert Counter(i for e, i in seen if e == 1) == Counter(range(n))


def test_limit_and_val_check_interval_count_batches_of_the_new_size(tmp_path: Path) -> None:
    _fit(40, 4, max_steps=5, callbacks=[SaveAt(5, tmp_path / "a.ckpt")])  # sample 20 = batch 10 of batch 2

    class Validations:
        def __init__(self) -> None:
            self.steps: list[int] = []
            self.batches_done: list[int] = []

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            self.batches_done.append(trainer.batches_done)  # what a progress bar starts from

        def on_validation_end(self, trainer: Any, module: Any) -> None:
            self.steps.append(trainer.global_step)

    val = DataLoader(Indexed(8, torch.float64), batch_size=4)
    phalanx.seed_everything(3, verbose=False)
    trainer = phalanx.Trainer(max_epochs=1, limit_train_batches=16, val_check_interval=4,
                              callbacks=[probe := Validations()], **quiet())
    model = Seen()
    trainer.fit(model, DataLoader(Indexed(40, torch.float64), batch_size=2, shuffle=True), val,
                ckpt_path=tmp_path / "a.ckpt")
    # Batches 10..15 of 16: validation after batch 11 (12 batches) and at the epoch's end.
    assert model.batch_indices == [10, 11, 12, 13, 14, 15]
    assert probe.steps == [7, 11] and trainer.global_step == 11 and probe.batches_done == [10]


JOB = JOBS / "resume_other_batch.py"


def _seen(path: Path, batches: bool = False) -> list[tuple[int, int]]:
    """(epoch, sample) per line of a job's record, or (epoch, batch_idx) with ``batches``."""
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(int(row[0]), int(row[2 if batches else 1])) for row in rows]


def test_ddp_checkpoint_resumes_on_one_process_and_with_a_smaller_batch(tmp_path: Path, notices: list[str]) -> None:
    # 51 samples: two ranks pad the epoch to 52 with its first sample. The job's first run (2 ranks x batch 4)
    # stops after step 5, at sample 40; then it resumes from that checkpoint with 2 ranks x batch 3.
    n = 51
    resumed = run_job(JOB, tmp_path).check()  # both runs: one job (see JOB)
    first = _seen(tmp_path / "seen_first_0.txt") + _seen(tmp_path / "seen_first_1.txt")
    assert len(first) == 40 and {e for e, _ in first} == {0}

    # One process, batch 4: the 11 samples left, the padding never (each sample once in epoch 0).
    trainer, single = _fit(n, 4, ckpt_path=tmp_path / "mid.ckpt", max_epochs=2)
    assert trainer.global_step == 5 + 3 + 13 and single.batch_indices[:4] == [10, 11, 12, 0]
    assert Counter(i for e, i in first + single.seen if e == 0) == Counter(range(n))
    assert Counter(i for e, i in single.seen if e == 1) == Counter(range(n))
    assert ("The checkpoint was written with 8 samples per optimizer step (2 ranks x batch 4 x accumulation 1) and "
            "this run takes 4 (1 rank x batch 4 x accumulation 1): it continues at sample 40 of epoch 0 (batch 10 of "
            "13 at the new size); global_step continues from 5, each further step consuming 4 samples.") in notices

    # Two ranks, batch 3: 40 is no multiple of 6, so the first batch starts at sample 40 (batch 7 of 9).
    assert resumed.reports[0]["step"] == resumed.reports[1]["step"] == 5 + 2 + 9
    assert resumed.reports[0]["messages"] == [
        "The checkpoint was written with 8 samples per optimizer step (2 ranks x batch 4 x accumulation 1) and this "
        "run takes 6 (2 ranks x batch 3 x accumulation 1): it continues at sample 40 of epoch 0 (batch 7 of 9 at the "
        "new size, the first one starting at that sample); global_step continues from 5, each further step "
        "consuming 6 samples."
    ]
    assert resumed.reports[1]["messages"] == []
    assert sorted({b for e, b in _seen(tmp_path / "seen_resume_0.txt", batches=True) if e == 0}) == [7, 8]
    later = _seen(tmp_path / "seen_resume_0.txt") + _seen(tmp_path / "seen_resume_1.txt")
    # Epoch 0: every sample once, plus the one sample an uninterrupted 2-rank run pads with (the epoch's first,
    # which rank 0 trained on first): 11 samples left cannot be split evenly without it.
    counts = Counter(i for e, i in first + later if e == 0)
    assert set(counts) == set(range(n)) and sum(counts.values()) == 52
    assert [i for i, c in counts.items() if c == 2] == [_seen(tmp_path / "seen_first_0.txt")[0][1]]
    epoch1 = Counter(i for e, i in later if e == 1)
    assert set(epoch1) == set(range(n)) and sum(epoch1.values()) == 52
