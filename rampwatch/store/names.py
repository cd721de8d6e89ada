"""Canonical metric and event names: the vocabulary the trainer writes and the dashboard reads.

Both sides import these constants from here (the store is the one module they share), so a
renamed metric cannot silently leave a chart empty. Any other name is allowed too: the metrics
table is tall, and user loops may log whatever they like.
"""

# per optimizer step
LOSS = "loss"
VAL_LOSS = "val_loss"
GRAD_NORM = "grad_norm"  # before clipping, loss scale undone
LR = "lr"
PER_DEVICE_BATCH = "per_device_batch"
ACCUM = "accum"
BATCH_SEQS = "batch_seqs"  # effective batch: per-device x accumulation x world size
BATCH_TOKENS = "batch_tokens"
TOKENS_SEEN = "tokens_seen"
FIRST_SAMPLE = "first_sample_id"  # data position: id of the step's first sample (all ranks)
STEP_TIME = "step_time"  # seconds between optimizer steps, excluding validation
TOKENS_PER_S = "tokens_per_s"  # all ranks
MFU = "mfu"  # model FLOPs utilisation, 0..1; absent where the device peak is unknown

# memory, bytes (CUDA: allocator figures; CPU: the process)
MEM_ALLOCATED = "mem_allocated"
MEM_RESERVED = "mem_reserved"
MEM_PEAK = "mem_peak"  # peak reserved since the previous step (CUDA) / peak RSS (CPU)
MEM_RSS = "mem_rss"
MEM_CAPACITY = "mem_capacity"

# gradient noise scale (McCandlish et al. 2018), raw per step and smoothed
GNS_G2 = "gns_g2"  # |G|^2 estimate this step
GNS_TRACE = "gns_trace"  # tr(Sigma) estimate this step, per sequence
GNS_RAW = "gns_b_simple_raw"  # trace / g2 this step, sequences (very noisy)
GNS = "gns_b_simple"  # sum(trace) / sum(g2) over the recent window, sequences; only on steps
#                       with a fresh estimate, absent when the window's |G|^2 is not positive
GNS_TOKENS = "gns_b_simple_tokens"
GNS_LOW = "gns_b_simple_low"  # one-sided 95% lower bound (Fieller); 0 = no lower bound
GNS_HIGH = "gns_b_simple_high"  # one-sided 95% upper bound; absent = unbounded
GNS_WINDOW = "gns_window_steps"  # steps behind the smoothed value

# every metric name above: what a run's own metrics (mon.log, extra=, a framework's validation)
# are not; the live page draws those below its charts (dashboard/views/live.py)
MONITOR_METRICS = frozenset(
    {
        LOSS, VAL_LOSS, GRAD_NORM, LR, PER_DEVICE_BATCH, ACCUM, BATCH_SEQS, BATCH_TOKENS,
        TOKENS_SEEN, FIRST_SAMPLE, STEP_TIME, TOKENS_PER_S, MFU, MEM_ALLOCATED, MEM_RESERVED,
        MEM_PEAK, MEM_RSS, MEM_CAPACITY, GNS_G2, GNS_TRACE, GNS_RAW, GNS, GNS_TOKENS, GNS_LOW,
        GNS_HIGH, GNS_WINDOW,
    }
)  # fmt: skip

# events.kind
EVENT_RAMP = "ramp"
EVENT_OOM = "oom"
EVENT_CHECKPOINT = "checkpoint"
EVENT_RESUME = "resume"
EVENT_ALERT = "alert"
EVENT_REFUSED = "refused"
# a ramp trial (issue 26's contract; data of each: store/schema.py's Trial, store/ingest.py)
EVENT_TRIAL_START = "trial_start"  # at the snapshot step: the plan and its cost
EVENT_TRIAL_ARM = "trial_arm"  # at the snapshot step: one arm's progress (tokens, loss)
EVENT_TRIAL_END = "trial_end"  # at the step the run continues from: the verdict
EVENT_TRIAL_ABANDONED = "trial_abandoned"  # a crash or an error mid-trial: the reason
TRIAL_EVENTS = (EVENT_TRIAL_START, EVENT_TRIAL_ARM, EVENT_TRIAL_END, EVENT_TRIAL_ABANDONED)

# memory_plan.variant: which cross-entropy a plan row (and a run) uses. The logits dominate the
# per-sequence slope, so rows of one variant never describe a run of the other.
PLAIN_CE = "plain"
CHUNKED_CE = "chunked"
LOSS_VARIANTS = (PLAIN_CE, CHUNKED_CE)


def name_problem(name) -> str | None:
    """Why `name` cannot name a metric (None: it can): every name is a non-blank str."""
    if not isinstance(name, str):
        return "the name is not a str"
    if not name.strip():
        return "the name is empty"
    return None


def loss_variant(chunked_ce) -> str:
    """The memory_plan variant of a model whose config says `chunked_ce`."""
    return CHUNKED_CE if chunked_ce else PLAIN_CE
