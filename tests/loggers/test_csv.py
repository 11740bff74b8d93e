"""CSVLogger keeps Lightning's meaning of its ``step`` column."""

from __future__ import annotations

import csv
from pathlib import Path

from phalanx.loggers import CSVLogger


def test_step_column_is_the_logging_step_even_with_a_metric_named_step(tmp_path: Path) -> None:
    """LitGPT logs a metric called ``step``: the column still holds the step the logger was given."""
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"loss": 1.5, "step": 99.0}, step=3)
    logger.log_metrics({"loss": 1.25}, step=4)
    logger.save()
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["loss"]) for r in rows] == [("3", "1.5"), ("4", "1.25")]
