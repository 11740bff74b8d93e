"""Prints which heavy optional packages ``import phalanx`` imported (run by tests/fabric/test_fabric.py)."""

import sys

import phalanx  # noqa: F401

print([m for m in ("deepspeed", "tensorboard", "matplotlib", "rich", "sklearn") if m in sys.modules])
