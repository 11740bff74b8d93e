"""Fabric's connector: its arguments and the launch environment become one configured strategy.

Kept apart from the facade because this is where a job's shape is decided, and where two sources can
disagree: the script's ``Fabric(...)`` arguments and the flags of ``phalanx run`` (passed to the script
through ``PHALANX_*`` variables). The flags win, and a script that says otherwise is told so — never a
silent choice between the two.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from phalanx.distributed import launch as launcher
from phalanx.distributed.accelerator import resolve_accelerator, resolve_devices
from phalanx.distributed.replica_groups import resolve_fault_tolerance
from phalanx.fabric.config import FabricConfig
from phalanx.precision import Precision
from phalanx.strategies import Strategy, resolve_strategy
from phalanx.strategies.parallel import running_job_world_size
from phalanx.utils.diagnostics import warn
from phalanx.utils.errors import MisconfigurationError

# `phalanx run --strategy ...` passes its flags to the script's Fabric through these variables.
_CLI_ENV = {
    "accelerator": "PHALANX_ACCELERATOR",
    "devices": "PHALANX_DEVICES",
    "num_nodes": "PHALANX_NUM_NODES",
    "strategy": "PHALANX_STRATEGY",
    "precision": "PHALANX_PRECISION",
}


def apply_cli_overrides(config: FabricConfig) -> FabricConfig:
    """``config`` with the flags of ``phalanx run`` applied; an argument the script set to something else is
    overridden with a warning (a strategy object is kept: its options are more than the flag says)."""
    overrides: dict[str, Any] = {}
    for key, var in _CLI_ENV.items():
        value = os.environ.get(var)
        if value is None:
            continue
        given = getattr(config, key)
        if isinstance(given, Precision) and given.name == value:
            continue  # the object the flag names, with the script's options
        if not config.is_default(key) and str(given) != value and not isinstance(given, Strategy):
            env = launcher.detect_environment()
            warn(
                f"The code sets {key}={given!r} but the job was launched with --{key.replace('_', '-')} {value}; "
                f"using {value}. Remove one of the two so the script says what runs.",
                rank=env.rank if env is not None else None,
            )
        if isinstance(given, Strategy) and key == "strategy":
            continue
        overrides[key] = int(value) if key == "num_nodes" else value
    return dataclasses.replace(config, **overrides)


def configured_strategy(config: FabricConfig) -> Strategy:
    """The strategy ``Fabric`` runs on: flags applied (not to a local Fabric inside a running job), devices
    and nodes resolved, precision and lockstep mode set (``configure`` validates the combination before any
    process starts)."""
    if not _local_inside_job(config):
        config = apply_cli_overrides(config)
    device_type = resolve_accelerator(config.accelerator)
    n_devices = resolve_devices(config.devices, device_type)
    n_nodes = int(config.num_nodes)
    if n_nodes < 1:
        raise MisconfigurationError(f"num_nodes must be >= 1, got {n_nodes}.")
    strategy = resolve_strategy(config.strategy, n_devices * n_nodes)
    strategy.configure(
        device_type=device_type, devices=n_devices, num_nodes=n_nodes, precision=config.precision
    )
    if config.lockstep is not None:
        strategy.set_lockstep(config.lockstep)
    fault_tolerance = None if _local_inside_job(config) else resolve_fault_tolerance(config.fault_tolerance)
    if fault_tolerance is not None:
        strategy.set_fault_tolerance(fault_tolerance)
    return strategy


def _local_inside_job(config: FabricConfig) -> bool:
    """``Fabric(devices=1)`` built while a Fabric of this process runs a larger job: local work on this rank
    (LitGPT's merge_lora). ``phalanx run``'s flags describe the job; applied to this Fabric, ``--devices 2``
    would make it a second job Fabric on one rank only, taking the job's process group over."""
    return str(config.devices) == "1" and str(config.num_nodes) == "1" and running_job_world_size() > 1


def refuse_plugins(plugins: Any) -> None:
    if plugins is not None and plugins != []:
        raise MisconfigurationError(
            f"Fabric(plugins={plugins!r}) is not supported. phalanx has no plugin objects: choose the precision "
            "with precision=... (a name, or a phalanx.precision object such as MixedPrecision('bf16-mixed')), the "
            "cluster environment is detected from torchrun/SLURM/`phalanx run`, and "
            "checkpoint I/O belongs to the strategy (pass a Strategy instance with its options)."
        )
