"""Every alert a run raises, raised by a real monitor on a real loop (not seeded rows), and
shown where an operator looks: a banner on the live page while it holds, a count on the Runs
page. Kinds: gradient-norm spike, non-finite gradient, a reported out-of-memory, the noise scale
not measured (accumulation 1 on one device), records the store had to drop."""

from __future__ import annotations

import torch

from rampwatch import Monitor, store
from rampwatch.store import names as M
from tests import seed


def _step(model, mon, step: int, accum: int, scale: float = 1.0) -> None:
    for _ in range(accum):
        x = torch.randn(4, 8)
        (model(x).square().mean() / accum).backward()
        if scale != 1.0:
            for p in model.parameters():
                p.grad.mul_(scale)
        mon.after_backward()
    mon.step(step, loss=1.0)
    model.zero_grad(set_to_none=True)


def test_each_alert_kind_from_a_real_run_is_a_banner_and_counted(db_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    mon = Monitor.start(
        db_path,
        name="alerting",
        config={},
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        per_device_batch=4,
        accum=2,
        seq_len=1,
    )
    for step in range(1, 31):
        _step(model, mon, step, 2)
    _step(model, mon, 31, 2, scale=1e4)  # a spike far past the median
    _step(model, mon, 32, 2, scale=float("inf"))  # non-finite gradients
    mon.report_oom(8, 32, "CUDA out of memory. Tried to allocate 2.00 GiB")
    mon.set_tier(4, 1)  # accumulation 1 on one device: one batch size per step
    for step in range(33, 36):
        _step(model, mon, step, 1)
    mon.log(35, {"val_loss": "n/a"})  # a value the store cannot keep: dropped, and counted
    mon.writer.flush()
    try:
        events = [
            (e.step, e.kind, e.message.split(":")[0]) for e in store.events(db_path, mon.run_id)
        ]
        assert events == [
            (31, M.EVENT_ALERT, "gradient-norm spike"),
            (32, M.EVENT_ALERT, "non-finite gradient"),
            (32, M.EVENT_OOM, "out of memory at per-device batch 8"),
            (33, M.EVENT_ALERT, "noise scale not measured"),
            (
                35,
                M.EVENT_ALERT,
                "1 record dropped by the writer since the last report (1 in this session)",
            ),
        ]
        at = seed.app(monkeypatch, db_path)
        assert not at.exception
        banners = " | ".join(str(w.value) for w in [*at.warning, *at.error])
        for expected in (
            "gradient-norm spike",
            "non-finite gradient",
            "out of memory at per-device batch 8",
            "noise scale not measured: accumulation 1",
            "dropped",
        ):
            assert expected in banners, (expected, banners)
        at.switch_page("views/runs.py").run()
        [table] = at.dataframe
        row = table.value.iloc[0]
        assert row["alerts"] >= 4 and row["lost records"] == 1, dict(row)
    finally:
        mon.finish()
