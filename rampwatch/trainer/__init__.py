"""The reference trainer: a GPT (model.py) on local text (data.py), its run config (config.py,
cli.py), the explicit loop (loop.py), ramps (ramp_controller.py), the out-of-memory fallback (oom.py),
checkpoints, DDP (dist.py) and the GPT's memory plan (gpt_plan.py). Run it with `rampwatch train …`; your own loop needs only rampwatch.Monitor."""
