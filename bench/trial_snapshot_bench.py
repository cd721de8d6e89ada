"""What a ramp trial's copies of the state cost, in host memory and in files
(monitor/trial_snapshot.py): seconds to take and to restore one copy, and the peak resident set a
take adds, for a model and AdamW of a few sizes, both places interleaved in one run.

    python -m bench.trial_snapshot_bench                    # 8M and 32M parameters, 3 rounds
    python -m bench.trial_snapshot_bench --params 64 --folder /local/disk

Each size runs in a fresh process (a process's peak resident set only grows): an MLP of that
many fp32 parameters, one AdamW step (the optimizer state exists: a copy is 3 × the parameters
plus the step counts), then rounds of take + restore for each place. The peak is ru_maxrss before
and after the first take of each place, measured in its own process for each place, since the
first one's high-water mark would hide the second's. Files go to --folder (default: a temporary
folder; the file system decides the speed, a local NVMe disk being the case the rule sends them
to), and each restore reads a file the page cache still holds unless the host is short of memory:
the figure is the copy's cost, not the disk's cold read.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(params_m: int, place: str, rounds: int, folder: str) -> dict:
    import torch

    from rampwatch.monitor.trial_snapshot import Snapshot, state_bytes

    torch.manual_seed(0)
    width = 2048
    layers = max(1, round(params_m * 2**20 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    target = None if place == "memory" else Path(folder)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    takes, restores = [], []
    for i in range(rounds):
        t0 = time.perf_counter()
        snap = Snapshot.take(model, opt, folder=target)
        takes.append(time.perf_counter() - t0)
        if i == 0:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        t0 = time.perf_counter()
        snap.restore(model, opt)
        restores.append(time.perf_counter() - t0)
        snap.drop()
        del snap
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": state_bytes(model, opt),
        "take_s": statistics.median(takes),
        "restore_s": statistics.median(restores),
        "peak_added": peak,
    }


def measure(params_m: int, place: str, rounds: int, folder: str) -> dict:
    code = (
        "import json, sys; from bench.trial_snapshot_bench import child; "
        f"print(json.dumps(child({params_m}, {place!r}, {rounds}, {folder!r})))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, nargs="+", default=[8, 32], help="millions (2^20)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--folder", help="where the files go (default: a temporary folder)")
    a = ap.parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = a.folder or tmp
        print(f"# trial snapshots: {a.rounds} rounds, files in {folder}; load average {load:.2f}\n")
        print("| parameters | one copy | place | take (s) | restore (s) | GB/s take | peak added |")
        print("|---|---|---|---|---|---|---|")
        for m in a.params:
            for place in ("memory", "disk"):
                r = measure(m, place, a.rounds, folder)
                print(
                    f"| {r['params'] / 1e6:.1f}M | {r['bytes'] / 2**20:,.0f} MiB | {place} | "
                    f"{r['take_s']:.3f} | {r['restore_s']:.3f} | "
                    f"{r['bytes'] / r['take_s'] / 1e9:.2f} | {r['peak_added'] / 2**20:,.0f} MiB |"
                )
    print(f"\nload average at the end {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
