"""Data parallel under torchrun: process groups, the DDP wrapper and its per-rank norm hook,
no_sync for accumulation, restarts, resuming with another world size (and the events a resume
records), --inject-oom's per-rank scope and the per-rank debug line.

Outside torchrun (no WORLD_SIZE in the environment) everything here is a no-op for one process,
so a single-process run behaves exactly as without this module.

    torchrun --nproc_per_node=N [--max-restarts R] -m rampwatch train --run-id ID ...

- Process groups: gloo on the CPU, NCCL on CUDA, plus a small gloo side group for control.
- Only rank 0 writes to the store and saves checkpoints (DDP keeps every rank's weights equal).
  Per step, one small all-reduce (gradstats) carries the noise-scale points, the loss (averaged)
  and the peak memory (max over ranks); throughput and MFU count all ranks.
- Tier changes (approved ramp commands, --ramp auto) are the monitor's ramp protocol
  (monitor/ramp_channel.py RampChannel) on this module's side group: rank 0 decides at boundary
  S, every rank applies at boundary S+1, with no per-step wait.
- Ramp trials (trainer/trial_controller.py): every rank runs the same arms from the same
  snapshot; the held-out batch is sharded over the ranks and its per-example losses gathered, so
  every rank judges the same numbers (`agree_on_kept` checks the kept arm). A trial that fails
  on any rank stops every rank (`stop_after_abandoned`), and the checkpoint at its snapshot
  resumes the run with the trial abandoned.
- Out of memory on any rank (trainer/oom.py, with the world size as its parameter): the step
  cannot be redone in place (peers may already wait in its all-reduce), so that rank saves a
  checkpoint at the last completed step with the halved tier and exits non-zero. Its peers then
  fail in their next collective (gloo: connection closed) or are stopped by torchrun's agent
  (NCCL: a peer blocked in a kernel wait cannot run Python, so SIGTERM and then SIGKILL end it;
  rank 0's spool keeps its records either way). With `--max-restarts`, torchrun starts every
  rank again; a restarted worker (TORCHELASTIC_RESTART_COUNT > 0) whose --run-id has a
  checkpoint resumes it automatically.
- Resume with another world size keeps the effective batch by changing accumulation (and, when
  it must, lowering the per-device batch to a divisor): keep_effective_batch.

Limits: an out-of-memory inside the optimizer step leaves the weights half-updated, so that rank
can only re-tier the last periodic checkpoint (trainer/oom.py; no event when it is not rank 0,
and nothing to resume before the first checkpoint). An NCCL peer left inside a collective waits
until torchrun's agent kills it. Testing aids: $RAMPWATCH_INJECT_OOM_RANK limits --inject-oom
to one rank (and no injection after a restart); $RAMPWATCH_DEBUG_RANKS prints one line per rank
and step (tier, first sample id), per rank and trial (its start and end, the weights' digest
after it) and per rank at the end (the weights' digest).
"""

from __future__ import annotations

import hashlib
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as torch_dist
from torch.distributed.constants import default_pg_timeout

from rampwatch.advisor.tiers import Tier
from rampwatch.store import names as M
from rampwatch.trainer import checkpoint as ckpt
from rampwatch.trainer.data import rank_slice
from rampwatch.trainer.oom import OomInjector, StopTraining

if TYPE_CHECKING:
    from rampwatch.monitor import Monitor


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    side_group: Any = None  # gloo group for control messages (world size > 1)
    model: Any = None  # the module wrap() was given: the weights DDP keeps equal (debug digest)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def _pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(requested_device: str = "auto") -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(requested_device, local_rank)
    side = None
    if world > 1:
        if not torch_dist.is_initialized():
            torch_dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                store=_attempt_store(world, rank),
                rank=rank,
                world_size=world,
            )
        # control traffic on its own gloo group: CPU tensors, never queued behind NCCL work
        side = torch_dist.new_group(backend="gloo")
    return DistInfo(rank, world, local_rank, device, side)


def _attempt_store(world: int, rank: int):
    """The rendezvous store, its keys prefixed by the restart attempt, or None for env://.

    torchrun's agent keeps one TCPStore across restarts and workers' keys are not prefixed by
    attempt, so a restarted rank can read a peer's address from the previous attempt and fail
    with "Gloo connectFullMesh failed ... Connection refused" (pytorch/pytorch#135712). The
    other workaround is TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in env:
        return None
    store = torch_dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=default_pg_timeout,
    )
    return torch_dist.PrefixStore(f"rampwatch/attempt_{restart_count()}", store)


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def wrap(model: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    info.model = model
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [info.local_rank] if info.device.type == "cuda" else None
    # The GPT's only buffers are rotary tables computed identically on every rank: broadcasting
    # them before every forward (the default) would add a collective per micro-batch.
    return DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)


def no_sync_unless(model: torch.nn.Module, last_micro_batch: bool):
    """Skip DDP's gradient all-reduce on every micro-batch but the last of a step."""
    if last_micro_batch or not hasattr(model, "no_sync"):
        return nullcontext()
    return model.no_sync()


def keep_effective_batch(state, old_world: int, new_world: int):
    """Resume with another world size: keep per-device batch x accumulation x world.

    When the new world divides the effective batch, keep it exactly with the largest per-device
    batch <= the old one that divides the per-rank share (never a larger one: it may not fit);
    otherwise keep the per-device batch and round accumulation up (the batch grows a little).
    """
    total = state.tier(old_world).batch
    if total % new_world == 0:
        per_rank = total // new_world
        b = max(d for d in range(1, min(state.per_device_batch, per_rank) + 1) if per_rank % d == 0)
        state.per_device_batch, state.accum = b, per_rank // b
    else:
        state.accum = max(1, -(-total // (new_world * state.per_device_batch)))
    return state


# -- ramp trials (called by trainer.trial_controller) -----------------------------------------
def shard(n: int, info: DistInfo) -> tuple[int, int]:
    """This rank's part [lo, hi) of n held-out examples: ⌈n / world⌉ each, the last fewer."""
    per = -(-n // info.world_size)
    lo = min(n, info.rank * per)
    return lo, min(n, lo + per)


def gather_shards(info: DistInfo, part: torch.Tensor, n: int) -> torch.Tensor:
    """Every rank's `shard` of n values, in order, on every rank: the same bytes everywhere."""
    if not info.enabled:
        return part
    per = -(-n // info.world_size)
    padded = torch.full((per,), float("nan"), dtype=part.dtype)
    padded[: len(part)] = part.detach().cpu()
    parts = [torch.empty_like(padded) for _ in range(info.world_size)]
    torch_dist.all_gather(parts, padded, group=info.side_group)  # gloo: CPU tensors
    return torch.cat(parts)[:n]  # only the last non-empty shard is short, the rest are empty


def agree_on_kept(info: DistInfo, request, factor: int) -> None:
    """Every rank kept the same arm, or every rank stops. The ranks judge the same gathered
    losses with the same code, so they agree; this turns any split (a tie judged in other
    floating point) into a stop at the checkpoint at S, never two runs apart."""
    if not info.enabled:
        return
    both = torch.tensor([factor, -factor], dtype=torch.int64)
    torch_dist.all_reduce(both, op=torch_dist.ReduceOp.MAX, group=info.side_group)
    high, low = int(both[0]), -int(both[1])
    if high != low:
        raise StopTraining(
            f"trial {request.trial_id}: the ranks kept different arms (×{low} and ×{high}); "
            f"stopped so they cannot go on apart: resume from the checkpoint at step "
            f"{request.step}"
        )


def stop_after_abandoned(info: DistInfo, request) -> None:
    """Under torchrun a rank whose trial failed cannot go on alone: its peers may be inside an
    arm's all-reduce, and its next collective would pair with theirs. Every rank stops (the
    peers' collectives fail once it exits) and the checkpoint at S resumes the run (torchrun
    --max-restarts does), as after an out-of-memory."""
    if not info.enabled:
        return
    raise StopTraining(
        f"trial {request.trial_id} abandoned on rank {info.rank}: the ranks stop together; "
        f"resume from the checkpoint at step {request.step}"
    )


# -- start-up and resume (called by trainer.loop) ---------------------------------------------
def auto_resume(args) -> None:
    """A worker restarted by torchrun (--max-restarts) resumes its run's checkpoint."""
    if args.resume or not args.run_id or restart_count() == 0:
        return
    if ckpt.checkpoint_path(args.checkpoint_dir, args.run_id).exists():
        args.resume = args.run_id
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"rampwatch: restart {restart_count()}: resuming run {args.run_id}", file=sys.stderr
            )


def agree_run_id(run_id: str, info: DistInfo) -> str:
    """Rank 0's run id on every rank (any rank may need the checkpoint path)."""
    if not info.enabled:
        return run_id
    box = [run_id]
    torch_dist.broadcast_object_list(box, src=0, group=info.side_group)
    return box[0]


def on_resume(blob: dict, world_size: int) -> tuple[ckpt.TrainState, list[dict]]:
    """A checkpoint's state for this launch's world size, and the events the resumed run records
    once its monitor exists (after_setup): the checkpoint's note (why a rank stopped) and a
    world-size change."""
    state = blob["state"]
    notes = [blob["note"]] if blob.get("note") else []
    old = blob["config"].get("world_size", 1)
    if old != world_size:
        before = state.tier(old)
        after = keep_effective_batch(state, old, world_size).tier(world_size)
        notes.append(world_size_note(before, after))
    return state, notes


def world_size_note(before: Tier, after: Tier) -> dict:
    old, new = before.world_size, after.world_size
    return {
        "kind": M.EVENT_RESUME,
        "data": {
            "before": before.to_payload(),
            "after": after.to_payload(),
            "world_before": old,
            "world_after": new,
        },
        "message": f"world size {old} -> {new}: tier {before.per_device_batch} x "
        f"{before.accum} -> {after.per_device_batch} x {after.accum} per device; batch "
        f"{before.batch} -> {after.batch} sequences",
    }


def after_setup(
    info: DistInfo,
    monitor: Monitor,
    train_model: torch.nn.Module,
    *,
    run_id: str | None,
    notes: list[dict],
    step: int,
) -> None:
    """Once the monitor exists: the DDP per-rank norm hook, and the resume notes as events."""
    if info.enabled:
        monitor.grads.attach_ddp(getattr(train_model, "_orig_mod", train_model))
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
        if restarts > 0 and not run_id and info.is_main:
            print(
                "rampwatch: pass --run-id so that a torchrun restart can resume this run",
                file=sys.stderr,
            )
    for note in notes:
        monitor.event(step, note["kind"], note["message"], note.get("data"))


def oom_injector(spec: str | None, info: DistInfo) -> OomInjector:
    """--inject-oom for this rank: once per job, and only on rank $RAMPWATCH_INJECT_OOM_RANK when
    that is set."""
    only = os.environ.get("RAMPWATCH_INJECT_OOM_RANK")
    return OomInjector.parse(
        spec,
        rank=info.rank,
        only_rank=None if only is None else int(only),
        restart=restart_count(),
    )


def debug_step(info: DistInfo, state: ckpt.TrainState, tier: Tier, lr: float) -> None:
    """$RAMPWATCH_DEBUG_RANKS: one line per rank and step (tier, this rank's first sample id)."""
    if not os.environ.get("RAMPWATCH_DEBUG_RANKS"):
        return
    n = tier.batch
    first, _ = rank_slice(state.next_sample - n, n, info.rank, info.world_size)
    _debug_line(
        f"rampwatch-rank rank={info.rank} step={state.step} tier={tier.per_device_batch}x"
        f"{tier.accum} first_sample={first} lr={lr:.6g}"
    )


def _debug_line(line: str) -> None:
    """One write of the line and its newline: the ranks share torchrun's stdout, and print()
    on an unbuffered stream writes the newline separately, so two ranks' lines could merge."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def weights_digest(state: dict) -> str:
    """A short hash of a state dict's tensors, names and bytes: equal weights, equal digests."""
    h = hashlib.sha256()
    for name, value in state.items():
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def debug_trial(info: DistInfo, what: str, request, outcome=None, model=None) -> None:
    """$RAMPWATCH_DEBUG_RANKS: one line per rank at a trial's start (with this rank's pid), end
    (the kept arm, continue_step and the weights' digest) or abandonment."""
    if not os.environ.get("RAMPWATCH_DEBUG_RANKS"):
        return
    line = (
        f"rampwatch-trial rank={info.rank} pid={os.getpid()} {what} trial={request.trial_id} "
        f"step={request.step}"
    )
    if outcome is not None:
        line += (
            f" kept={outcome.kept.factor} continue={outcome.continue_step} "
            f"digest={weights_digest(model.state_dict())}"
        )
    _debug_line(line)


def _debug_weights(info: DistInfo) -> None:
    if os.environ.get("RAMPWATCH_DEBUG_RANKS") and info.model is not None:
        digest = weights_digest(info.model.state_dict())
        _debug_line(f"rampwatch-weights rank={info.rank} digest={digest}")


def teardown(info: DistInfo) -> None:
    _debug_weights(info)
    if info.enabled and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
