"""Raises Preempted, uncaught (run by tests/distributed/test_preemption.py: the process must end with 75, silently)."""

from phalanx.distributed.preemption import Preempted

raise Preempted("preempted at step 3")
