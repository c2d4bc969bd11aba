"""Validate `longboat.sim` against real jobs on `longboat emulate` (needs root).

    sudo python benchmarks/sim_validation.py [--out DIR] [--only NAME,...] [--markdown] [--reuse]

1. `longboat sim calibrate` on this machine, and with two emulated nodes at each link rate used
   (the only fitted numbers: link latency and payload efficiency, per-algorithm overhead and
   bandwidth factor, memory bandwidth, shm passes, effective cores);
2. a profile of each model (`longboat sim profile`, one thread);
3. per configuration: ``--jobs`` real jobs under `longboat emulate` (bench train's step loop:
   warm-up steps discarded, median of timed rounds; the lowest job median counts, since other
   work on a shared machine only ever adds time), and `longboat.sim.simulate` of the same
   model, nodes, ranks, link rate and Strategy;
4. a table of predicted, measured and error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _emulated_runs import Job, calibrated_links, predict, predicted_settings, profiles, run_job

CONFIGS: list[dict[str, Any]] = [
    {
        "name": "convnet-2x1-100mbit",
        "model": "convnet",
        "nodes": 2,
        "ppn": 1,
        "rate": "100mbit",
        "strategy": {},
    },
    {
        "name": "convnet-2x2-1gbit",
        "model": "convnet",
        "nodes": 2,
        "ppn": 2,
        "rate": "1gbit",
        "strategy": {},
    },
    {
        "name": "convnet-2x2-1gbit-hier",
        "model": "convnet",
        "nodes": 2,
        "ppn": 2,
        "rate": "1gbit",
        "strategy": {"allreduce_algorithm": "hierarchical"},
    },
    {
        "name": "mlp-2x1-1gbit",
        "model": "mlp",
        "nodes": 2,
        "ppn": 1,
        "rate": "1gbit",
        "strategy": {},
    },
    {
        "name": "mlp-2x1-1gbit-fp16",
        "model": "mlp",
        "nodes": 2,
        "ppn": 1,
        "rate": "1gbit",
        "strategy": {"gradient_compression": "fp16"},
    },
    {
        "name": "mlp-3x1-1gbit",
        "model": "mlp",
        "nodes": 3,
        "ppn": 1,
        "rate": "1gbit",
        "strategy": {},
    },
    {
        "name": "transformer-2x1-100mbit",
        "model": "transformer",
        "nodes": 2,
        "ppn": 1,
        "rate": "100mbit",
        "strategy": {},
    },
    {
        "name": "transformer-2x2-100mbit-hier",
        "model": "transformer",
        "nodes": 2,
        "ppn": 2,
        "rate": "100mbit",
        "strategy": {"allreduce_algorithm": "hierarchical"},
    },
    {
        "name": "transformer-2x1-100mbit-localsgd4",
        "model": "transformer",
        "nodes": 2,
        "ppn": 1,
        "rate": "100mbit",
        "strategy": {"localsgd": True, "localsgd_configs": {"k_steps": 4}},
    },
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default="sim-validation", help="directory for calibration, profiles, results"
    )
    parser.add_argument("--only", default=None, help="comma list of configuration names")
    parser.add_argument(
        "--jobs", type=int, default=2, help="jobs per configuration; the lowest median counts"
    )
    parser.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    parser.add_argument(
        "--reuse", action="store_true", help="reuse the calibration and profiles in --out"
    )
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    from longboat.tools.progress import progress

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [c for c in CONFIGS if not args.only or c["name"] in args.only.split(",")]
    calibrated = calibrated_links(sorted({c["rate"] for c in configs}), out, args.reuse)
    profs = profiles(sorted({c["model"] for c in configs}), out, args.reuse)
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        progress("sim validation", len(configs), last="-") as done,
    ):
        for c in configs:
            job = Job(**c)
            runs = [run_job(job, Path(tmp))["median"] for _ in range(args.jobs)]
            measured = min(runs)
            predicted = predict(job, profs[c["model"]], calibrated).step_s
            rows.append(
                c
                | {
                    "predicted_s": predicted,
                    "label": json.dumps(c["strategy"])
                    if c["strategy"]
                    else f"default: {predicted_settings(job, calibrated)}",
                    "measured_s": measured,
                    "runs_s": runs,
                    "error": predicted / measured - 1,
                }
            )
            done(last=c["name"])
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    table = Table(title="longboat.sim: predicted vs measured step time (longboat emulate)")
    for col in ("configuration", "strategy", "predicted ms", "measured ms", "error"):
        table.add_column(col, justify="left" if col in ("configuration", "strategy") else "right")
    for r in rows:
        table.add_row(
            r["name"],
            r["label"],
            f"{r['predicted_s'] * 1e3:.1f}",
            f"{r['measured_s'] * 1e3:.1f}",
            f"{r['error']:+.1%}",
        )
    errors = [abs(r["error"]) for r in rows]
    console = Console()
    console.width = max(console.width, 120)
    console.print(table)
    summary = f"median |error| {statistics.median(errors):.1%}, max |error| {max(errors):.1%}, within 15 %: {sum(e <= 0.15 for e in errors)}/{len(errors)}"
    console.print(summary)
    if args.markdown:
        print(
            "| configuration | strategy | predicted ms | measured ms | error |\n|---|---|---|---|---|"
        )
        for r in rows:
            print(
                f"| {r['name']} | `{r['label']}` | {r['predicted_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | {r['error']:+.1%} |"
            )
        print(f"\n{summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
