"""Rampwatch: batch-ramp telemetry and advice for PyTorch training.

    from rampwatch import Monitor        # the telemetry API for your own loop (needs torch)
    from rampwatch import TokenClock     # your LR scheduler stepped by tokens, across ramps

Packages, one concern each (import rules in docs/ARCHITECTURE.md):
  store      the DuckDB file every process reads and writes through (no torch, no streamlit)
  advisor    pure math: noise scale, ramp policy, memory fit, LR rules, FLOPs
  monitor    Monitor and its gradient statistics, for any training loop
  trainer    the reference GPT trainer (`rampwatch train`)
  dashboard  the Streamlit app (`rampwatch dashboard`)
  cli        the `rampwatch` command
Monitor and TokenClock are loaded on first use, so `import rampwatch` pulls in neither torch
nor duckdb.
"""

__all__ = ["Monitor", "TokenClock"]


def __getattr__(name):
    if name == "Monitor":
        from rampwatch.monitor import Monitor

        return Monitor
    if name == "TokenClock":
        from rampwatch.monitor.token_clock import TokenClock

        return TokenClock
    raise AttributeError(f"module 'rampwatch' has no attribute {name!r}")
