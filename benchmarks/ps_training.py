"""Training throughput: 2 trainers + 2 parameter servers vs one local trainer, same run.

    python benchmarks/ps_training.py --steps 30 --batch 64

The model is a small CNN on 3x32x32 inputs, where compute dominates communication (0.26 M
parameters, about 0.4 GFLOP per sample forward+backward). The local trainer runs the global
batch in one process with one thread; each PS trainer runs half of it with one thread through
``longboat launch --servers 2 --workers 2`` (sync mode, momentum SGD on the servers), once
with pushes started from backward hooks (overlap) and once after backward. Reported: median
step time over the timed steps, samples/s, and the ratio to the local trainer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

WARMUP = 3


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(128, 10),
    )  # fmt: skip


def step_times(model: nn.Module, opt: object, steps: int, batch: int) -> list[float]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    times = []
    for _ in range(WARMUP + steps):
        t0 = time.perf_counter()
        opt.zero_grad()  # type: ignore[attr-defined]
        F.cross_entropy(model(x), y).backward()
        opt.step()  # type: ignore[attr-defined]
        times.append(time.perf_counter() - t0)
    return times[WARMUP:]


def rank_main(out: str, steps: int, batch: int, overlap: bool) -> None:
    """One rank under `longboat launch --servers 2 --workers 2`."""
    import longboat as lb
    from longboat.ps.trainer.engine import cluster_from_env

    if lb.is_server():
        lb.ps.run_server()
        return
    torch.set_num_threads(1)
    _, trainer, trainers = cluster_from_env()
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    m, opt = lb.ps.distribute(model, opt, lb.Strategy(mode="ps", a_sync=False), overlap=overlap)
    times = step_times(m, opt, steps, batch // trainers)
    m.engine.close()
    if trainer == 0:
        Path(out).write_text(json.dumps(times))


def run_ps(steps: int, batch: int, overlap: bool) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "times.json")
        cmd = [sys.executable, "-m", "longboat", "launch", "--servers", "2", "--workers", "2",
               "--log-dir", str(Path(tmp, "log")), __file__, "--rank", str(out), "--steps",
               str(steps), "--batch", str(batch)] + (["--overlap"] if overlap else [])  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0 or not out.exists():
            logs = "".join(p.read_text() for p in Path(tmp, "log").glob("*") if p.is_file())
            raise RuntimeError(f"PS run failed:\n{done.stdout}{done.stderr}{logs}")
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--rank", help=argparse.SUPPRESS)
    p.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank:
        rank_main(a.rank, a.steps, a.batch, a.overlap)
        return
    torch.set_num_threads(1)
    model = build_model()
    local = step_times(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                       a.steps, a.batch)  # fmt: skip
    rows = [("1 local trainer", local)]
    rows.append(("2 trainers + 2 servers, overlap", run_ps(a.steps, a.batch, True)))
    rows.append(("2 trainers + 2 servers, no overlap", run_ps(a.steps, a.batch, False)))
    base = statistics.median(local)
    print(f"global batch {a.batch}, {a.steps} timed steps, 1 thread per process")
    print(f"{'setup':<36} {'step ms':>8} {'samples/s':>10} {'vs local':>9}")
    for name, times in rows:
        med = statistics.median(times)
        print(f"{name:<36} {med * 1e3:>8.1f} {a.batch / med:>10.1f} {base / med:>8.2f}x")


if __name__ == "__main__":
    main()
