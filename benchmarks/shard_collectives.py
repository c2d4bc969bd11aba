"""Sharding's collectives on one CPU node: shm's reduce-scatter, all-gather and allreduce
against Gloo's, on real Gloo ranks.

    python benchmarks/shard_collectives.py              # 2 ranks, 6.3 M float32 elements
    python benchmarks/shard_collectives.py --nproc 4 --numel 1000000

Each collective runs ``--repeats`` times after two warm-ups, every rank starting together (a
barrier); the median of rank 0's times is printed as a Markdown table. "shm" is what sharding
calls (`longboat.comm.algorithms.shm.ShmAllreduce`: the worker-thread hand-off included).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests._dist import run_ranks  # noqa: E402 - after the path tweak


def _median_ms(op: Callable[[], object], repeats: int) -> float:
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        op()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _rank(rank: int, world: int, numel: int, repeats: int) -> dict[str, float]:
    from longboat.comm.algorithms.shm import ShmAllreduce, ShmComm

    dist.init_process_group("gloo")
    shm = ShmAllreduce(ShmComm())
    full = torch.randn(numel // world * world)
    out, mine = torch.empty(full.numel() // world), torch.randn(full.numel() // world)
    ops: dict[str, Callable[[], object]] = {
        "shm reduce-scatter": lambda: shm.reduce_scatter(out, full).wait(),
        "gloo reduce-scatter": lambda: dist.reduce_scatter_tensor(out, full),
        "shm all-gather": lambda: shm.all_gather(full, mine).wait(),
        "gloo all-gather": lambda: dist.all_gather_into_tensor(full, mine),
        "shm allreduce": lambda: shm(full).wait(),
        "gloo allreduce": lambda: dist.all_reduce(full),
    }
    result = {name: _median_ms(op, repeats) for name, op in ops.items()}
    shm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--numel", type=int, default=6_300_000, help="float32 elements of full")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rank0 = run_ranks(_rank, args.nproc, args.numel, args.repeats, timeout=600)[0]
    mb = args.numel * 4 / 2**20
    print(f"{args.nproc} Gloo ranks, {mb:.1f} MB float32, median of {args.repeats}")
    print("| collective | ms |\n|---|---|")
    for name, ms in rank0.items():
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
