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
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

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
WARMUP, STEPS, ROUNDS = 4, 4, 7


def worker(out: str, model: str, fields_json: str) -> None:
    """One rank of a measured job: bench train's loop on longboat only."""
    import torch

    import longboat as lb
    from longboat.tools.bench.train import MODELS, Config, _batches, _round

    lb.init()
    torch.set_num_threads(1)
    fields = json.loads(fields_json)
    spec = MODELS[model]
    net = spec.build()
    net, opt = lb.distribute(
        net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), lb.Strategy(**fields)
    )
    config = Config(model, WARMUP, STEPS, ROUNDS, "memory", 0, fields)
    batches = _batches(spec, config, lb.rank())
    _round(net, opt, batches, WARMUP)
    rounds = [_round(net, opt, batches, STEPS)[0] for _ in range(ROUNDS)]
    if lb.rank() == 0:
        Path(out).write_text(json.dumps({"rounds": rounds, "median": statistics.median(rounds)}))


def measure(config: dict[str, Any], tmp: Path) -> float:
    out = tmp / f"{config['name']}.json"
    cmd = [
        sys.executable, "-m", "longboat", "emulate", "--nodes", str(config["nodes"]),
        "--nproc-per-node", str(config["ppn"]), "--bandwidth", config["rate"], "--timeout", "600",
        "--log-dir", str(tmp / "logs" / config["name"]), __file__, "rank-worker", str(out),
        config["model"], json.dumps(config["strategy"]),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode or not out.exists():
        raise RuntimeError(
            f"{config['name']}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    return float(json.loads(out.read_text())["median"])


def predict(config: dict[str, Any], profile: Any, calibrated: Any) -> float:
    """The calibrated cluster of the configuration's link rate, cut to its nodes and ranks."""
    from longboat.sim import simulate
    from longboat.strategy import Strategy

    cluster = dataclasses.replace(
        calibrated[config["rate"]], nodes=config["nodes"], devices_per_node=config["ppn"]
    )
    return simulate(profile, cluster, Strategy(**config["strategy"])).step_s


def calibrated_links(rates: list[str], out: Path, reuse: bool) -> dict[str, Any]:
    """`longboat sim calibrate --emulate RATE` for each rate (files cached in ``out``)."""
    from longboat.sim import cluster
    from longboat.sim.calibrate import (
        local_cluster,
        measure_emulated,
        measure_local,
        with_emulated_link,
    )

    paths = {rate: out / f"calibrated-{rate}.yaml" for rate in rates}
    if reuse and all(p.exists() for p in paths.values()):
        return {rate: cluster.load(p) for rate, p in paths.items()}
    local = local_cluster(measure_local(2, 7))
    result = {}
    for rate in rates:
        result[rate] = with_emulated_link(local, measure_emulated(rate, 7), rate)
        cluster.save(result[rate], paths[rate])
    return result


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "rank-worker":
        worker(*sys.argv[2:5])
        return 0
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

    from longboat.sim import load_profile, profile_model
    from longboat.tools.progress import progress

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [c for c in CONFIGS if not args.only or c["name"] in args.only.split(",")]
    calibrated = calibrated_links(sorted({c["rate"] for c in configs}), out, args.reuse)
    profiles = {}
    for model in sorted({c["model"] for c in configs}):
        path = out / f"profile-{model}.json"
        if args.reuse and path.exists():
            profiles[model] = load_profile(path)
            continue
        profiles[model] = profile_model(model, repeats=10, warmup=3)
        profiles[model].save(path)
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        progress("sim validation", len(configs), last="-") as done,
    ):
        for c in configs:
            runs = [measure(c, Path(tmp)) for _ in range(args.jobs)]
            measured = min(runs)
            predicted = predict(c, profiles[c["model"]], calibrated)
            rows.append(
                c
                | {
                    "predicted_s": predicted,
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
            json.dumps(r["strategy"]) if r["strategy"] else "default",
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
            strategy = json.dumps(r["strategy"]) if r["strategy"] else "default"
            print(
                f"| {r['name']} | `{strategy}` | {r['predicted_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | {r['error']:+.1%} |"
            )
        print(f"\n{summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
