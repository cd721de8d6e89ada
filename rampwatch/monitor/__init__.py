"""The telemetry API for any training loop: `Monitor` (monitor.py) and the per-step gradient
statistics behind its noise-scale estimate (gradstats.py). Needs torch."""

from rampwatch.monitor.monitor import Monitor, device_capacity_bytes

__all__ = ["Monitor", "device_capacity_bytes"]
