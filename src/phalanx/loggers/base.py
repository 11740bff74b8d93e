"""The logger interface (a Protocol, so any object with these methods is a logger)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from phalanx.distributed.launch import restart_count


@runtime_checkable
class Logger(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...


def next_version(root: Path, name: str) -> int:
    """The first unused ``version_N`` under ``root/name``; on a restarted attempt of the job (torch's
    elastic agent restarted its processes) the newest one, so the run goes on logging where it was."""
    base = root / name
    if not base.is_dir():
        return 0
    versions = [int(p.name.split("_")[1]) for p in base.glob("version_*") if p.name.split("_")[1].isdigit()]
    if versions and restart_count() > 0:
        return max(versions)
    return max(versions, default=-1) + 1


def log_dir_of(root: str | Path, name: str, version: int | str | None) -> Path:
    root = Path(root)
    if version is None:
        version = next_version(root, name)
    folder = version if isinstance(version, str) else f"version_{version}"
    return root / name / folder


def flatten_hparams(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_hparams(v, key + "/"))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out
