"""A tiny GPT-2 trained by the Hugging Face Trainer with rampwatch.integrations.transformers, and
the same training as a plain loop switched by hand: child processes of
tests/test_integration_transformers.py, against a real database, on the CPU, nothing downloaded.

    python -m tests.hf_child hf DB OUT_DIR [--ramp manual|auto|off] [--steps N] [--batch B]
        [--accum A] [--n SAMPLES] [--epochs E] [--wait-ramp-at S ...] [--plan] [--policy JSON]
    python -m tests.hf_child reference DB OUT.pt [--switch-at S:B:A] [--steps N] ...
    torchrun --nproc_per_node 2 -m tests.hf_child hf DB OUT_DIR --record ...   (gloo ranks)

hf: starts, or continues through resume_args(OUT_DIR); exits 75 (EXIT_RAMP) at an applied ramp;
at the end OUT_DIR/final.pt gets the parameters and LR. --wait-ramp-at S blocks the boundary
after step S (printing "waiting at S") until a ramp is due or OUT_DIR/release-S exists. --plan
gives the monitor a memory plan (a larger per-device batch then passes the check). --record:
each rank appends the sample ids of every micro-batch it trains, with the step, to
OUT_DIR/samples.rank{R}.jsonl. --direct (with --record): step 1's |G|² and tr(Σ) from each
micro-batch's own gradient on every rank, as the DDP fit takes them (each rank's token-weighted
running means averaged over ranks, the global weighted mean), into OUT_DIR/direct.json. Under torchrun only rank 0 prints the run and "waiting at S" (a
wait ends at a ramp only: every rank must ask the same number of times), each rank prints "rank R
exit CODE" as it leaves, and the final parameters go to OUT_DIR/final.rank{R}.pt.
reference: Trainer's arithmetic by hand (transformers 5.24.0 trainer.py: get_batch_samples'
num_items_in_batch, compute_loss, clip, AdamW fused, linear warmup and decay planned over
--steps of the first tier and stepped by tokens, to the token budget) and an own-loop Monitor fed
the weights m_j / N; the data are the SeedableRandomSampler's epochs read as one stream (equal to
the Trainer's as long as no epoch ends before the switch). OUT.pt also gets step 1's |G|² and
tr(Σ) computed directly from each micro-batch's own gradient, token-weighted and unweighted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

SEQ, VOCAB, SEED, LR, WARMUP = 16, 64, 42, 3e-3, 2


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=32,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


class Samples(torch.utils.data.Dataset):
    """n sequences of 3..16 real tokens, right-padded: token counts differ per micro-batch."""

    def __init__(self, n: int, record: bool = False):
        self.n, self.record = n, record

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(1000 + i)
        length = 3 + (i * 7) % 14
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask = (torch.arange(SEQ) < length).long()
        labels = ids.masked_fill(mask == 0, -100)
        out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        return {**out, "sample_id": torch.tensor(i)} if self.record else out


def _args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["hf", "reference"])
    p.add_argument("db")
    p.add_argument("out")
    p.add_argument("--ramp", default="manual")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--epochs", type=int, default=0)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--n", "--samples", type=int, default=24)  # torchrun: --samples
    p.add_argument("--wait-ramp-at", type=int, action="append", default=[])
    p.add_argument("--switch-at", action="append", default=[])
    p.add_argument("--plan", action="store_true")
    p.add_argument("--policy", default="{}")
    p.add_argument("--record", action="store_true")
    p.add_argument("--direct", action="store_true")
    return p.parse_args(argv)


def rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def run_hf(a) -> int:
    from transformers import TrainerCallback, TrainingArguments

    from rampwatch.advisor.policy import RampPolicy
    from rampwatch.integrations.transformers import RampwatchTrainer, resume_args
    from rampwatch.monitor import Monitor

    _wait_at_boundaries(Monitor, set(a.wait_ramp_at), a.out)
    kw = resume_args(
        a.out, per_device_train_batch_size=a.batch, gradient_accumulation_steps=a.accum
    )
    args = TrainingArguments(
        **kw,
        use_cpu=True,
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        max_steps=-1 if a.epochs else a.steps,
        num_train_epochs=a.epochs or 1,
        learning_rate=LR,
        warmup_steps=WARMUP,
        seed=SEED,
        dataloader_num_workers=0,
        remove_unused_columns=not a.record,  # sample_id: training_step takes it out
    )

    class Plan(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            mon = trainer.monitor
            if a.plan and mon is not None and not mon.ramps.plan_rows:
                mon.add_memory_plan(
                    [
                        {"per_device_batch": b, "predicted_bytes": (64 + 8 * b) << 20}
                        for b in (1, 2, 4, 8, 16)
                    ]
                )

    rank, world = rank_world()
    policy = RampPolicy(
        original_batch=a.batch * a.accum * world,
        original_lr=LR,
        lr_rule="sqrt",
        **json.loads(a.policy),
    )

    own = []  # --direct: step 1's (gradient, loss tokens) of each micro-batch on this rank

    class Recording(RampwatchTrainer):
        """--record: the ids of the samples each micro-batch trains on this rank."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            ids = inputs.pop("sample_id", None)
            if ids is not None:
                line = {"step": self.state.global_step + 1, "ids": ids.tolist()}
                with open(os.path.join(a.out, f"samples.rank{rank}.jsonl"), "a") as f:
                    f.write(json.dumps(line) + "\n")
            if a.direct and self.state.global_step == 0:
                own.append(_own_gradient(self.accelerator.unwrap_model(model), inputs))
                if len(own) == a.accum:
                    _direct_dist(own, a.batch, os.path.join(a.out, "direct.json"))
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = Recording(
        model=build_model(),
        args=args,
        train_dataset=Samples(a.n, a.record),
        db=a.db,
        name="hf-child",
        ramp=a.ramp,
        policy=policy,
        callbacks=[Plan()],
    )
    trainer.train()  # RampRestart (SystemExit 75) at an applied ramp
    torch.save(
        {
            "params": [t.detach().clone() for t in trainer.model.parameters()],
            "lr": trainer.optimizer.param_groups[0]["lr"],
        },
        os.path.join(a.out, "final.pt" if world == 1 else f"final.rank{rank}.pt"),
    )
    return 0


def _wait_at_boundaries(monitor_cls, steps: set[int], out: str) -> None:
    """Monitor.ramp_due, in this process only, waits at the chosen boundaries for a ramp (as
    tests/own_loop_child.py's loop does) and prints the run id at the first boundary."""
    due = monitor_cls.ramp_due
    said, world = [], rank_world()[1]

    def released(step) -> bool:
        return world == 1 and os.path.exists(os.path.join(out, f"release-{step}"))

    def ramp_due(self, step=None):
        if not said and self.run_id is not None:
            said.append(print(f"run {self.run_id}", flush=True))
        ramp = due(self, step)
        if ramp is None and step in steps and self.run_id is not None:
            print(f"waiting at {step}", flush=True)
        deadline = time.monotonic() + 120
        while ramp is None and step in steps and time.monotonic() < deadline and not released(step):
            time.sleep(0.1)
            ramp = due(self, step)
        return ramp

    monitor_cls.ramp_due = ramp_due


def hf_count(model, labels) -> torch.Tensor:
    """num_items_in_batch's count as Trainer._get_num_items_in_batch makes it (its
    _loss_shifts_labels rule, trainer.py __init__): GPT2LMHeadModel's loss_type is None, so 5.24
    counts unshifted labels while its loss sums the shifted ones."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    shifts = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
    return (labels[..., 1:] if shifts else labels).ne(-100).sum()


def loss_tokens(labels) -> torch.Tensor:
    return labels[..., 1:].ne(-100).sum()  # what ForCausalLMLoss sums over


def run_reference(a) -> int:
    from transformers.optimization import get_linear_schedule_with_warmup

    from rampwatch.advisor.lr import scaled_base_lr
    from rampwatch.advisor.policy import RampPolicy
    from rampwatch.monitor import Monitor, TokenClock
    from rampwatch.monitor.ramp_protocol import scale_lr

    model, data = build_model(), Samples(a.n)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True
    )
    b, k = a.batch, a.accum
    sched = TokenClock(get_linear_schedule_with_warmup(opt, WARMUP, a.steps), b * k * SEQ)
    budget = a.steps * b * k * SEQ
    mon = Monitor.start(
        a.db,
        name="hf-reference",
        config={},
        model=model,
        optimizer=opt,
        per_device_batch=b,
        accum=k,
        seq_len=SEQ,
        ramp="off",
        policy=RampPolicy(original_batch=b * k, original_lr=LR),
        total_tokens=budget,
    )
    switches = {int(s): (int(x), int(y)) for s, x, y in (v.split(":") for v in a.switch_at)}
    stream, out, step = _stream(a.n), {}, 0
    while mon.tokens_seen < budget:
        step += 1
        mbs = [_collate([data[next(stream)] for _ in range(b)]) for _ in range(k)]
        n_items = sum(hf_count(model, mb["labels"]) for mb in mbs) / 1  # /1: tp·cp·sp
        if step == 1:
            out["direct"] = _direct(model, mbs, b)
        total = torch.zeros(())
        for mb in mbs:
            loss = model(**mb, num_items_in_batch=n_items).loss
            loss.backward()
            mon.after_backward(loss_tokens(mb["labels"]) / n_items)
            total += loss.detach()
        mon.step(step, loss=total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step(b * k * SEQ)
        model.zero_grad()
        if step in switches:
            nb, nk = switches[step]
            scale_lr(opt, scaled_base_lr(1.0, b * k, nb * nk, "sqrt"), sched)
            b, k = nb, nk
            mon.set_tier(b, k)
    mon.finish()
    out.update(
        params=[t.detach().clone() for t in model.parameters()],
        run_id=mon.run_id,
        lr=opt.param_groups[0]["lr"],
    )
    torch.save(out, a.out)
    return 0


def _stream(n: int):
    epoch = 0
    while True:  # accelerate's SeedableRandomSampler: randperm seeded with seed + epoch
        yield from torch.randperm(n, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        epoch += 1


def _collate(items: list[dict]) -> dict:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def _direct(model, mbs, b: int) -> dict:
    """Step 1's (|G|², tr(Σ)) from each micro-batch's own mean-token gradient g_i: the points
    |Σ_{i<=j} m_i g_i / Σ_{i<=j} m_i|² at B_j = b·T_j/(T_k/k) sequences (weighted), and |mean
    of g_i|² at j·b (unweighted), each fitted as y = |G|² + tr(Σ)/B by least squares."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads, tokens = [], []
    for mb in mbs:
        g = torch.autograd.grad(model(**mb).loss, params)
        grads.append(torch.cat([x.reshape(-1) for x in g]).double())
        tokens.append(float(loss_tokens(mb["labels"])))
    k, fits = len(mbs), {}
    for kind in ("weighted", "unweighted"):
        w = tokens if kind == "weighted" else [1.0] * k
        xs, ys = [], []
        for j in range(1, k + 1):
            mean = sum(wi * gi for wi, gi in zip(w[:j], grads[:j], strict=True)) / sum(w[:j])
            ys.append(float(mean.square().sum()))
            xs.append(1.0 / (b * sum(w[:j]) / (sum(w) / k)))
        slope, intercept = np.polyfit(xs, ys, 1)
        fits[kind] = {"g2": float(intercept), "trace": float(slope)}
    fits["tokens"] = tokens
    return fits


def _own_gradient(model, mb) -> tuple[torch.Tensor, float]:
    """A micro-batch's own mean-token gradient (outside DDP: nothing reaches .grad) and the
    label positions its loss averages over."""
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.autograd.grad(model(**mb).loss, params)
    return torch.cat([x.reshape(-1) for x in g]).double(), float(loss_tokens(mb["labels"]))


def _direct_dist(own, b: int, path: str) -> None:
    """The DDP fit's points from own gradients: rank r's |Σ_{i<=j} m_i g_i / Σ_{i<=j} m_i|² at
    B = b·k·Σ_{i<=j} m_i / Σ m_i, averaged over ranks at the mean 1/B; the global token-weighted
    mean at b·k·W. Every rank calls it (all-reduces); rank 0 writes the line's fit (and that of
    1/k weights, which the check must tell apart)."""
    from rampwatch.advisor.gns import line_estimates

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    k, fits = len(own), {}
    for kind in ("weighted", "unweighted"):
        m = [t if kind == "weighted" else 1.0 for _, t in own]
        sq, inv_b = [], []
        for j in range(1, k + 1):
            mean = sum(mi * g for mi, (g, _) in zip(m[:j], own[:j], strict=True)) / sum(m[:j])
            sq.append(float(mean.square().sum()))
            inv_b.append(sum(m) / (b * k * sum(m[:j])))
        full = sum(mi * g for mi, (g, _) in zip(m, own, strict=True))
        vec = torch.tensor([*sq, *inv_b, sum(m)], dtype=torch.float64)
        torch.distributed.all_reduce(vec)
        torch.distributed.all_reduce(full)
        points = [float(v) / world for v in vec[:k]]
        sizes = [world / float(v) for v in vec[k : 2 * k]]
        points.append(float((full / float(vec[-1])).square().sum()))
        sizes.append(b * k * world)
        g2, trace = line_estimates(sizes, points)
        fits[kind] = {"g2": float(g2), "trace": float(trace)}
    tokens = torch.tensor([t for _, t in own], dtype=torch.float64)
    gathered = [torch.zeros(k, dtype=torch.float64) for _ in range(world)]
    torch.distributed.all_gather(gathered, tokens)
    fits["rank_tokens"] = [t.tolist() for t in gathered]  # each micro-batch's, per rank
    if rank == 0:
        Path(path).write_text(json.dumps(fits))


def main(argv=None) -> int:
    a = _args(argv)
    if a.mode == "reference":
        return run_reference(a)
    try:
        return run_hf(a)
    except SystemExit as e:  # RampRestart: EXIT_RAMP on every rank
        print(f"rank {rank_world()[0]} exit {e.code}", flush=True)
        raise


if __name__ == "__main__":
    sys.exit(main())
