"""The processes of one Fabric's job: starting them (``fabric.launch()`` under plain ``python``), joining
them (torchrun, SLURM, ``phalanx run``, or the processes ``launch`` started), and the ranks before joining.

Before ``launch()`` the ranks come from the launched job's environment when there is one, else from the
configuration (rank 0 of devices*num_nodes), as in Lightning.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.distributed import launch as launcher
from phalanx.distributed.runlogs import RUN_VARIABLE
from phalanx.utils import exiting
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.strategies import Strategy


class Job:
    """Whether this Fabric joined its job (:attr:`launched`). ``leave`` runs at interpreter exit once it has:
    leaving the process group in order lets peers see a clean "exited" instead of a hang."""

    def __init__(self, strategy: Strategy, leave: Callable[[], None]) -> None:
        self._strategy, self._leave = strategy, leave
        self.launched = False
        # A malformed environment is reported by launch(), where it is checked against the configuration.
        try:
            self._env = strategy.job_environment(launcher.detect_environment())
        except MisconfigurationError:
            self._env = None

    def launch(self, fabric: Any, function: Callable[..., Any] | None, args: tuple[Any, ...],
               kwargs: dict[str, Any], factory: Callable[[], Any], max_restarts: int, run_root: Path | None) -> Any:
        """``fabric.launch(function, *args, **kwargs)``: join the job and run ``function(fabric, ...)`` here,
        or, under plain ``python`` with several processes, start them: re-run the script (``function`` None:
        this process exits with the job's code) or run ``function`` in each on a Fabric built by ``factory``
        and return rank 0's result."""
        env = self._strategy.job_environment(launcher.detect_environment())
        strategy = self._strategy
        if env is None and strategy.num_processes > 1:
            if self.launched:
                raise MisconfigurationError("fabric.launch() was already called.")
            launcher.check_cpu_processes(strategy.devices, strategy.device_type)
            if function is None:
                sys.exit(launcher.launch_script(strategy.num_processes, max_restarts, run_root))
            target = functools.partial(function, **kwargs) if kwargs else function
            return launcher.launch_function(strategy.num_processes, factory, target, args, max_restarts, run_root)
        self._join(env)
        return function(fabric, *args, **kwargs) if function is not None else None

    def _join(self, env: launcher.ClusterEnvironment | None) -> None:
        if self.launched:
            return
        self._strategy.setup_environment(env)
        folder = os.environ.get(RUN_VARIABLE)
        self._strategy.start_replica_groups(Path(folder) if folder else None)
        self.launched = True
        atexit.register(self._leave)
        exiting.freeze_at_exit()

    def ensure_launched(self) -> None:
        if self.launched:
            return
        env = self._strategy.job_environment(launcher.detect_environment())
        if env is None and self._strategy.num_processes > 1:
            raise MisconfigurationError(
                f"This Fabric runs {self._strategy.num_processes} processes: call fabric.launch() before "
                "setting up models, data or collectives."
            )
        self._join(env)

    @property
    def global_rank(self) -> int:
        return self._strategy.global_rank if self.launched else self._env.rank if self._env is not None else 0

    @property
    def local_rank(self) -> int:
        return self._strategy.local_rank if self.launched else self._env.local_rank if self._env is not None else 0

    @property
    def node_rank(self) -> int:
        return self._strategy.node_rank if self.launched else self._env.node_rank if self._env is not None else 0

    @property
    def world_size(self) -> int:
        if not self.launched:
            return self._env.world_size if self._env is not None else self._strategy.num_processes
        return self._strategy.world_size


__all__ = ["Job"]
