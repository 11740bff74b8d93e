"""Metrics to ``metrics.csv`` (one row per step; columns grow as new metrics appear)."""

from __future__ import annotations

import csv
import json
import os
from argparse import Namespace
from pathlib import Path
from typing import Any

from phalanx.loggers.base import FolderLogger, flatten_hparams


class CSVLogger(FolderLogger):
    """Writes ``<root_dir>/<name>/version_<n>/metrics.csv`` and ``hparams.json``.

    Rows are buffered and appended every ``flush_every`` rows, so a flush costs O(rows since the last
    one); the file is rewritten (atomically) only when a metric name appears that its header lacks."""

    def __init__(
        self, root_dir: str | Path = "logs", name: str = "phalanx", version: int | str | None = None,
        flush_every: int = 100, *, save_dir: str | Path | None = None, flush_logs_every_n_steps: int | None = None,
        prefix: str = "",
    ) -> None:
        self._prefix = prefix  # prepended to metric names as "<prefix>-<name>", as in Lightning
        # save_dir / flush_logs_every_n_steps: Lightning's names for root_dir / flush_every.
        root_dir = save_dir if save_dir is not None else root_dir
        flush_every = flush_logs_every_n_steps if flush_logs_every_n_steps is not None else flush_every
        super().__init__(root_dir, name, version)
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = []  # every key logged so far, in order of appearance
        self._header: list[str] | None = None  # metrics.csv's columns as last read or written
        self._flush_every = flush_every

    @property
    def metrics_file(self) -> Path:
        return self.log_dir / "metrics.csv"

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / "hparams.json").write_text(json.dumps(flatten_hparams(params), indent=2))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._prefix:
            metrics = {f"{self._prefix}-{k}": v for k, v in metrics.items()}
        row: dict[str, Any] = {"step": step, **metrics}
        row["step"] = step  # the column is the logging step, also when a metric is named "step" (as in Lightning)
        for key in row:
            if key not in self._columns:
                self._columns.append(key)
        self._rows.append(row)
        if len(self._rows) >= self._flush_every:
            self.save()

    def save(self) -> None:
        """Append the buffered rows; rewrite the file only when its header must grow."""
        if not self._rows:  # nothing to write: a run that logged nothing (or was refused) leaves no file
            return
        exists = self.metrics_file.exists()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self._header is None:  # a file from before this logger (a resumed run): keep its columns
            self._header = self._read_header() if exists else []
        new = [c for c in self._columns if c not in self._header]
        if new or not exists:
            self._rewrite(self._header + new)
        else:
            with open(self.metrics_file, "a", newline="") as fh:
                csv.DictWriter(fh, fieldnames=self._header).writerows(self._rows)
        self._rows = []

    def _read_header(self) -> list[str]:
        with open(self.metrics_file, newline="") as fh:
            return next(csv.reader(fh), [])

    def _rewrite(self, header: list[str]) -> None:
        existing: list[dict[str, Any]] = []
        if self.metrics_file.exists():
            with open(self.metrics_file, newline="") as fh:
                existing = list(csv.DictReader(fh))
        tmp = self.metrics_file.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=header)
            writer.writeheader()
            writer.writerows(existing)
            writer.writerows(self._rows)
        os.replace(tmp, self.metrics_file)
        self._header = header
