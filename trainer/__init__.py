"""The reference trainer (`python -m trainer train`) and the telemetry API for your own loop:
`from trainer import Monitor` (loaded on first use, so trainer.model and trainer.data do not
pull in the store)."""

__all__ = ["Monitor"]


def __getattr__(name):
    if name == "Monitor":
        from trainer.monitor import Monitor
        return Monitor
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
