"""Memory per rank under sharding (ZeRO stage 1 and 2) vs without, vs DDP + ZeroRedundancyOptimizer.

    python benchmarks/sharding_memory.py                 # 2 Gloo ranks on the CPU
    python benchmarks/sharding_memory.py --algorithm topology --width 512   # shm on the CPU
    python benchmarks/sharding_memory.py --device cuda   # one GPU, 4 virtual ranks

Each configuration trains an MLP with Adam for a few steps, then reports this rank's optimizer
state, gradient and parameter bytes by tensor storage (`longboat.tools.bench.train_memory`,
as ``longboat bench train`` counts them with sharding on), the median step time and, on a GPU,
``torch.cuda.memory_allocated`` after the step and its peak during one. On the CPU the ranks
are real Gloo ranks (DDP + ``ZeroRedundancyOptimizer`` runs beside longboat), and "shm MB" is
the bytes of the run's shared-memory segments this rank maps (the allreduce's under
``--algorithm topology``, the shard groups'; `longboat.comm.shm_segment.mapped_segments`); on
one GPU the ranks are the lagging test backend's virtual ranks (``tests/_lagging_backend.py``),
whose collectives have NCCL's stream semantics but whose values do not model distinct ranks:
there the numbers measure memory only, not training. Prints a Markdown table for
docs/sharding.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests._dist import run_ranks  # noqa: E402 - after the path tweak

MB = 1024 * 1024
SYSTEMS = ("longboat", "stage 1", "stage 2", "DDP + ZeroRedundancyOptimizer")


def _model(width: int, depth: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)).to(device)


def _measure(system: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    import longboat as lb
    from longboat.comm.shm_segment import mapped_segments
    from longboat.sharding.zero.memory import storage_bytes
    from longboat.tools.bench.train_memory import held_bytes

    earlier = set(mapped_segments())  # an earlier system's segments stay mapped
    model = _model(args.width, args.depth, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if system.startswith("DDP"):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4
        )
        run = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = optimizer
    else:
        strategy = lb.Strategy(
            fuse_grad_size_in_MB=args.bucket_mb, allreduce_algorithm=args.algorithm
        )
        if system.startswith("stage"):
            strategy.sharding = True
            strategy.sharding_configs = {"stage": int(system[-1])}
        run, opt = lb.distribute(model, optimizer, strategy)
    x = torch.randn(args.batch, args.width, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    times, peak = [], 0
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(run(x), y).backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(device)
        times.append(time.perf_counter() - start)
    state, grads, _ = held_bytes(run, opt)
    mapped = mapped_segments()
    row = {
        "shm": sum(mapped[n] for n in set(mapped) - earlier),
        "state": state,
        "grads": grads,
        "params": storage_bytes(list(model.parameters())),
        "allocated": torch.cuda.memory_allocated(device) if device.type == "cuda" else None,
    }
    if not system.startswith("DDP"):
        run.reducer.remove_hooks()
    row["step_ms"] = statistics.median(times[1:]) * 1e3
    row["peak"] = peak if device.type == "cuda" else None
    return row


def _cpu_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import longboat as lb

    lb.init(backend="gloo")
    return {s: _measure(s, args, torch.device("cpu")) for s in SYSTEMS}


def _virtual_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from tests import _lagging_harness as harness

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    with harness.virtual_world(device):
        return {s: _measure(s, args, device) for s in SYSTEMS[:3]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--virtual", action="store_true", help="4 virtual ranks in one process (cuda implies it)"
    )
    parser.add_argument("--nproc", type=int, default=2, help="Gloo ranks on the CPU")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument(
        "--algorithm",
        default="native",
        help="longboat's allreduce_algorithm ('topology': shared memory on one CPU node)",
    )
    args = parser.parse_args()
    if args.device == "cpu" and not args.virtual:
        (rows, *_) = run_ranks(_cpu_rank, args.nproc, args, timeout=600)
        ranks = f"{args.nproc} Gloo ranks"
    else:
        (rows,) = run_ranks(_virtual_rank, 1, args, timeout=600)
        ranks = f"4 virtual ranks on one {'GPU' if args.device == 'cuda' else 'CPU'}"
    params = sum(
        p.numel() for p in _model(args.width, args.depth, torch.device("cpu")).parameters()
    )
    print(
        f"MLP {args.depth}x{args.width}, {params / 1e6:.1f}M float32 parameters, Adam, {ranks}, "
        f"allreduce_algorithm={args.algorithm!r}"
    )
    gpu, cpu = args.device == "cuda", ranks.endswith("Gloo ranks")
    head = "| system | optimizer state MB | gradients MB | parameters MB | step ms |"
    print(head + (" allocated MB | peak MB |" if gpu else "") + (" shm MB |" if cpu else ""))
    print("|---" * (5 + 2 * gpu + cpu) + "|")
    for system, r in rows.items():
        line = (
            f"| {system} | {r['state'] / MB:.1f} | {r['grads'] / MB:.1f} | "
            f"{r['params'] / MB:.1f} | {r['step_ms']:.1f} |"
        )
        if gpu:
            line += f" {r['allocated'] / MB:.1f} | {r['peak'] / MB:.1f} |"
        if cpu:
            line += f" {r['shm'] / MB:.1f} |"
        print(line)


if __name__ == "__main__":
    main()
