"""Rampwatch inside training frameworks, each an optional extra that imports its framework only
when its own module is imported (the package without them imports neither):

    rampwatch.integrations.lightning      PyTorch Lightning 2.x callback   pip install 'rampwatch[lightning]'
    rampwatch.integrations.transformers   Hugging Face Trainer             pip install 'rampwatch[transformers]'

Both are clients of the monitor's telemetry and its ramp protocol (monitor/ramp_protocol.py).
"""
