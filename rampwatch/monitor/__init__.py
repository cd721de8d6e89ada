"""The telemetry API for any training loop: `Monitor` (monitor.py), the per-step gradient
statistics behind its noise-scale estimate (gradstats.py) and the token clock for its LR
scheduler (token_clock.py). Needs torch."""

from rampwatch.monitor.device import device_capacity_bytes
from rampwatch.monitor.monitor import Monitor
from rampwatch.monitor.token_clock import TokenClock

__all__ = ["Monitor", "TokenClock", "device_capacity_bytes"]
