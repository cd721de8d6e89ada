"""The ramp protocol's transport under torch.distributed: rank 0 decides, and every rank learns
the same decision (`Proposal`: a ramp, or a trial with its arms' tiers) at the same boundary
through `RampChannel`, one non-blocking broadcast on a gloo group per boundary. RampProtocol
(monitor/ramp_protocol.py) is its only user.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from rampwatch.advisor.tiers import RAMP_MAX_FACTOR, Tier

KINDS = ("ramp", "trial")
_ARM_SLOTS = RAMP_MAX_FACTOR - 1  # factors 2 .. RAMP_MAX_FACTOR, one (batch, accum) pair each


@dataclass
class Proposal:
    """A change rank 0 decided: what every rank applies, and what it came from. kind "ramp":
    the new tier and base LR; kind "trial": the running tier and base LR, Δ tokens per arm and
    each branch's tier by its factor (monitor/trial_protocol.py builds the request from it)."""

    tier: Tier
    base_lr: float
    source: str
    command_id: int | None
    kind: str = "ramp"
    delta_tokens: int = 0
    arms: tuple[tuple[int, Tier], ...] = ()  # (factor, tier) of each branch, factor increasing
    delta_choice: dict | None = None  # what a trial's Δ rests on: rank 0's own, never sent


class RampChannel:
    """torch.distributed: rank 0's decision reaches every rank at the same boundary.

    At each boundary every rank waits for the broadcast posted one boundary earlier (rank 0 sent
    it a whole step, and a gradient all-reduce, before anyone waits: no per-step stall), then
    posts the next one, non-blocking, on a gloo group (CPU tensors, never behind NCCL work).
    So a decision at boundary S is applied by every rank at boundary S + 1."""

    # flag, per-device batch, accum, base LR, command id (-1: none), auto, stop, kind, Δ tokens,
    # then (per-device batch, accum) of the branch at each factor 2 .. RAMP_MAX_FACTOR (0: none)
    FIELDS = 9 + 2 * _ARM_SLOTS

    def __init__(self, group=None):
        self.group = group if group is not None else torch_dist.new_group(backend="gloo")
        self.rank = torch_dist.get_rank()
        self.world_size = torch_dist.get_world_size(self.group)  # the tier's (never sent)
        self._inflight = None  # (work, buffer, the proposal rank 0 sent in it)
        self.stopping = False  # rank 0 asked every rank to stop at this boundary

    @property
    def sending(self) -> bool:
        """Rank 0 has a proposal in flight (it reaches every rank at the next boundary)."""
        return self._inflight is not None and self._inflight[2] is not None

    def exchange(
        self, proposal: Proposal | None, stop: bool = False
    ) -> tuple[Proposal | None, Proposal | None]:
        """(the proposal every rank applies now, or None; the one sent with it on rank 0).
        stop: rank 0 asks every rank to stop; `stopping` says so one boundary later."""
        received = self._receive()
        buf = torch.zeros(self.FIELDS, dtype=torch.float64)
        if self.rank == 0:
            buf[6] = float(stop)
        if self.rank == 0 and proposal is not None:
            buf[:6] = torch.tensor(
                [
                    1.0,
                    proposal.tier.per_device_batch,
                    proposal.tier.accum,
                    proposal.base_lr,
                    proposal.command_id or -1,
                    proposal.source.startswith("auto"),
                ],
                dtype=torch.float64,
            )
            buf[7:] = torch.tensor(_trial_fields(proposal), dtype=torch.float64)
        work = torch_dist.broadcast(buf, src=0, group=self.group, async_op=True)
        self._inflight = (work, buf, proposal if self.rank == 0 else None)
        return received

    def _receive(self) -> tuple[Proposal | None, Proposal | None]:
        if self._inflight is None:
            return None, None
        work, buf, sent = self._inflight
        self._inflight = None
        work.wait()
        values = buf.tolist()
        flag, b, a, lr, cid, auto, stop, kind, delta = values[:9]
        self.stopping = self.stopping or bool(stop)
        if not flag:
            return None, None
        source = sent.source if sent else ("auto (rank 0)" if auto else "rank 0")
        tier = Tier(int(b), int(a), self.world_size)
        pairs = values[9:]
        arms = tuple(
            (k, Tier(int(pairs[2 * i]), int(pairs[2 * i + 1]), self.world_size))
            for i, k in enumerate(range(2, RAMP_MAX_FACTOR + 1))
            if pairs[2 * i]
        )
        got = Proposal(
            tier, lr, source, int(cid) if cid >= 0 else None, KINDS[int(kind)], int(delta), arms
        )
        return got, sent

    def drain(self, wait: bool) -> Proposal | None:
        """At the end: rank 0's proposal still in flight (waited for only when every rank is at
        the same boundary, i.e. the run finished). Then the channel lets go of its group: a gloo
        group still referenced after the program's destroy_process_group() can abort the rank at
        exit ("terminate called without an active exception"; torch 2.13, a plain two-rank loop
        with no monitor: 4 of 20 runs under load)."""
        sent = None
        if self._inflight is not None:
            sent = self._inflight[2]
            if wait:
                self._receive()
            self._inflight = None
        self.group = None
        return sent


def _trial_fields(proposal: Proposal) -> list[float]:
    """The buffer's kind, Δ and arm slots of a proposal (a ramp: kind 0, the rest 0)."""
    pairs = [0.0] * (2 * _ARM_SLOTS)
    for k, tier in proposal.arms:
        pairs[2 * (k - 2)], pairs[2 * (k - 2) + 1] = tier.per_device_batch, tier.accum
    return [float(KINDS.index(proposal.kind)), float(proposal.delta_tokens), *pairs]
