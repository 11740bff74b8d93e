"""One process, one device: the strategy of ``devices=1``, so a script written against Fabric runs
unchanged without a process group (every collective is the identity, nothing is wrapped)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from phalanx.distributed.launch import ClusterEnvironment
from phalanx.strategies._transforms import check_compile, check_policy
from phalanx.strategies.base import Strategy
from phalanx.strategies.parallel import running_job_world_size


class SingleDeviceStrategy(Strategy):
    """Runs everything in the current process on one device (CPU or one GPU).

    Args:
        activation_checkpointing_policy: set of module classes whose activations are recomputed in
            backward instead of stored.
        compile: ``True`` or a dict of ``torch.compile`` arguments: compile the module in place at setup.
    """

    name: ClassVar[str] = "single"

    def __init__(
        self,
        *,
        activation_checkpointing_policy: set[type[nn.Module]] | None = None,
        compile: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__()
        self.activation_checkpointing_policy = check_policy(activation_checkpointing_policy)
        self.compile_options = check_compile(compile)

    def job_environment(self, env: ClusterEnvironment | None) -> ClusterEnvironment | None:
        # Created while a phalanx Fabric in this process runs a larger job (its process group is up), a
        # one-process Fabric is deliberate: local work on one rank, such as LitGPT's merge_lora on rank 0. It
        # runs on its own, as Lightning's SingleDeviceStrategy does: rank 0 of 1, collectives that are the
        # identity, a barrier that waits for no one, and a teardown that leaves the job's group alone. As
        # the first Fabric of a launched job it is still checked against the launch (and refused there):
        # torchrun --nproc-per-node 2 around devices=1 would otherwise train 2 copies silently.
        if (env is not None and self.num_processes == 1 and env.world_size > 1
                and running_job_world_size() == env.world_size):
            return None
        return env

    def setup_environment(self, env: ClusterEnvironment | None) -> None:
        if env is None and self.device_type == "cuda" and running_job_world_size() > 1:
            # A local Fabric inside a job: this rank's own GPU (the job's current device, left current),
            # not cuda:0 on every rank.
            self._root_device = torch.device("cuda", torch.cuda.current_device())
            return
        super().setup_environment(env)
