"""The reference trainer: a GPT (model.py) on local text (data.py), its run config (config.py,
cli.py), the explicit loop (loop.py), ramps (ramp.py), the out-of-memory fallback (oom.py),
checkpoints, DDP (dist.py) and the memory planner (memplan.py). Run it with `rampwatch train …`; your own loop needs only rampwatch.Monitor."""
