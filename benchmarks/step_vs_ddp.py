"""One training step: longboat vs torch DDP, same model, same ranks, same run.

    python benchmarks/step_vs_ddp.py --nproc 2 --rounds 7 --steps 20
    torchrun --nproc-per-node 2 benchmarks/step_vs_ddp.py ...  # ranks of a launcher

A thin caller of `longboat bench train` (``longboat.tools.bench.train``): each rank builds two
identical models, one under ``lb.distribute``, one under DDP and one stepped alone with no
gradient exchange (the compute floor no allreduce can beat), and alternates timed rounds
between them. Prints the median step time of longboat and DDP, the median (and quartiles) of
the per-round ratio longboat/DDP and the floor's ratio to DDP as a Markdown table for
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os

from longboat.tools.bench import train

# the table's historical names -> bench train's models
MODELS = {
    "mlp-6M": "mlp",
    "mlp-0.3M": "mlp-0.3M",
    "convnet-0.3M": "convnet",
    "transformer": "transformer",
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a Strategy field for longboat's side (YAML value), repeatable",
    )
    args = parser.parse_args()
    fields = train.strategy_fields(None, args.set)
    leader = int(os.environ.get("RANK", "0")) == 0  # under a launcher (torchrun), rank 0 prints
    if leader:
        print(
            "| model | params | longboat step ms (median) | DDP step ms (median) "
            "| longboat/DDP (median of paired rounds) | p25-p75 of paired ratios "
            "| no-sync floor/DDP | rounds x steps |"
        )
        print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        config = train.Config(MODELS[name], 3, args.steps, args.rounds, "memory", 0, fields)
        rows = train.run_model(config, [args.nproc])
        if not leader:
            continue
        ours, ddp = rows
        q1, q3 = ours["longboat_over_ddp_p25_p75"]
        print(
            f"| {name} | {ours['params'] / 1e6:.2f} M | {ours['step_ms']:.2f} | "
            f"{ddp['step_ms']:.2f} | {ours['longboat_over_ddp']:.3f} | {q1:.3f}-{q3:.3f} | "
            f"{ours['no_sync_over_ddp']:.3f} | {args.rounds} x {args.steps} |"
        )


if __name__ == "__main__":
    main()
