"""A Fabric with strategy='deepspeed_stage_3' does not import deepspeed before it is launched (run by
tests/strategies/test_deepspeed.py)."""

import sys

import phalanx

f = phalanx.Fabric(accelerator="cpu", devices=2, strategy="deepspeed_stage_3")
assert "deepspeed" not in sys.modules, "imported eagerly"
