"""The ramp protocol's transport under torch.distributed: rank 0 decides, and every rank learns
the same decision (`Proposal`) at the same boundary through `RampChannel`, one non-blocking
broadcast on a gloo group per boundary. RampProtocol (monitor/ramp_protocol.py) is its only user.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from rampwatch.advisor.tiers import Tier


@dataclass
class Proposal:
    """A tier change rank 0 decided: what every rank applies, and what it came from."""

    tier: Tier
    base_lr: float
    source: str
    command_id: int | None


class RampChannel:
    """torch.distributed: rank 0's decision reaches every rank at the same boundary.

    At each boundary every rank waits for the broadcast posted one boundary earlier (rank 0 sent
    it a whole step, and a gradient all-reduce, before anyone waits: no per-step stall), then
    posts the next one, non-blocking, on a gloo group (CPU tensors, never behind NCCL work).
    So a decision at boundary S is applied by every rank at boundary S + 1."""

    FIELDS = 7  # flag, per-device batch, accum, base LR, command id (-1: none), auto, stop

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
        work = torch_dist.broadcast(buf, src=0, group=self.group, async_op=True)
        self._inflight = (work, buf, proposal if self.rank == 0 else None)
        return received

    def _receive(self) -> tuple[Proposal | None, Proposal | None]:
        if self._inflight is None:
            return None, None
        work, buf, sent = self._inflight
        self._inflight = None
        work.wait()
        flag, b, a, lr, cid, auto, stop = buf.tolist()
        self.stopping = self.stopping or bool(stop)
        if not flag:
            return None, None
        source = sent.source if sent else ("auto (rank 0)" if auto else "rank 0")
        tier = Tier(int(b), int(a), self.world_size)
        got = Proposal(tier, lr, source, int(cid) if cid >= 0 else None)
        return got, sent

    def drain(self, wait: bool) -> Proposal | None:
        """At the end: rank 0's proposal still in flight (waited for only when every rank is at
        the same boundary, i.e. the run finished)."""
        if self._inflight is None:
            return None
        sent = self._inflight[2]
        if wait:
            self._receive()
        self._inflight = None
        return sent
