"""``WandbLogger``: metrics, hyperparameters and checkpoints to Weights & Biases.

With ``log_model=True`` the checkpoints are logged as artifacts, and the step axis is
``trainer.global_step``. wandb is imported only when the
run starts (``pip install 'phalanx[wandb]'``); ``offline=True`` writes the run under ``save_dir``
without any network (``wandb sync`` uploads it later). Called on global rank 0 only.
"""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from typing import Any

from phalanx.loggers.base import Logger, flatten_hparams
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.tensors import optional_module


def _wandb() -> Any:
    return optional_module("wandb", "WandbLogger", "wandb")


class WandbLogger(Logger):
    """Args (Lightning's): name, save_dir, version (= id, to resume a run), offline, dir (= save_dir),
    id, anonymous, project (default "lightning_logs"), log_model (False / True: checkpoints at the end
    of training / "all": each as it is written), experiment (an existing run), prefix,
    checkpoint_name (artifact name, default ``model-<run id>``), add_file_policy, and any
    ``wandb.init`` keyword."""

    def __init__(
        self,
        name: str | None = None,
        save_dir: str | Path = ".",
        version: str | None = None,
        offline: bool = False,
        dir: str | Path | None = None,
        id: str | None = None,
        anonymous: bool | None = None,
        project: str | None = None,
        log_model: bool | str = False,
        experiment: Any = None,
        prefix: str = "",
        checkpoint_name: str | None = None,
        add_file_policy: str = "mutable",
        **kwargs: Any,
    ) -> None:
        if log_model not in (True, False, "all"):
            raise MisconfigurationError(f"WandbLogger log_model={log_model!r}; use False, True or 'all'.")
        if offline and log_model and kwargs.get("mode") == "disabled":
            raise MisconfigurationError("WandbLogger: log_model needs a run that records (mode != 'disabled').")
        if add_file_policy not in ("mutable", "immutable"):
            raise MisconfigurationError(f"add_file_policy={add_file_policy!r}; use 'mutable' or 'immutable'.")
        self._save_dir = str(dir if dir is not None else save_dir)
        self._init_args: dict[str, Any] = {
            "name": name, "project": project or "lightning_logs", "dir": self._save_dir,
            "id": version or id, "resume": "allow", "anonymous": "allow" if anonymous else None,
            "mode": "offline" if offline else kwargs.pop("mode", None), **kwargs,
        }
        self._offline = offline
        self._log_model = log_model
        self._prefix = prefix
        self._checkpoint_name = checkpoint_name
        self._add_file_policy = add_file_policy
        self._run: Any = experiment
        self._checkpoint_callbacks: list[Any] = []
        self._logged_checkpoints: dict[str, float] = {}

    @property
    def experiment(self) -> Any:
        """The ``wandb`` run (started on first use)."""
        if self._run is None:
            wandb = _wandb()
            Path(self._save_dir).mkdir(parents=True, exist_ok=True)
            args = {k: v for k, v in self._init_args.items() if v is not None}
            self._run = wandb.init(**args)
            # Plot every metric against the Trainer's step (not wandb's own call counter).
            self._run.define_metric("trainer/global_step")
            self._run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
        return self._run

    @property
    def name(self) -> str | None:
        return self._init_args["project"]  # type: ignore[no-any-return]

    @property
    def version(self) -> str:
        return str(self.experiment.id)

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def log_dir(self) -> str:
        return self._save_dir

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        self.experiment.config.update(flatten_hparams(params), allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row = {(f"{self._prefix}-{k}" if self._prefix else k): v for k, v in metrics.items()}
        if step is not None:
            row["trainer/global_step"] = step
        self.experiment.log(row)

    def watch(self, model: Any, log: str | None = "gradients", log_freq: int = 100, log_graph: bool = True) -> None:
        self.experiment.watch(model, log=log, log_freq=log_freq, log_graph=log_graph)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        if checkpoint_callback not in self._checkpoint_callbacks:
            self._checkpoint_callbacks.append(checkpoint_callback)
        if self._log_model == "all":
            self._log_checkpoints(checkpoint_callback)

    def _log_checkpoints(self, callback: Any) -> None:
        wandb = _wandb()
        best = getattr(callback, "best_model_path", "")
        paths = {p for p in (best, getattr(callback, "last_model_path", ""), *getattr(callback, "best_k_models", {}))
                 if p}
        for path in sorted(paths):
            file = Path(path)
            if not file.is_file() or self._logged_checkpoints.get(path) == file.stat().st_mtime:
                continue
            artifact = wandb.Artifact(self._checkpoint_name or f"model-{self.experiment.id}", type="model",
                                      metadata={"path": str(file), "score": getattr(callback, "best_model_score", None)
                                                if path == best else None})
            artifact.add_file(str(file), name="model.ckpt", policy=self._add_file_policy)
            aliases = ["latest", "best"] if path == best else ["latest"]
            self.experiment.log_artifact(artifact, aliases=aliases)
            self._logged_checkpoints[path] = file.stat().st_mtime

    def finalize(self, status: str = "success") -> None:
        if self._run is None:
            return
        if self._log_model is True:
            for callback in self._checkpoint_callbacks:
                self._log_checkpoints(callback)
        self._init_args["id"] = self._run.id  # a later stage (test after fit) resumes the same run
        self._run.finish(exit_code=0 if status == "success" else 1)
        self._run = None
