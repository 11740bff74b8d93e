"""``lightning.fabric.utilities.throughput`` names (phalanx.fabric.throughput)."""

from phalanx.fabric.throughput import Throughput, ThroughputMonitor, get_available_flops, measure_flops

__all__ = ["Throughput", "ThroughputMonitor", "get_available_flops", "measure_flops"]
