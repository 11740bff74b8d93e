"""Asks for 64 CPU processes (run by tests/distributed/test_watchdog.py: refused before any starts)."""

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=64)
fabric.launch()
