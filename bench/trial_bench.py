"""Ramp trials against a known critical batch; prints markdown tables.

    python bench/trial_bench.py --problem quadratic            # 3 seeds per batch
    python bench/trial_bench.py --problem quadratic --quick    # 1 seed, fewer batches

The problem: least squares y = x·w* + σε with x ~ N(0, H), H = diag(h), h spread over
`decades` decades, trained from w = 0 by Adam (β = 0.9, 0.95) in float64. Its excess loss
½(w − w*)ᵀH(w − w*) and its gradient noise are known in closed form: with δ = w − w*,
G = Hδ and the per-example gradient covariance is Σ = H(δᵀHδ + σ²) + HδδᵀH (Isserlis), so
B_simple = tr(Σ)/|G|² = tr(H)(δᵀHδ + σ²)/|Hδ|² + 1 exactly, at any point of training.

Why the noise scale is wrong here. B_simple weighs every direction by its gradient: tr(Σ) is
tr(H) times the residual, |G|² is dominated by the few stiff directions (large h). SGD moves each
direction by h_i times its error, so the stiff ones set both its step limit and its noise, and
B_simple ≈ its critical batch (McCandlish et al. 2018 derive it for H ∝ I). Adam divides each
coordinate's step by its own gradient's RMS, so every coordinate moves about lr per step whatever
its h: the stiff coordinates are no longer the bottleneck (they converge in a few steps, then
jitter at the lr's scale), and a step's noise is set per coordinate, against that coordinate's
own signal. The batch past which more examples stop buying fewer steps is then a property of the
per-coordinate signal-to-noise of the coordinates still converging, which B_simple's global ratio
does not see. On this problem B_simple grows from ~3× the sweep's B_crit early to ~35× it at the
target, while the sweep's B_crit stays within 5-10 (the README's figures).

What it prints:
- the sweep: for each constant batch B, the fewest steps from w = 0 to each of four excess losses
  (8, 4, 2, 1 × the target) over an LR grid (√2 apart; mean over seeds), and per loss the fit
  S = S_min(1 + B_crit/B) (rampwatch.advisor.gns.fit_critical_batch, McCandlish et al. §2.3);
- per loss, a run at batch B0 (its best LR) trained until it reaches that loss, B_simple there
  from the closed form, and a trial there (advisor/trial.py's verdict through
  monitor/trial_runner.py: control and branches ×2 … ×64 on the same examples, LR × √k, judged
  on 2,048 fixed held-out examples): its bracket, whether it agrees with B_crit within 2×
  (`agrees`), its cost;
- the restore check: the control restored and continued equals a run that never branched.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field

import torch

from rampwatch.advisor.gns import fit_critical_batch
from rampwatch.advisor.gns_window import significant
from rampwatch.advisor.trial import TrialPlan
from rampwatch.monitor.ramp_protocol import scale_lr
from rampwatch.monitor.trial_runner import run_trial

BLOCK = 256  # examples per generated block of the indexed stream
BETAS = (0.9, 0.95)  # an LLM's Adam: the second moment follows a branch's new noise in ~20 steps
EVAL_SEED = 10**6  # the held-out examples come from blocks no training run reaches


@dataclass
class Quadratic:
    """The least-squares problem, its closed forms and its examples addressed by index."""

    dim: int = 32
    decades: float = 4.0
    noise: float = 1.0
    seed: int = 0  # the problem (w*); a run's data seed is separate
    h: torch.Tensor = field(init=False)
    w_star: torch.Tensor = field(init=False)
    _last: tuple = field(init=False, default=(None, None))

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        self.h = torch.logspace(0, -self.decades, self.dim, dtype=torch.float64)
        self.w_star = torch.randn(self.dim, generator=g, dtype=torch.float64)

    def excess(self, w: torch.Tensor) -> torch.Tensor:
        """½(w − w*)ᵀH(w − w*) over the last dimension (rows of w are separate runs)."""
        return 0.5 * ((w - self.w_star) ** 2 * self.h).sum(-1)

    def b_simple(self, w: torch.Tensor) -> float:
        """tr(Σ)/|G|² at w, exactly (module docstring)."""
        delta = w.detach() - self.w_star
        g2 = ((self.h * delta) ** 2).sum()
        trace = self.h.sum() * ((self.h * delta**2).sum() + self.noise**2) + g2
        return float(trace / g2)

    def block(self, data_seed: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last[0] != (data_seed, j):  # small batches read one block many times
            g = torch.Generator().manual_seed(data_seed * 10**7 + j)
            x = torch.randn(BLOCK, self.dim, generator=g, dtype=torch.float64) * self.h.sqrt()
            noise = torch.randn(BLOCK, generator=g, dtype=torch.float64)
            self._last = ((data_seed, j), (x, x @ self.w_star + self.noise * noise))
        return self._last[1]

    def examples(self, data_seed: int, start: int, count: int):
        """Examples start..start+count of the run's stream: the same index, the same example."""
        first, last = start // BLOCK, (start + count - 1) // BLOCK
        xs, ys = zip(*(self.block(data_seed, j) for j in range(first, last + 1)), strict=True)
        lo = start - first * BLOCK
        return torch.cat(xs)[lo : lo + count], torch.cat(ys)[lo : lo + count]


def per_example_loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """½(x·w − y)² per example; rows of w are separate runs → [runs, examples]."""
    return 0.5 * (torch.atleast_2d(w) @ x.T - y) ** 2


def steps_to_targets(problem, batch, lrs, targets, data_seed, max_steps) -> list[list[float]]:
    """Per target, per LR: the step at which the excess loss first reaches it (runs share data)."""
    ws = [torch.zeros(problem.dim, dtype=torch.float64, requires_grad=True) for _ in lrs]
    opt = torch.optim.Adam(
        [{"params": [w], "lr": lr} for w, lr in zip(ws, lrs, strict=True)], betas=BETAS
    )
    hit = [[math.inf] * len(lrs) for _ in targets]
    for step in range(1, max_steps + 1):
        x, y = problem.examples(data_seed, (step - 1) * batch, batch)
        opt.zero_grad()
        per_example_loss(torch.stack(ws), x, y).mean(1).sum().backward()
        opt.step()
        with torch.no_grad():
            excess = problem.excess(torch.stack(ws)).tolist()
        for row, target in zip(hit, targets, strict=True):
            row[:] = [
                step if e <= target and h == math.inf else h
                for e, h in zip(excess, row, strict=True)
            ]
        deepest = hit[-1]
        if all(h < math.inf for h in deepest) or step > 4 * min(deepest):  # the rest are slower
            break
    return hit


def sweep(problem, batches, lrs, targets, seeds, max_steps) -> dict:
    """target → ({batch: (mean steps over seeds at the best LR, that LR)}, S_min, B_crit)."""
    runs = {
        b: [steps_to_targets(problem, b, lrs, targets, s, max_steps) for s in seeds]
        for b in batches
    }
    out = {}
    for t, target in enumerate(targets):
        rows = {}
        for b, per_seed in runs.items():
            means = [sum(col) / len(col) for col in zip(*(hit[t] for hit in per_seed), strict=True)]
            i = min(range(len(lrs)), key=means.__getitem__)
            rows[b] = (means[i], lrs[i])
        reached = {b: r for b, r in rows.items() if r[0] < math.inf}
        s_min, b_crit = fit_critical_batch(list(reached), [r[0] for r in reached.values()])
        out[target] = (rows, s_min, b_crit)
    return out


class BaseRun:
    """The run a trial branches from: batch B0, one LR, Adam, its data stream by example index."""

    def __init__(self, problem: Quadratic, batch: int, lr: float, data_seed: int = 99):
        self.problem, self.batch, self.data_seed = problem, batch, data_seed
        self.w = torch.nn.Parameter(torch.zeros(problem.dim, dtype=torch.float64))
        self.model = torch.nn.ParameterList([self.w])  # holds self.w itself; its state_dict
        self.opt = torch.optim.Adam([self.w], lr=lr, betas=BETAS)
        self.seen = 0  # examples consumed: the data position
        x, y = problem.examples(EVAL_SEED, 0, 2048)
        self.eval_x, self.eval_y = x, y

    def train_step(self, model, optimizer, start, count):
        x, y = self.problem.examples(self.data_seed, start, count)
        optimizer.zero_grad()
        per_example_loss(model[0], x, y).mean().backward()
        optimizer.step()

    def step(self, count: int | None = None):
        count = count or self.batch
        self.train_step(self.model, self.opt, self.seen, count)
        self.seen += count

    def until(self, excess: float, max_steps: int = 20_000) -> None:
        """Train until the excess loss first reaches `excess`."""
        for _ in range(max_steps):
            if self.excess() <= excess:
                return
            self.step()
        raise SystemExit(
            f"the base run did not reach excess loss {excess:.3g} in {max_steps} steps"
        )

    def evaluate(self, model):
        return per_example_loss(model[0], self.eval_x, self.eval_y)[0]

    def excess(self) -> float:
        return float(self.problem.excess(self.w.detach()))

    def trial(self, plan: TrialPlan):
        verdict, losses = run_trial(
            plan, self.model, self.opt, self.train_step, self.evaluate, start=self.seen,
            b_simple=self.problem.b_simple(self.w),
        )  # fmt: skip
        self.seen += plan.delta_tokens  # the kept arm read examples seen..seen+Δ
        return verdict


def restore_check(problem, batch, lr, plan, warm_steps, after_steps) -> tuple[int, float]:
    """(kept k, max |w| difference) between a run that trialled `plan` after `warm_steps` and one
    that never branched: it ran the kept arm by hand (the same batch and LR × f(k), on the same
    examples), then both run `after_steps` more at that batch."""
    trialled, by_hand = BaseRun(problem, batch, lr), BaseRun(problem, batch, lr)
    for run in (trialled, by_hand):
        for _ in range(warm_steps):
            run.step()
    k = trialled.trial(plan).kept_k
    if k > 1:
        scale_lr(by_hand.opt, plan.lr_factor(k))
    for run in (trialled, by_hand):
        run.batch = k * batch
    for _ in range(plan.steps(k)):
        by_hand.step()
    for _ in range(after_steps):
        trialled.step()
        by_hand.step()
    return k, float((trialled.w - by_hand.w).detach().abs().max())


def plan_at(batch: int, ks: tuple[int, ...], steps_of_largest: int) -> TrialPlan:
    """Adam's trial from `batch`: Δ is `steps_of_largest` steps of the largest branch."""
    delta = ks[-1] * batch * steps_of_largest
    return TrialPlan.for_optimizer("adam", batch=batch, ks=ks, delta_tokens=delta)


def trials(problem, batch, lr, ks, steps_of_largest, points):
    """Per point: a run at `batch` trained until its excess loss first reaches it, then a trial.
    Returns (excess there, B_simple there, verdict) per point."""
    out = []
    for point in points:
        run = BaseRun(problem, batch, lr)
        run.until(point)
        b_simple, before = problem.b_simple(run.w), run.excess()
        out.append((before, b_simple, run.trial(plan_at(batch, ks, steps_of_largest))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problem", choices=["quadratic"], default="quadratic")
    ap.add_argument("--quick", action="store_true", help="1 seed, fewer batches")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = measure(quick=args.quick)
    print(report.table())
    return 0


@dataclass
class Report:
    sweeps: dict  # target → (rows, S_min, B_crit)
    trials: list  # per target: (excess at the trial, B_simple there, verdict)
    restore_checks: list  # (kept k, max |Δw|)

    def table(self) -> str:
        targets = list(self.sweeps)
        head = " | ".join(f"to {significant(t)}" for t in targets)
        lines = [
            "Constant-batch sweep, Adam, fewest steps over the LR grid (mean over seeds) to each",
            "excess loss, and the fit S = S_min(1 + B_crit/B):",
            "",
            f"| batch | {head} |",
            "|---:|" + "---:|" * len(targets),
        ]
        for b in self.sweeps[targets[0]][0]:
            cells = " | ".join(f"{self.sweeps[t][0][b][0]:.1f}" for t in targets)
            lines.append(f"| {b} | {cells} |")
        lines.append(
            "| B_crit | " + " | ".join(f"**{self.sweeps[t][2]:.1f}**" for t in targets) + " |"
        )
        lines += [
            "",
            "| excess loss at trial | sweep B_crit | B_simple there | B_simple / B_crit | "
            "bracket | within 2× | cost (examples) | verdict |",
            "|---:|---:|---:|---:|---|---|---:|---|",
        ]
        for target, (before, b_simple, v) in zip(targets, self.trials, strict=True):
            b_crit = self.sweeps[target][2]
            lo, hi = v.bracket
            shown = f"[{'—' if lo is None else lo}, {'∞' if hi is None else hi})"
            lines.append(
                f"| {significant(before)} | {b_crit:.1f} | {b_simple:.1f} | {b_simple / b_crit:.1f} | "
                f"{shown} | {'yes' if agrees(v.bracket, b_crit) else 'no'} | "
                f"{v.cost_tokens:,} | {v.summary} |"
            )
        lines.append("")
        for k, diff in self.restore_checks:
            arm = "the control" if k == 1 else f"branch ×{k}"
            lines.append(
                f"Restore check, trial kept {arm}: max |Δw| against a run that never branched "
                f"and ran it by hand = {diff:.3g}"
            )
        return "\n".join(lines)


def agrees(bracket, b_crit: float) -> bool:
    """The bracket [lo, hi) widened by 2× at each end contains B_crit."""
    lo, hi = bracket
    return (lo is None or lo / 2 <= b_crit) and (hi is None or b_crit < 2 * hi)


SETTINGS = dict(
    problem=dict(dim=32, decades=6.0, noise=1.0),
    target_fraction=0.01,  # of the initial excess loss
    base_batch=2,
    ks=(2, 4, 8, 16, 32, 64),
    delta_steps_of_largest=4,
    points=(8.0, 4.0, 2.0, 1.0),  # multiples of the target: a sweep's B_crit and a trial at each
)


def measure(quick: bool = False, settings=SETTINGS) -> Report:
    problem = Quadratic(**settings["problem"])
    start = float(problem.excess(torch.zeros(problem.dim)))
    targets = [p * settings["target_fraction"] * start for p in settings["points"]]
    lrs = [0.01 * 2 ** (i / 2) for i in range(14)]
    batches = (1, 2, 4, 8, 16, 32, 64, 256) if quick else (1, 2, 4, 8, 16, 32, 64, 128, 256)
    seeds = (0,) if quick else (0, 1, 2)
    sweeps = sweep(problem, batches, lrs, targets, seeds, max_steps=5000)
    b0, (ks, m) = settings["base_batch"], (settings["ks"], settings["delta_steps_of_largest"])
    lr0 = sweeps[targets[-1]][0][b0][1]  # the base batch's best LR to the deepest target
    done = trials(problem, b0, lr0, ks, m, targets)
    checks = [restore_check(problem, b0, lr0, plan_at(b0, ks, m), w, 30) for w in (5, 200)]
    return Report(sweeps, done, checks)


if __name__ == "__main__":
    sys.exit(main())
