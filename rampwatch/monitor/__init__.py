"""The telemetry API for any training loop: `Monitor` (monitor.py) and the per-step gradient
statistics behind its noise-scale estimate (gradstats.py). Needs torch."""

from rampwatch.monitor.device import device_capacity_bytes
from rampwatch.monitor.monitor import Monitor

__all__ = ["Monitor", "device_capacity_bytes"]
