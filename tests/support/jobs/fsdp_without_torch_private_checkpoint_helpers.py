"""Imports FSDPStrategy after deleting torch's private checkpoint helpers (run by
tests/checkpoint/test_checkpoint_layer.py: phalanx must not need them at import)."""

import torch.distributed.checkpoint.default_planner as planner
import torch.distributed.checkpoint.state_dict_loader as loader

del loader._load_state_dict, planner._EmptyStateDictLoadPlanner
from phalanx.strategies import FSDPStrategy  # noqa: E402

assert FSDPStrategy().name == "fsdp"
