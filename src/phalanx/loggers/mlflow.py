"""``MLFlowLogger``: metrics, hyperparameters and checkpoints to an MLflow tracking store.

With ``log_model=True`` the checkpoints reach the tracking store as artifacts, and metric names are
made acceptable to MLflow before the first one is sent, not rejected halfway through a fit. mlflow is imported
only when the logger first talks to the store (``pip install 'phalanx[mlflow]'``). Like every
phalanx logger it is called on global rank 0 only.

The store is ``tracking_uri`` (any MLflow URI: ``http://host:port`` for a server, ``sqlite:///x.db``,
``file:/path``), else ``$MLFLOW_TRACKING_URI``, else a SQLite store ``<save_dir>/mlflow.db`` with the
artifacts in ``<save_dir>/artifacts``. (Lightning's default is a file store under ``save_dir``, which
MLflow 3 no longer accepts without ``MLFLOW_ALLOW_FILE_STORE=true``; pass ``tracking_uri="file:..."``
for one.)
"""

from __future__ import annotations

import os
import re
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from phalanx.loggers.base import Logger, flatten_hparams
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.tensors import optional_module

_BAD_KEY = re.compile(r"[^A-Za-z0-9_\-. /:]")


def _mlflow() -> Any:
    return optional_module("mlflow", "MLFlowLogger", "mlflow")


class MLFlowLogger(Logger):
    """Args (Lightning's):
        experiment_name: created if it does not exist.
        run_name / tags: of the new run (ignored when ``run_id`` continues an existing run).
        tracking_uri / save_dir: where the store is (see the module docstring).
        log_model: False; True (checkpoints of every ModelCheckpoint at the end of training); "all"
            (each checkpoint as soon as it is written).
        prefix: prepended to every metric name (joined with "-").
        artifact_location: of a newly created experiment.
        run_id: continue this run instead of creating one.
        synchronous: passed to MLflow's logging calls (None: MLflow's default).
    """

    def __init__(
        self,
        experiment_name: str = "lightning_logs",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: dict[str, Any] | None = None,
        save_dir: str | None = "./mlruns",
        log_model: bool | str = False,
        prefix: str = "",
        artifact_location: str | None = None,
        run_id: str | None = None,
        synchronous: bool | None = None,
    ) -> None:
        if log_model not in (True, False, "all"):
            raise MisconfigurationError(f"MLFlowLogger log_model={log_model!r}; use False, True or 'all'.")
        if tracking_uri is None:
            tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if tracking_uri is None and save_dir:
            root = Path(save_dir).absolute()
            root.mkdir(parents=True, exist_ok=True)
            tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
            artifact_location = artifact_location or (root / "artifacts").as_uri()
        self._tracking_uri = tracking_uri
        self._experiment_name, self._run_name, self._tags = experiment_name, run_name, tags
        self._save_dir = save_dir
        self._log_model = log_model
        self._prefix = prefix
        self._artifact_location = artifact_location
        self._run_id = run_id
        self._synchronous = synchronous
        self._client: Any = None
        self._experiment_id: str | None = None
        self._checkpoint_callbacks: list[Any] = []
        self._logged_checkpoints: dict[str, float] = {}  # path -> mtime when uploaded
        self._finished = False  # the run is marked ended; logging again reopens it

    # ------------------------------------------------------------------ the run
    @property
    def experiment(self) -> Any:
        """The ``mlflow.MlflowClient`` (the run is created on first use)."""
        if self._client is None:
            mlflow = _mlflow()
            client = mlflow.MlflowClient(tracking_uri=self._tracking_uri)
            if self._run_id is not None:
                self._experiment_id = client.get_run(self._run_id).info.experiment_id
            else:
                found = client.get_experiment_by_name(self._experiment_name)
                if found is not None:
                    self._experiment_id = found.experiment_id
                else:
                    self._experiment_id = client.create_experiment(
                        self._experiment_name, artifact_location=self._artifact_location
                    )
                tags = {k: str(v) for k, v in (self._tags or {}).items()}
                if self._run_name is not None:
                    tags.setdefault("mlflow.runName", self._run_name)
                run = client.create_run(self._experiment_id, tags=tags, run_name=self._run_name)
                self._run_id = run.info.run_id
            self._client = client
        return self._client

    @property
    def run_id(self) -> str:
        self.experiment  # noqa: B018 - creates the run
        assert self._run_id is not None
        return self._run_id

    @property
    def experiment_id(self) -> str:
        self.experiment  # noqa: B018
        assert self._experiment_id is not None
        return self._experiment_id

    @property
    def name(self) -> str:
        return self.experiment_id

    @property
    def version(self) -> str:
        return self.run_id

    @property
    def save_dir(self) -> str | None:
        return self._save_dir

    @property
    def log_dir(self) -> str | None:
        return self.save_dir

    def _kwargs(self) -> dict[str, Any]:
        return {} if self._synchronous is None else {"synchronous": self._synchronous}

    # ------------------------------------------------------------------ logging
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        from mlflow.entities import Param

        flat = flatten_hparams(params)
        # MLflow caps a parameter value at 6000 characters and fails the whole batch beyond it.
        entries = [Param(k, str(v)[:6000]) for k, v in flat.items()]
        for start in range(0, len(entries), 100):
            self.experiment.log_batch(self.run_id, params=entries[start:start + 100], **self._kwargs())
        self._finished = False

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = []
        for key, value in metrics.items():
            name = f"{self._prefix}-{key}" if self._prefix else key
            entries.append(Metric(_BAD_KEY.sub("_", name), float(value), now, step or 0))
        if entries:
            self.experiment.log_batch(self.run_id, metrics=entries, **self._kwargs())
            self._finished = False

    # ------------------------------------------------------------------ checkpoints
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        if checkpoint_callback not in self._checkpoint_callbacks:
            self._checkpoint_callbacks.append(checkpoint_callback)
        if self._log_model == "all":
            self._log_checkpoints(checkpoint_callback)

    def _log_checkpoints(self, callback: Any) -> None:
        paths = {p for p in (getattr(callback, "best_model_path", ""), getattr(callback, "last_model_path", ""),
                             *getattr(callback, "best_k_models", {})) if p}
        for path in sorted(paths):
            file = Path(path)
            if not file.is_file() or self._logged_checkpoints.get(path) == file.stat().st_mtime:
                continue
            self.experiment.log_artifact(self.run_id, str(file), artifact_path=f"model/checkpoints/{file.stem}")
            self._logged_checkpoints[path] = file.stat().st_mtime

    def finalize(self, status: str = "success") -> None:
        # Each stage ends the run (as in Lightning); the interpreter-exit call then has nothing to do.
        if self._client is None or self._finished:
            return
        self._finished = True
        if self._log_model is True:
            for callback in self._checkpoint_callbacks:
                self._log_checkpoints(callback)
        state = {"success": "FINISHED", "failed": "FAILED", "finished": "FINISHED"}.get(status, "FINISHED")
        self.experiment.set_terminated(self.run_id, state)
