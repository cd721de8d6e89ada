"""Data parallel under torchrun: process groups, the DDP wrapper and its per-rank norm hook,
no_sync for accumulation, tier changes announced by rank 0, the out-of-memory stop, restarts and
resuming with another world size.

Outside torchrun (no WORLD_SIZE in the environment) everything here is a no-op for one process,
so a single-process run behaves exactly as without this module.

    torchrun --nproc_per_node=N [--max-restarts R] -m rampwatch train --run-id ID ...

- Process groups: gloo on the CPU, NCCL on CUDA, plus a small gloo side group for control.
- Only rank 0 writes to the store and saves checkpoints (DDP keeps every rank's weights equal).
  Per step, one small all-reduce (gradstats) carries the noise-scale points, the loss (averaged)
  and the peak memory (max over ranks); throughput and MFU count all ranks.
- Tier changes (approved ramp commands, --ramp auto) are the monitor's ramp protocol
  (monitor/ramp.py RampChannel) on this module's side group: rank 0 decides at boundary S, every
  rank applies at boundary S+1, with no per-step wait.
- Out of memory on any rank: the step cannot be redone in place (peers may already wait in its
  all-reduce), so that rank saves a checkpoint at the last completed step with the halved tier
  and exits non-zero. Its peers then fail in their next collective (gloo: connection closed) or
  are stopped by torchrun's agent (NCCL: a peer blocked in a kernel wait cannot run Python, so
  SIGTERM and then SIGKILL end it; rank 0's spool keeps its records either way). With
  `--max-restarts`, torchrun starts every rank again; a restarted worker
  (TORCHELASTIC_RESTART_COUNT > 0) whose --run-id has a checkpoint resumes it automatically.
- Resume with another world size keeps the effective batch by changing accumulation (and, when
  it must, lowering the per-device batch to a divisor): keep_effective_batch.

Limits: an out-of-memory inside the optimizer step leaves the weights half-updated, so that rank
can only re-tier the last periodic checkpoint (trainer.loop; no event when it is not rank 0, and
nothing to resume before the first checkpoint). An NCCL peer left inside a collective waits
until torchrun's agent kills it. Testing aids: $RAMPWATCH_INJECT_OOM_RANK limits --inject-oom
to one rank (and no injection after a restart); $RAMPWATCH_DEBUG_RANKS prints one line per rank
and step (tier, first sample id).
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.constants import default_pg_timeout

from rampwatch.store import names as M
from rampwatch.trainer import checkpoint as ckpt
from rampwatch.trainer.data import rank_slice
from rampwatch.trainer.ramp import StopTraining, Tier, halve_tier


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    side_group: Any = None  # gloo group for control messages (world size > 1)

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
    total = state.per_device_batch * state.accum * old_world
    if total % new_world == 0:
        per_rank = total // new_world
        b = max(d for d in range(1, min(state.per_device_batch, per_rank) + 1) if per_rank % d == 0)
        state.per_device_batch, state.accum = b, per_rank // b
    else:
        state.accum = max(1, -(-total // (new_world * state.per_device_batch)))
    return state


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


def on_resume(t, blob: dict, state):
    """Resume path: the checkpoint's note (e.g. why a rank stopped) and a world-size change.
    Events are recorded by after_setup, once the monitor exists."""
    notes = [blob["note"]] if blob.get("note") else []
    cfg = blob["config"]
    old, new = cfg.get("world_size", 1), t.ddp.world_size
    if old != new:
        before = Tier(state.per_device_batch, state.accum)
        state = keep_effective_batch(state, old, new)
        after = Tier(state.per_device_batch, state.accum)
        b0 = before.per_device_batch * before.accum * old
        b1 = after.per_device_batch * after.accum * new
        notes.append(
            {
                "kind": M.EVENT_RESUME,
                "data": {
                    "before": before.as_dict(),
                    "after": after.as_dict(),
                    "world_before": old,
                    "world_after": new,
                },
                "message": f"world size {old} -> {new}: tier {before.per_device_batch} x "
                f"{before.accum} -> {after.per_device_batch} x {after.accum} per "
                f"device; batch {b0} -> {b1} sequences",
            }
        )
    t.dist_notes = notes
    return state


def after_setup(t) -> None:
    """Once the trainer's monitor and ramp controller exist."""
    if t.ddp.enabled:
        t.mon.grads.attach_ddp(getattr(t.train_model, "_orig_mod", t.train_model))
        if (
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
            and not t.args.run_id
            and t.ddp.is_main
        ):
            print(
                "rampwatch: pass --run-id so that a torchrun restart can resume this run",
                file=sys.stderr,
            )
    _limit_injection(t.oom, t.ddp)
    for note in getattr(t, "dist_notes", ()):
        t.mon.event(t.state.step, note["kind"], note["message"], note.get("data"))


def _limit_injection(oom, info: DistInfo) -> None:
    """--inject-oom fires once per job (not again after a restart), and under DDP only on rank
    $RAMPWATCH_INJECT_OOM_RANK when that is set."""
    only = os.environ.get("RAMPWATCH_INJECT_OOM_RANK")
    if restart_count() > 0 or (only is not None and int(only) != info.rank):
        oom.step = None


# -- out of memory under DDP ------------------------------------------------------------------
def stop_after_oom(t, tier: Tier, message: str) -> None:
    """This rank ran out of memory in forward/backward: checkpoint the last completed step with
    the halved tier and stop (raises StopTraining). The weights and optimizer state here are
    rank 0's (DDP keeps them equal, and the failed step has not reached the optimizer)."""
    t.optimizer.zero_grad(set_to_none=True)
    t.mon.grads.reset()
    if t.device.type == "cuda":
        torch.cuda.empty_cache()
    new, exact = halve_tier(tier)  # raises StopTraining below per-device batch 1
    st = t.state
    st.infeasible_batches = sorted({*st.infeasible_batches, tier.per_device_batch})
    t.ramps.mark_infeasible(tier.per_device_batch, st.step)
    rank = t.ddp.rank
    msg = (
        f"out of memory on rank {rank} at per-device batch {tier.per_device_batch} in step "
        f"{st.step + 1}: all ranks stop; the checkpoint at step {st.step} holds tier "
        f"{new.per_device_batch} x {new.accum}"
        + ("" if exact else " (effective batch not kept exactly: odd per-device batch)")
        + f"; torchrun --max-restarts resumes it (or --resume {st.run_id})"
    )
    data = {
        "before": tier.as_dict(),
        "after": new.as_dict(),
        "exact": exact,
        "rank": rank,
        "error": message,
        "world_size": t.ddp.world_size,
    }
    note = None if t.ddp.is_main else {"kind": M.EVENT_OOM, "message": msg, "data": data}
    saved = replace(
        st,
        per_device_batch=new.per_device_batch,
        accum=new.accum,
        noise_window=t.mon.noise.to_dict(),
    )
    ckpt.save(
        ckpt.checkpoint_path(t.args.checkpoint_dir, st.run_id),
        state=saved,
        model=t.model,
        optimizer=t.optimizer,
        config=t.run_config,
        note=note,
    )
    # at the checkpoint's step: a resume purges events after it. Rank 0 records it now, any
    # other rank through the note that the resumed rank 0 records.
    t.mon.event(st.step, M.EVENT_OOM, msg, data)
    raise StopTraining(msg, status="failed")


def debug_step(t, outcome) -> None:
    """$RAMPWATCH_DEBUG_RANKS: one line per rank and step (tier, this rank's first sample id)."""
    if not os.environ.get("RAMPWATCH_DEBUG_RANKS"):
        return
    tier, w = outcome.tier, t.ddp.world_size
    n = tier.per_device_batch * tier.accum * w
    first, _ = rank_slice(t.state.next_sample - n, n, t.ddp.rank, w)
    print(
        f"rampwatch-rank rank={t.ddp.rank} step={t.state.step} tier={tier.per_device_batch}x"
        f"{tier.accum} first_sample={first} lr={t.optimizer.param_groups[0]['lr']:.6g}",
        flush=True,
    )


def teardown(info: DistInfo) -> None:
    if info.enabled and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
