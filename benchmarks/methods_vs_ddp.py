"""Training step time of each Strategy training method against torch DDP, same ranks, same run.

    longboat emulate --nodes 2 --nproc-per-node 1 --bandwidth 1gbit -- \\
        benchmarks/methods_vs_ddp.py --rounds 5 --steps 5

Every rank builds one model per method (identical weights), wraps it with torch DDP or with
``lb.distribute`` and that method's Strategy, and then times rounds of ``--steps`` training
steps, cycling through the methods in a rotated order each round (so machine noise hits all
alike). Rank 0 prints, per method, the median step time, the median of the per-round ratios
to DDP (rounds paired in time) and the gradient bytes rank 0 sent per step, as a Markdown table
for docs/BENCHMARKS.md, with two floors measured in the same rounds: the model stepped with no
gradient exchange, and one allreduce of all its gradients alone (what the link needs).
Accuracy of the same methods: benchmarks/compression_accuracy.py.
Run plainly (no RANK in the environment) it starts ``--nproc`` local ranks itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from auto_vs_default import BATCH, WIDTHS, build  # same model (this directory)
from auto_vs_default import run_steps as time_steps
from torch import nn

NO_SYNC = "no sync (compute floor)"
LINK = "one allreduce of all gradients (link floor)"
METHODS: dict[str, dict[str, Any]] = {
    "longboat default": {},
    "fp16_allreduce": {"fp16_allreduce": True},
    "bf16 compression": {"gradient_compression": "bf16"},
    "powersgd rank 4": {
        "gradient_compression": "powersgd",
        "powersgd_configs": {"rank": 4, "start_step": 0},
    },
    "dgc 0.999": {"dgc": True, "dgc_configs": {"sparsity": [0.999], "min_numel": 1024}},
    "localsgd k=4": {"localsgd": True, "localsgd_configs": {"k_steps": 4, "begin_step": 1}},
    # bucket plans, set explicitly (the default derives them from the topology)
    "buckets 1 MB x 2": {"fuse_grad_size_in_MB": 1, "nccl_comm_num": 2},
    "buckets 8 MB x 2": {"fuse_grad_size_in_MB": 8, "nccl_comm_num": 2},
    "buckets 32 MB x 1": {"fuse_grad_size_in_MB": 32, "nccl_comm_num": 1},
}


def worker(methods: list[str], rounds: int, steps: int) -> dict[str, Any]:
    import longboat as lb

    lb.init()
    torch.set_num_threads(1)
    torch.manual_seed(1 + lb.rank())
    x, y = torch.randn(BATCH, WIDTHS[0]), torch.randint(0, 10, (BATCH,))
    runs: dict[str, tuple[Any, torch.optim.Optimizer]] = {}
    ddp_model = build()
    runs["torch DDP"] = (
        nn.parallel.DistributedDataParallel(ddp_model),
        torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9),
    )
    for name in methods:
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        runs[name] = lb.distribute(model, opt, lb.Strategy(**METHODS[name]))
    alone = build()  # the compute floor: the same steps, no gradient exchange
    runs[NO_SYNC] = (alone, torch.optim.SGD(alone.parameters(), lr=0.01, momentum=0.9))
    names = list(runs)
    for name in names:  # warm-up (and every method's own warm-up phase)
        time_steps(*runs[name], x, y, 3)
    times: dict[str, list[float]] = {n: [] for n in [*names, LINK]}
    sent: dict[str, list[float]] = {n: [] for n in [*names, LINK]}
    flat = torch.zeros(sum(p.numel() for p in alone.parameters()))
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            model, opt = runs[name]
            before = model.bytes_sent() if hasattr(model, "bytes_sent") else 0
            times[name].append(time_steps(model, opt, x, y, steps))
            if hasattr(model, "bytes_sent"):
                sent[name].append((model.bytes_sent() - before) / steps)
        dist.barrier()  # the link floor: every gradient byte in one allreduce, nothing else
        start = time.perf_counter()
        dist.all_reduce(flat)
        times[LINK].append(time.perf_counter() - start)
    return {"times": times, "sent": sent}


def report(result: dict[str, Any], rounds: int, steps: int) -> None:
    times, sent = result["times"], result["sent"]
    ddp = times["torch DDP"]
    print(f"model: MLP {WIDTHS} (6.3 M parameters), batch {BATCH} per rank, SGD momentum 0.9\n")
    print("| method | step ms (median) | ratio to DDP (median of paired rounds) | bytes/step |")
    print("|---|---|---|---|")
    for name, samples in times.items():
        ratio = statistics.median(a / b for a, b in zip(samples, ddp, strict=True))
        nbytes = f"{statistics.median(sent[name]):,.0f}" if sent[name] else "(not counted)"
        print(f"| {name} | {1e3 * statistics.median(samples):.1f} | {ratio:.3f} | {nbytes} |")
    print(f"\n{rounds} rounds x {steps} steps per method")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2, help="local ranks when not launched")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    methods = args.methods.split(",")
    if "RANK" in os.environ:  # started by a launcher: this process is one rank
        result = worker(methods, args.rounds, args.steps)
        if int(os.environ["RANK"]) == 0:
            report(result, args.rounds, args.steps)
        return
    from longboat.launch.local import launch_local

    results = launch_local(worker, (methods, args.rounds, args.steps), nproc=args.nproc)
    report(results[0], args.rounds, args.steps)


if __name__ == "__main__":
    main()
