"""Ramp trials against a known critical batch; prints markdown tables.

    python bench/trial_bench.py --problem quadratic            # 3 seeds per batch
    python bench/trial_bench.py --problem quadratic --quick    # 1 seed, fewer batches
    python bench/trial_bench.py --problem stiff-sgd            # SGD, B_noise ≈ 20 × B_simple

`--problem stiff-sgd` (measure_stiff, StiffReport; its docstring has the derivation) is the same
least squares with one stiff direction and eight soft ones, trained by plain SGD at a low LR:
there B_noise is ≈ 20 × B_simple, and it asks which critical batch the trial finds. The rest of
this docstring is the quadratic problem's.

The problem: least squares y = x·w* + σε with x ~ N(0, H), H = diag(h), h spread over
`decades` decades, trained from w = 0 by Adam (β = 0.9, 0.95) in float64. Its excess loss
½(w − w*)ᵀH(w − w*) and its gradient noise are known in closed form: with δ = w − w*,
G = Hδ and the per-example gradient covariance is Σ = H(δᵀHδ + σ²) + HδδᵀH (Isserlis), so
B_simple = tr(Σ)/|G|² = tr(H)(δᵀHδ + σ²)/|Hδ|² + 1 exactly, at any point of training, and the
Hessian-weighted B_noise = tr(HΣ)/(GᵀHG) = tr(H²)(δᵀHδ + σ²)/(δᵀH³δ) + 1 (McCandlish et al. 2018
§2.2, the critical batch of SGD in their quadratic model).

Why the noise scale is wrong here. Both noise scales weigh directions by their curvature: |G|²
and GᵀHG are dominated by the few stiff directions (large h), so on this problem B_noise and
B_simple stay within 1.5× of each other (measured: it is not a problem where they differ by 10×).
SGD moves each direction by h_i times its error, so the stiff ones set both its step limit and
its noise, and B_noise ≈ its critical batch. Adam divides each coordinate's step by its own
gradient's RMS, so every coordinate moves about lr per step whatever its h: the stiff coordinates
are no longer the bottleneck (they converge in a few steps, then jitter at the lr's scale), and a
step's noise is set per coordinate, against that coordinate's own signal. The batch past which
more examples stop buying fewer steps is then a property of the per-coordinate signal-to-noise
of the coordinates still converging, which neither global ratio sees.

What it prints:
- the sweep from w = 0: for each constant batch B, the fewest steps to each of four excess losses
  (8, 4, 2, 1 × the target) over an LR grid (√2 apart; mean over seeds), and per loss the fit
  S = S_min(1 + B_crit/B) (rampwatch.advisor.gns.fit_critical_batch, McCandlish et al. §2.3);
- per loss, a run at batch B0 (its best LR) trained until it reaches that loss: the local sweep
  from that snapshot (each B from the snapshot's w and Adam moments, steps to half its excess
  loss, the fit: the local B_crit there), both noise scales there from the closed forms, and a
  trial there (advisor/trial.py's verdict through monitor/trial_runner.py: control and branches
  ×2 … ×64 on the same examples, LR × √k, judged on 2,048 fixed held-out examples): its bracket,
  whether it agrees with the local B_crit within 2× (`agrees`), its cost; then the same trial
  with shorter Δ; then the adaptive trial: Δ halved (dropping a branch whose step no longer
  divides it) until the control's half-progress ratio says Δ can tell (advisor/trial.py: Δ too
  long), its bracket beside the local B_crit;
- the restore check: the control restored and continued equals a run that never branched.

Why the local sweep runs each B at the snapshot's LR × √(B/B0), the trial's rule, and not an LR
tuned per B: from a snapshot, Adam's first moment points downhill, and the first-hit step count
rewards one large step along it. Measured at the first two points with the from-init LR grid:
one step at LR 0.16-0.23 reaches 0.8 × the snapshot's excess at every B, so the tuned fit gives
B_crit ≈ 0 (to 0.4 ×: 0.4 and 3.2, the LR jumping 0.08-0.9 between batches). A ramp keeps
the run's LR and moves it by the rule, and the trial asks exactly that question; the √ rule's
cost is a higher noise floor at larger B (Adam's jitter scales with the LR, not with 1/B), which
shows as steps that stop falling with B (the fit then gives "—").
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from dataclasses import dataclass, field

import torch

from rampwatch.advisor.gns import fit_critical_batch
from rampwatch.advisor.gns_window import significant
from rampwatch.advisor.lr import lr_multiplier, rule_for
from rampwatch.advisor.trial import HALF_PROGRESS_MIN, TrialPlan, failed_factor
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
    soft: float | None = None  # h = (1, soft, …, soft) instead of the log spread: stiff-sgd
    h: torch.Tensor = field(init=False)
    w_star: torch.Tensor = field(init=False)
    _last: tuple = field(init=False, default=(None, None))

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        self.h = torch.logspace(0, -self.decades, self.dim, dtype=torch.float64)
        if self.soft is not None:  # one stiff direction, a gap, the rest soft
            self.h = torch.full((self.dim,), float(self.soft), dtype=torch.float64)
            self.h[0] = 1.0
        self.w_star = torch.randn(self.dim, generator=g, dtype=torch.float64)

    def excess(self, w: torch.Tensor) -> torch.Tensor:
        """½(w − w*)ᵀH(w − w*) over the last dimension (rows of w are separate runs)."""
        return 0.5 * ((w - self.w_star) ** 2 * self.h).sum(-1)

    def b_simple(self, w: torch.Tensor) -> float:
        """tr(Σ)/|G|² at w, exactly (module docstring)."""
        return self._noise_scale(w, power=0)

    def b_noise(self, w: torch.Tensor) -> float:
        """tr(HΣ)/(GᵀHG) at w, exactly: McCandlish et al. 2018 §2.2's Hessian-weighted noise
        scale, the critical batch of SGD in their quadratic model."""
        return self._noise_scale(w, power=1)

    def _noise_scale(self, w: torch.Tensor, power: int) -> float:
        """tr(HᵖΣ)/(GᵀHᵖG) with Σ = H(δᵀHδ + σ²) + GGᵀ, G = Hδ: the GGᵀ term adds exactly 1."""
        delta = w.detach() - self.w_star
        weight = self.h**power
        residual = (self.h * delta**2).sum() + self.noise**2
        signal = (weight * (self.h * delta) ** 2).sum()
        return float((weight * self.h).sum() * residual / signal + 1)

    def sampled_noise_scales(self, w: torch.Tensor, count: int, data_seed: int) -> tuple:
        """(B_simple, B_noise) from `count` sampled per-example gradients at w: tr(Σ)/|G|² and
        tr(HΣ)/(GᵀHG), Σ their covariance about G = Hδ (a check of the closed forms; H is
        diagonal, so diag(Σ) is all either trace reads)."""
        x, y = self.examples(data_seed, 0, count)
        grads = x * (x @ w - y)[:, None]  # ∇½(x·w − y)² per example
        big_g = self.h * (w - self.w_star)
        sigma_diag = ((grads - big_g) ** 2).mean(0)
        simple = float(sigma_diag.sum() / (big_g @ big_g))
        return simple, float((self.h * sigma_diag).sum() / (big_g @ (self.h * big_g)))

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


def make_optimizer(name: str, groups: list) -> torch.optim.Optimizer:
    """'adam' (the bench's β) or 'sgd' (plain: no momentum, so a snapshot is just w)."""
    if name == "adam":
        return torch.optim.Adam(groups, betas=BETAS)
    if name == "sgd":
        return torch.optim.SGD(groups)
    raise ValueError(f"optimizer must be 'adam' or 'sgd', got {name!r}")


def per_example_loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """½(x·w − y)² per example; rows of w are separate runs → [runs, examples]."""
    return 0.5 * (torch.atleast_2d(w) @ x.T - y) ** 2


def steps_to_targets(
    problem, batch, lrs, targets, data_seed, max_steps, start=None, optimizer="adam", hold=False
) -> list[list[float]]:
    """Per target, per LR: the step at which the excess loss first reaches it (runs share data).
    From w = 0 and a fresh optimizer, or from `start` = (w, the optimizer's state for w): a
    snapshot. `hold`: a hit counts only if the excess stays under 2 × the target until 4 × its
    step (SGD past 2/h_max can cross the target while its stiff direction still grows from a
    tiny error: measured at LR 2.56, a hit at step 5 held to step 10, of a run that diverges);
    it stops once every run is past 100 × the target (diverged)."""
    w0, state = start or (torch.zeros(problem.dim, dtype=torch.float64), None)
    ws = [w0.clone().requires_grad_(True) for _ in lrs]
    groups = [{"params": [w], "lr": lr} for w, lr in zip(ws, lrs, strict=True)]
    opt = make_optimizer(optimizer, groups)
    if state is not None:  # every copy resumes the snapshot's moments and step count
        for w in ws:
            opt.state[w] = {k: v.clone() for k, v in state.items()}
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
            if hold:  # a run that left 2 × the target after its hit has not reached it
                row[:] = [
                    math.inf if e > 2 * target else h for e, h in zip(excess, row, strict=False)
                ]
        deepest = hit[-1]
        if hold:  # the best held its hit (the rest are slower), or every run diverged
            if step >= 4 * min(deepest) or all(not e <= 100 * max(targets) for e in excess):
                break
        elif all(h < math.inf for h in deepest) or step > 4 * min(deepest):  # the rest: slower
            break
    return hit


def sweep(
    problem, lrs, targets, seeds, max_steps, start=None, optimizer="adam", hold=False
) -> dict:
    """target → ({batch: (mean steps over seeds at the best LR, that LR)}, S_min, B_crit).
    `lrs` maps each batch to its LR grid; `start`, `optimizer`, `hold` as in steps_to_targets."""
    runs = {
        b: [
            steps_to_targets(problem, b, grid, targets, s, max_steps, start, optimizer, hold)
            for s in seeds
        ]
        for b, grid in lrs.items()
    }
    out = {}
    for t, target in enumerate(targets):
        rows = {}
        for b, per_seed in runs.items():
            means = [sum(col) / len(col) for col in zip(*(hit[t] for hit in per_seed), strict=True)]
            i = min(range(len(means)), key=means.__getitem__)
            rows[b] = (means[i], lrs[b][i])
        out[target] = (rows, *_fit(rows))
    return out


def _fit(rows) -> tuple[float, float]:
    """(S_min, B_crit) over the batches that reached the target; NaN where the steps do not
    fall with B (a local sweep past its LR's noise floor: larger B, larger LR, a higher floor)."""
    reached = {b: r[0] for b, r in rows.items() if r[0] < math.inf}
    try:
        return fit_critical_batch(list(reached), list(reached.values()))
    except ValueError:
        return math.nan, math.nan


def local_sweep(problem, run, batches, fraction, seeds, max_steps, grid=None) -> tuple:
    """The sweep from `run`'s snapshot to `fraction` × its excess loss: (rows, S_min, B_crit).
    Each batch B at the run's LR moved by the trial's rule, × √(B/B0) for Adam, × B/B0 for SGD
    (module docstring: why not tuned), or, given `grid`, at the best LR of that grid (SGD: no
    optimizer state, so tuning from the snapshot is McCandlish et al.'s sweep)."""
    lr, rule = run.opt.param_groups[0]["lr"], rule_for(run.optimizer)
    lrs = {b: list(grid) if grid else [lr * lr_multiplier(run.batch, b, rule)] for b in batches}
    target = fraction * run.excess()
    start, hold = run.state(), run.optimizer == "sgd"  # SGD past 2/h_max: see steps_to_targets
    return sweep(problem, lrs, [target], seeds, max_steps, start, run.optimizer, hold)[target]


class BaseRun:
    """The run a trial branches from: batch B0, one LR, Adam or SGD, its data stream by example
    index."""

    def __init__(
        self, problem: Quadratic, batch: int, lr: float, data_seed: int = 99, optimizer="adam"
    ):
        self.problem, self.batch, self.data_seed = problem, batch, data_seed
        self.w = torch.nn.Parameter(torch.zeros(problem.dim, dtype=torch.float64))
        self.model = torch.nn.ParameterList([self.w])  # holds self.w itself; its state_dict
        self.optimizer = optimizer
        self.opt = make_optimizer(optimizer, [{"params": [self.w], "lr": lr}])
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

    def until(self, excess: float, max_steps: int = 100_000) -> None:
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

    def state(self) -> tuple:
        """(w, the optimizer's state for w), copied: where a local sweep starts."""
        moments = {k: v.clone() for k, v in self.opt.state[self.w].items()}
        return self.w.detach().clone(), moments

    def trial(self, plan: TrialPlan, cap: int | None = None):
        verdict, losses = run_trial(
            plan, self.model, self.opt, self.train_step, self.evaluate, start=self.seen,
            b_simple=self.problem.b_simple(self.w), cap=cap,
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


def plan_at(batch: int, ks: tuple[int, ...], steps_of_largest: int, optimizer="adam") -> TrialPlan:
    """The trial from `batch` (the optimizer's LR rule): Δ is `steps_of_largest` steps of the
    largest branch."""
    delta = ks[-1] * batch * steps_of_largest
    return TrialPlan.for_optimizer(optimizer, batch=batch, ks=ks, delta_tokens=delta)


@dataclass
class Point:
    """One point of training: the snapshot's excess loss and noise scales, the local sweep
    from it, and the trial from it."""

    excess: float
    b_simple: float
    b_noise: float
    local: tuple  # local_sweep's (rows, S_min, B_crit)
    verdict: object  # TrialVerdict
    by_delta: dict  # Δ in steps of the largest branch → the bracket of a trial with that Δ
    adaptive: list  # the adaptive trial's verdicts, the first Δ first; the last is its answer


def trials(problem, batch, lr, ks, steps_of_largest, points, local, deltas) -> list[Point]:
    """Per point: a run at `batch` trained until its excess loss first reaches it, a local sweep
    from that snapshot (`local`: local_sweep's keywords), the trial, the same trial with
    each Δ of `deltas` (from an identical run: a trial moves the run on), and the adaptive one."""
    out = []
    for point in points:
        runs = {m: BaseRun(problem, batch, lr) for m in (steps_of_largest, *deltas)}
        for run in runs.values():
            run.until(point)
        run = runs[steps_of_largest]
        here = (run.excess(), problem.b_simple(run.w), problem.b_noise(run.w))
        swept = local_sweep(problem, run, **local)
        adaptive = adaptive_trial(run, plan_at(batch, ks, steps_of_largest))
        verdict = run.trial(plan_at(batch, ks, steps_of_largest))
        by_delta = {
            m: r.trial(plan_at(batch, ks, m)).bracket for m, r in runs.items() if r is not run
        }
        by_delta[steps_of_largest] = verdict.bracket
        out.append(Point(*here, swept, verdict, by_delta, adaptive))
    return out


def adaptive_trial(run, plan: TrialPlan) -> list:
    """Trials from copies of `run`, Δ halved until the trial judges the branches (too long, or
    cannot tell with no positive lower bound: a shorter Δ raises the ratio, and a judged trial
    errs low, so a search that stops at the first one still errs low) or no branch fits a
    shorter Δ: every verdict, the last one
    the answer. Each keeps the failures of the longer Δs before it as its cap, as the product's
    retry does (advisor/trial.py `failed_factor`). Why: SGD past 2/h_max grows its stiff
    direction from a noise floor for several steps before the loss shows it (stiff-sgd: ×128 at
    LR 2.56 is below the control at step 4, 24 × the snapshot's excess at step 12), so the
    halving that the control asks for can hide it."""
    verdicts = [copy.deepcopy(run).trial(plan)]
    while not verdicts[-1].judged and (plan := _halved(plan)) is not None:
        verdicts.append(copy.deepcopy(run).trial(plan, cap=failed_factor(verdicts[-1])))
    return verdicts


def _halved(plan: TrialPlan) -> TrialPlan | None:
    """The plan at Δ/2 with the branches whose step still divides it; None if none does."""
    delta = plan.delta_tokens // 2
    ks = tuple(k for k in plan.ks if delta % (k * plan.batch * plan.tokens_per_example) == 0)
    if not ks or delta * 2 != plan.delta_tokens:
        return None
    return TrialPlan(**{**plan.__dict__, "ks": ks, "delta_tokens": delta})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problem", choices=["quadratic", "stiff-sgd"], default="quadratic")
    ap.add_argument("--quick", action="store_true", help="1 seed, fewer batches")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.problem == "stiff-sgd":
        print(measure_stiff(quick=args.quick).table())
        return 0
    report = measure(quick=args.quick)
    print(report.table())
    return 0


@dataclass
class Report:
    sweeps: dict  # target → (rows, S_min, B_crit), from w = 0
    points: list  # per target: Point (the local sweep and the trial there)
    restore_checks: list  # (kept k, max |Δw|)
    settings: dict

    def table(self) -> str:
        return "\n".join([*self._sweep_lines(), "", *self._local_lines(), "", *self._trial_lines()])

    def _sweep_lines(self) -> list[str]:
        targets = list(self.sweeps)
        head = " | ".join(f"to {significant(t)}" for t in targets)
        lines = [
            "Constant-batch sweep from w = 0, Adam, fewest steps over the LR grid (mean over seeds)",
            "to each excess loss, and the fit S = S_min(1 + B_crit/B):",
            "",
            f"| batch | {head} |",
            "|---:|" + "---:|" * len(targets),
        ]
        for b in self.sweeps[targets[0]][0]:
            cells = " | ".join(f"{self.sweeps[t][0][b][0]:.1f}" for t in targets)
            lines.append(f"| {b} | {cells} |")
        fits = " | ".join(f"**{_shown(self.sweeps[t][2])}**" for t in targets)
        return [*lines, f"| B_crit | {fits} |"]

    def _local_lines(self) -> list[str]:
        fraction, b0 = self.settings["local_fraction"], self.settings["base_batch"]
        head = " | ".join(f"from {significant(p.excess)}" for p in self.points)
        lines = [
            f"Local sweep from each trial's snapshot (the base run at batch {b0}), steps to "
            f"{fraction:g} × the snapshot's excess loss at LR × √(B/{b0}) (mean over seeds; inf: "
            "not reached), and the fit:",
            "",
            f"| batch | {head} |",
            "|---:|" + "---:|" * len(self.points),
        ]
        for b in self.points[0].local[0]:
            cells = " | ".join(f"{p.local[0][b][0]:.1f}" for p in self.points)
            lines.append(f"| {b} | {cells} |")
        fits = " | ".join(f"**{_shown(p.local[2])}**" for p in self.points)
        return [*lines, f"| local B_crit | {fits} |"]

    def _trial_lines(self) -> list[str]:
        b0 = self.settings["base_batch"]
        lines = [
            "| excess at trial | B_simple | B_noise | from-init B_crit | local B_crit | "
            "B_simple / local | bracket | within 2× of local | control's progress / excess | "
            f"Δ / examples at {b0} to the local target | arms | cost (examples) |",
            "|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|---:|",
        ]
        for target, p in zip(self.sweeps, self.points, strict=True):
            v, b_crit = p.verdict, p.local[2]
            examples_b0 = p.local[0][b0][0] * b0
            arms = " ".join(f"×{r.k}{'✓' if r.passed else '✗'}" for r in v.branches)
            lines.append(
                f"| {significant(p.excess)} | {p.b_simple:.1f} | {p.b_noise:.1f} | "
                f"{_shown(self.sweeps[target][2])} | {_shown(b_crit)} | "
                f"{_shown(p.b_simple / b_crit)} | {bracket_text(v.bracket)} | "
                f"{'yes' if agrees(v.bracket, b_crit) else 'no'} | "
                f"{v.progress / p.excess:.2f} | {_shown(v.plan.delta_tokens / examples_b0)} | "
                f"{arms} | {v.cost_tokens:,} |"
            )
        lines += ["", *self._delta_lines(), "", *self._adaptive_lines(), ""]
        for k, diff in self.restore_checks:
            arm = "the control" if k == 1 else f"branch ×{k}"
            lines.append(
                f"Restore check, trial kept {arm}: max |Δw| against a run that never branched "
                f"and ran it by hand = {diff:.3g}"
            )
        return lines

    def _delta_lines(self) -> list[str]:
        b0, ks = self.settings["base_batch"], self.settings["ks"]
        deltas = sorted(self.points[0].by_delta)
        head = " | ".join(f"Δ = {m * ks[-1] * b0}" for m in deltas)
        lines = [
            "The trial's bracket by Δ (examples per arm), beside the local B_crit:",
            "",
            f"| excess at trial | local B_crit | {head} |",
            "|---:|---:|" + "---|" * len(deltas),
        ]
        for p in self.points:
            cells = " | ".join(
                f"{bracket_text(p.by_delta[m])}{' ✓' if agrees(p.by_delta[m], p.local[2]) else ''}"
                for m in deltas
            )
            lines.append(f"| {significant(p.excess)} | {_shown(p.local[2])} | {cells} |")
        return [*lines, "", "✓: within 2× of the local B_crit."]

    def _adaptive_lines(self) -> list[str]:
        lines = [
            "The adaptive trial: Δ halved until the control's second-half progress is at least "
            f"{HALF_PROGRESS_MIN:.2f}× its first half's (advisor/trial.py), beside the local B_crit:",
            "",
            "| excess at trial | local B_crit | Δ tried (examples): half-progress ratio | Δ used | "
            "control's progress / excess | arms | bracket | within 2× of local | "
            "cost (examples, all tries) |",
            "|---:|---:|---|---:|---:|---|---|---|---:|",
        ]
        for p in self.points:
            v = p.adaptive[-1]
            tried = ", ".join(f"{t.plan.delta_tokens}: {ratio_text(t)}" for t in p.adaptive)
            arms = " ".join(f"×{r.k}{'✓' if r.passed else '✗'}" for r in v.branches)
            cost = sum(t.cost_tokens for t in p.adaptive)
            lines.append(
                f"| {significant(p.excess)} | {_shown(p.local[2])} | {tried} | "
                f"{v.plan.delta_tokens if v.judged else '—'} | {v.progress / p.excess:.3f} | "
                f"{arms} | {bracket_text(v.bracket)} | "
                f"{'yes' if agrees(v.bracket, p.local[2]) else 'no'} | {cost:,} |"
            )
        return lines


def ratio_text(verdict) -> str:
    r = verdict.half_progress_ratio
    return "—" if r is None else f"{r:.2f}{'' if verdict.delta_ok else f' ({verdict.delta_check})'}"


def bracket_text(bracket) -> str:
    if bracket is None:  # Δ too long, the Δ check cannot tell, or the control did not learn
        return "none"
    lo, hi = bracket
    return f"[{'—' if lo is None else lo}, {'∞' if hi is None else hi})"


def _shown(x: float) -> str:
    return "—" if not math.isfinite(x) else f"{x:.1f}"


def agrees(bracket, b_crit: float) -> bool:
    """The bracket [lo, hi) widened by 2× at each end contains B_crit (no bracket: no)."""
    if bracket is None:
        return False
    lo, hi = bracket
    return (lo is None or lo / 2 <= b_crit) and (hi is None or b_crit < 2 * hi)


SETTINGS = dict(
    problem=dict(dim=32, decades=6.0, noise=1.0),
    target_fraction=0.01,  # of the initial excess loss
    base_batch=2,
    ks=(2, 4, 8, 16, 32, 64),
    delta_steps_of_largest=4,
    points=(8.0, 4.0, 2.0, 1.0),  # multiples of the target: a sweep's B_crit and a trial at each
    local_fraction=0.5,  # a local sweep's target: half the snapshot's excess loss
    local_max_steps=1000,
    other_deltas=(1, 2),  # Δ in steps of the largest branch, beside delta_steps_of_largest
)


def measure(quick: bool = False, settings=SETTINGS) -> Report:
    problem = Quadratic(**settings["problem"])
    start = float(problem.excess(torch.zeros(problem.dim)))
    targets = [p * settings["target_fraction"] * start for p in settings["points"]]
    lrs = [0.01 * 2 ** (i / 2) for i in range(14)]
    batches = (1, 2, 4, 8, 16, 32, 64, 256) if quick else (1, 2, 4, 8, 16, 32, 64, 128, 256)
    seeds = (0,) if quick else (0, 1, 2)
    sweeps = sweep(problem, {b: lrs for b in batches}, targets, seeds, max_steps=5000)
    b0, (ks, m) = settings["base_batch"], (settings["ks"], settings["delta_steps_of_largest"])
    lr0 = sweeps[targets[-1]][0][b0][1]  # the base batch's best LR to the deepest target
    local = dict(
        batches=batches,
        fraction=settings["local_fraction"],
        seeds=seeds,
        max_steps=settings["local_max_steps"],
    )
    done = trials(problem, b0, lr0, ks, m, targets, local, settings["other_deltas"])
    checks = [restore_check(problem, b0, lr0, plan_at(b0, ks, m), w, 30) for w in (5, 200)]
    return Report(sweeps, done, checks, settings)


# stiff-sgd: one stiff direction (h = 1) and 8 soft ones (h = 0.03), noise σ = 0.1, plain SGD at
# batch 32 with LR 0.02, far below the LR its batch's noise allows (measure_stiff's docstring:
# only there does B_noise reach 10 × B_simple); snapshots at 5%, 2.5%, 1.25% of the initial
# excess loss; then the middle one at LR 0.01 and 0.08: B_noise stays, the wall moves.
STIFF_SETTINGS = dict(
    problem=dict(dim=9, soft=0.03, noise=0.1),
    base_batch=32,
    runs=((0.02, (0.05, 0.025, 0.0125)), (0.01, (0.025,)), (0.08, (0.025,))),  # (LR, points)
    ks=(2, 4, 8, 16, 32, 64, 128),
    delta_steps_of_largest=8,  # the adaptive trial's first Δ: 8 steps of ×128
    local_fraction=0.5,
    rule_batches=(8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
    tuned_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    grid=tuple(0.01 * 2 ** (i / 2) for i in range(16)),  # 0.01 … 1.81; 2/h_max = 2 diverges
    seeds=(0, 1, 2),
    local_max_steps=5000,  # batch 8 at LR 0.01 × 8/32 needs ~4,600
)


@dataclass
class StiffPoint:
    """One snapshot of a stiff-sgd run: its noise scales, both local sweeps, the trial."""

    lr: float  # the run's
    excess: float
    b_simple: float
    b_noise: float
    rule: tuple  # local_sweep's (rows, S_min, B_crit) at the run's LR × B/B0 (the trial's rule)
    tuned: tuple  # local_sweep's (rows, S_min, B_crit) at the best LR of the grid per batch
    adaptive: list  # adaptive_trial's verdicts; the last is the answer

    @property
    def wall(self) -> tuple[int, int | None]:
        """The linear rule's critical batch as [a, b): a the largest batch that reached the
        target, b the next that did not (None: every batch reached it)."""
        rows = self.rule[0]
        top = max(b for b, (steps, _) in rows.items() if steps < math.inf)
        return top, min((b for b in rows if b > top), default=None)


def measure_stiff(quick: bool = False, settings=STIFF_SETTINGS) -> StiffReport:
    """The stiff-sgd problem: a known critical batch where B_noise and B_simple differ ≥ 10×.

    Why the LR is low. B_noise/B_simple = [tr(H²)/tr(H)]·[|G|²/GᵀHG] (the +1s aside): the noise's
    curvature over the gradient's. The first factor is at most h_max, so a ratio ≥ 10 needs
    GᵀHG/|G|² ≤ h_max/10: the gradient in soft directions, the stiff one quiet. SGD at LR η and
    batch B holds each direction at a noise floor E[δ_i²] ≈ η(δᵀHδ + σ²)/(2B) (the stationary
    variance of δ_i ← (1 − ηh_i)δ_i − η·noise, noise variance h_i(δᵀHδ + σ²)/B), which puts
    ≈ η·tr(H³)(δᵀHδ + σ²)/(2B) into δᵀH³δ; so B_noise ≲ 2B·tr(H²)/(η·tr(H³)) and the ratio
    reaches 10 only where η/B is small: a run far below the LR its batch's noise allows.

    Why B_noise need not be SGD's critical batch then. It is the batch at which the one-step
    optimal LR ε_opt(B) = ε_max/(1 + B_noise/B), ε_max = |G|²/GᵀHG, stops growing linearly
    (McCandlish et al. 2018 §2.2). The same bound gives ε_max ≥ 10/h_max whenever the ratio is
    ≥ 10, 5× past SGD's stability limit 2/h_max in the stiff direction: constant-LR SGD cannot
    take that step twice. What limits it instead is 2/h_max, so the linear rule from (B0, η0)
    holds up to B ≈ B0·2/(η0·h_max), a wall set by the run's LR, not by either noise scale.

    Per snapshot: both local sweeps (to `local_fraction` × the snapshot's excess loss), at the
    run's LR × B/B0 (the trial's rule: a ramp's question; its critical batch is the wall, `wall`)
    and at the best LR of `grid` per B (McCandlish et al.'s tuned sweep; SGD has no optimizer
    state, so tuning from a snapshot is clean, unlike Adam's), and the adaptive trial
    (adaptive_trial: ×2 … ×128 at the linear rule, Δ halved until the Δ check says fine)."""
    problem = Quadratic(**settings["problem"])
    b0, ks, m = settings["base_batch"], settings["ks"], settings["delta_steps_of_largest"]
    seeds = (0,) if quick else settings["seeds"]
    common = dict(
        fraction=settings["local_fraction"], seeds=seeds, max_steps=settings["local_max_steps"]
    )
    points = []
    for lr, fractions in settings["runs"]:
        run = BaseRun(problem, b0, lr, optimizer="sgd")
        start = run.excess()
        for fraction in fractions:  # deepest last: one run, trained on between them
            run.until(fraction * start)
            rule = local_sweep(problem, run, settings["rule_batches"], **common)
            grid = settings["grid"]
            tuned = local_sweep(problem, run, settings["tuned_batches"], grid=grid, **common)
            adaptive = adaptive_trial(run, plan_at(b0, ks, m, "sgd"))
            scales = (problem.b_simple(run.w), problem.b_noise(run.w))
            points.append(StiffPoint(lr, run.excess(), *scales, rule, tuned, adaptive))
    return StiffReport(points, settings, seeds)


def overlaps(bracket, interval) -> bool:
    """The bracket [lo, hi) widened by 2× at each end meets [a, b) (b None: ∞; no bracket: no).
    A point x is the bracket (x, x): within 2× of [a, b)."""
    if bracket is None:
        return False
    (lo, hi), (a, b) = bracket, interval
    return (lo is None or b is None or lo / 2 < b) and (hi is None or a < 2 * hi)


@dataclass
class StiffReport:
    points: list  # StiffPoint per snapshot
    settings: dict
    seeds: tuple

    def table(self) -> str:
        st, b0 = self.settings, self.settings["base_batch"]
        heads = [f"LR {p.lr:g}, from {significant(p.excess)}" for p in self.points]
        lines = [
            f"stiff-sgd: h = (1, {st['problem']['soft']} × {st['problem']['dim'] - 1}), "
            f"σ = {st['problem']['noise']}, plain SGD at batch {b0}; seeds {self.seeds}. Local "
            f"sweeps from each snapshot to {st['local_fraction']:g} × its excess loss, steps "
            f"(mean over seeds; inf: not reached or diverged) at the run's LR × B/{b0} | tuned "
            "over the grid (its best LR):",
            "",
            "| batch | " + " | ".join(heads) + " |",
            "|---:|" + "---|" * len(self.points),
        ]
        for b in sorted({*st["rule_batches"], *st["tuned_batches"]}):
            cells = []
            for p in self.points:
                rule, tuned = p.rule[0].get(b), p.tuned[0].get(b)
                cell = "" if rule is None else f"{rule[0]:.1f}"
                cell += "" if tuned is None else f" \\| {tuned[0]:.1f} ({tuned[1]:.2g})"
                cells.append(cell.strip())
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "| LR | excess at trial | B_simple | B_noise | B_noise / B_simple | tuned B_crit | "
            "linear rule's [reached, diverged) (its fit) | trial's bracket | Δ used | "
            "trial within 2× | its lower end converges | B_noise within 2× | "
            "B_simple within 2× | cost (examples) |",
            "|---:|---:|---:|---:|---:|---:|---|---|---:|---|---|---|---|---:|",
        ]
        for p in self.points:
            v, wall = p.adaptive[-1], p.wall
            cost = sum(t.cost_tokens for t in p.adaptive)
            lines.append(
                f"| {p.lr:g} | {significant(p.excess)} | {p.b_simple:.1f} | {p.b_noise:.1f} | "
                f"{p.b_noise / p.b_simple:.1f} | {_shown(p.tuned[2])} | "
                f"[{wall[0]}, {wall[1] or '∞'}) ({_shown(p.rule[2])}) | {bracket_text(v.bracket)} | "
                f"{v.plan.delta_tokens if v.judged else '—'} | "
                f"{_yes(overlaps(v.bracket, wall))} | {_yes(_converges(v.bracket, wall))} | "
                f"{_yes(overlaps((p.b_noise, p.b_noise), wall))} | "
                f"{_yes(overlaps((p.b_simple, p.b_simple), wall))} | {cost:,} |"
            )
        lines += [
            "",
            "The linear rule's critical batch is the wall [a, b): a the largest batch that reached "
            "the target, b the next, which did not. Its fit S = S_min(1 + B_crit/B) is shown but "
            "means nothing: S·B is constant up to the wall, so S_min ≈ 0. Within 2×: the trial's "
            "bracket, or the noise scale, widened 2× each way meets the wall.",
            "",
            "The adaptive trials, Δ tried (examples): half-progress ratio (Δ check):",
        ]
        for p in self.points:
            tried = ", ".join(f"{t.plan.delta_tokens}: {ratio_text(t)}" for t in p.adaptive)
            arms = " ".join(f"×{r.k}{'✓' if r.passed else '✗'}" for r in p.adaptive[-1].branches)
            lines.append(f"- LR {p.lr:g}, from {significant(p.excess)}: {tried}; arms {arms}")
        return "\n".join(lines)


def _converges(bracket, wall) -> bool:
    """The bracket's lower end (what a trial keeps) is a batch the linear rule's sweep reached
    the target at: the trial errs low, so a ramp it allows is safe."""
    return bracket is not None and (bracket[0] is None or bracket[0] <= wall[0])


def _yes(x: bool) -> str:
    return "yes" if x else "no"


if __name__ == "__main__":
    sys.exit(main())
