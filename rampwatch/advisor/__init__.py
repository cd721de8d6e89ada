"""Rampwatch's advisor: pure math (standard library + numpy) for batch ramps.

Modules, one concern each:
  gns       gradient noise scale: one step's |G|² and tr(Σ) estimators, S/S_min, E/E_min,
            optimal LR, critical-batch fit (McCandlish et al. 2018)
  gns_window  the smoothed noise scale: ratio of sums over a window of steps, Fieller interval
  policy    RampPolicy: the one ramp policy, kept in the run config
  advice    advise(): the one ramp decision (policy + noise scale + memory evidence + tier)
            that the monitor and the card both call
  memory    peak memory as a line in the per-device batch; usable capacity
  lr        learning-rate rules on a ramp (√ for Adam-type, linear for SGD), exact reversal
  tiers     batch tiers that fit in memory (per-device batch × accumulation × world size)
  ramp_point  when to ramp (hysteresis, forecast); its effect
  trial     the judgement of a ramp trial: paired bound, tolerance, bracket of the critical batch
  flops     FLOPs per token, device peak FLOPs, MFU
  throughput  per-tier measured tokens/s and MFU; step time = accum × t_micro(b) + overhead
  tier_table  each tier's memory, throughput, steps and ETA to the token budget, LR
  cli       `rampwatch plan`
Import from the modules (e.g. `from rampwatch.advisor.gns_window import NoiseScaleWindow`); nothing here imports
torch, duckdb, pandas or streamlit.
"""
