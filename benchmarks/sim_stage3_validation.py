"""Validate `longboat sim`'s sharding stage 3 (FSDP2) on CPU ranks against `longboat bench
train`: the step ratio stage 3 / unsharded, predicted and measured, on 2 local Gloo ranks.

    python benchmarks/sim_stage3_validation.py --out /tmp/s3val --markdown

``--runs`` times:

1. `longboat sim calibrate` on this machine (``--nproc`` ranks): links, memory, the backend's
   all-gather and reduce-scatter, FSDP2's host work (`longboat.sim.calibrate_fsdp`);
2. per configuration, a profile of its model (`longboat sim profile`, one thread) and
   `longboat bench train` at stage 3, which times stage 3,
   unsharded longboat and the other systems in alternating rounds; the measured ratio is the
   median of the round-by-round ratios (with their quartiles), and `longboat.sim.simulate`
   predicts both steps on the calibrated cluster;
3. a table of predicted and measured ratios, the error, the load average before and after,
   and the ratio predicted without the stage 3 calibration (the cluster's ``collectives`` and
   ``fsdp2`` entries dropped) for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # one 24 MB unit: the collectives' bandwidth dominates
    "mlp": ("mlp", {"sharding_configs": {"stage": 3}}),
    # each encoder layer a unit, the embedding and head in the root: many small units
    "transformer": (
        "transformer",
        {"sharding_configs": {"stage": 3, "units": ["TransformerEncoderLayer"]}},
    ),
    # a 0.25 MB cap: four units of convolutions and the root, compute-heavy
    "convnet": ("convnet", {"sharding_configs": {"stage": 3}, "fuse_grad_size_in_MB": 0.25}),
}


def _bench(model: str, fields: dict[str, Any], args: argparse.Namespace, out: Path) -> dict:
    """One bench train run at stage 3; its JSON rows by system."""
    cmd = [
        sys.executable, "-m", "longboat", "bench", "train", "--model", model, "--nproc",
        str(args.nproc), "--rounds", str(args.rounds), "--steps", str(args.steps),
        "--set", "sharding=true", "--json", str(out),
    ]  # fmt: skip
    for key, value in fields.items():
        cmd += ["--set", f"{key}={json.dumps(value)}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = json.loads(out.read_text())["results"][model]
    return {r["system"]: r for r in rows if r["nproc"] == args.nproc}


def _predicted(profile: Any, cluster: Any, fields: dict[str, Any]) -> tuple[float, float, Any]:
    """(stage 3 step, unsharded step, stage 3 prediction) on ``cluster``."""
    import longboat as lb
    from longboat import sim

    sharded = sim.simulate(profile, cluster, lb.Strategy(sharding=True, **fields))
    plain = {k: v for k, v in fields.items() if k not in ("sharding", "sharding_configs")}
    unsharded = sim.simulate(profile, cluster, lb.Strategy(**plain))
    return sharded.step_s, unsharded.step_s, sharded


def _units(profile: Any, cluster: Any, fields: dict[str, Any]) -> str:
    """The stage 3 units, as '4 + root' (the root when it holds parameters)."""
    import longboat as lb
    from longboat.sim.predict import collective_plan
    from longboat.sim.stage3 import stage3

    plan = collective_plan(lb.Strategy(sharding=True, **fields), cluster)
    step = stage3(profile, cluster, plan)
    return f"{len(step.units)}" + (" + root" if step.root.numel else "")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per run: calibrate, then per configuration profile and measure, so that each row's
    inputs are measured minutes apart on the shared machine; every input is kept in
    ``--out`` and `evaluate` predicts from them."""
    from longboat import sim
    from longboat.sim import cluster as cluster_mod
    from longboat.sim.calibrate import calibrate

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for run_index in range(args.runs):
        cluster_mod.save(
            calibrate(args.nproc, None, args.repeats), out / f"cluster-{run_index}.yaml"
        )
        for name in args.only.split(","):
            model, fields = CONFIGS[name]
            sim.profile_model(model, repeats=args.profile_repeats).save(
                out / f"{name}-{run_index}.profile.json"
            )
            before = os.getloadavg()[0]
            _bench(model, fields, args, out / f"{name}-{run_index}.bench.json")
            load = {"before": before, "after": os.getloadavg()[0]}
            (out / f"{name}-{run_index}.load.json").write_text(json.dumps(load))
            print(json.dumps(evaluate(out, name, run_index, args.nproc)), flush=True)
    return evaluate_all(out, args.nproc)


def evaluate_all(out: Path, nproc: int) -> list[dict[str, Any]]:
    """`evaluate` of every run kept in ``out``; written to ``validation.json``."""
    rows = [
        evaluate(out, name, int(path.name.split("-")[-1].split(".")[0]), nproc)
        for name in CONFIGS
        for path in sorted(out.glob(f"{name}-*.bench.json"))
    ]
    rows.sort(key=lambda r: (r["run"], list(CONFIGS).index(r["config"])))
    (out / "validation.json").write_text(json.dumps(rows, indent=1))
    return rows


def evaluate(out: Path, name: str, run_index: int, nproc: int) -> dict[str, Any]:
    """One row: the measured ratio of a kept bench train run, and the ratios predicted from
    the run's calibration: from the profile as measured (what a user gets), from its compute
    scaled to the no-sync system of the same rounds (the stage 3 model alone, beside the load
    the profile met), and without the stage 3 calibration."""
    from longboat import sim
    from longboat.sim import cluster as cluster_mod

    model, fields = CONFIGS[name]
    cluster = cluster_mod.load(out / f"cluster-{run_index}.yaml")
    profile = sim.load_profile(out / f"{name}-{run_index}.profile.json")
    rows = json.loads((out / f"{name}-{run_index}.bench.json").read_text())["results"][model]
    systems = {r["system"]: r for r in rows if r["nproc"] == nproc}
    load = json.loads((out / f"{name}-{run_index}.load.json").read_text())
    lb3, plain = systems["longboat"], systems["longboat unsharded"]
    floor_ms = lb3["step_ms"] / lb3["longboat_over_no_sync"]  # the no-sync system's step
    measured = plain["longboat_over_this"]
    stage3, unsharded, prediction = _predicted(profile, cluster, fields)
    bare = dataclasses.replace(cluster, collectives={}, fsdp2=None)
    uncorrected, _, _ = _predicted(profile, bare, fields)
    # the no-sync floor already shares the host between the ranks: no further sharing factor
    rounds = profile.scaled(floor_ms / 1e3 / (profile.compute_s + profile.optimizer_s))
    alone = dataclasses.replace(cluster, shared_host_cores=0.0)
    stage3_r, unsharded_r, _ = _predicted(rounds, alone, fields)
    return {
        "config": name,
        "run": run_index + 1,
        "units": _units(profile, cluster, fields),
        "load": (load["before"], load["after"]),
        "measured_stage3_ms": lb3["step_ms"],
        "measured_unsharded_ms": plain["step_ms"],
        "measured_no_sync_ms": floor_ms,
        "measured_ratio": measured,
        "measured_ratio_p25_p75": plain["longboat_over_this_p25_p75"],
        "predicted_stage3_ms": stage3 * 1e3,
        "predicted_unsharded_ms": unsharded * 1e3,
        "predicted_ratio": stage3 / unsharded,
        "error": stage3 / unsharded / measured - 1,
        "predicted_ratio_rounds": stage3_r / unsharded_r,
        "error_rounds": stage3_r / unsharded_r / measured - 1,
        "predicted_ratio_uncorrected": uncorrected / unsharded,
        "host_work_ms": prediction.host_overhead_s * 1e3,
    }


def components(args: argparse.Namespace) -> str:
    """The measured cost components (what `longboat sim calibrate` fits for stage 3) as
    Markdown: the collectives per size beside Gloo's allreduce, FSDP2's host work per shape
    and the fitted coefficients."""
    from longboat.sim import calibrate_fsdp
    from longboat.sim.calibrate import local_cluster, measure_local

    load = os.getloadavg()[0]
    local = local_cluster(measure_local(args.nproc, args.repeats))
    report = calibrate_fsdp.measure(args.nproc, args.repeats)
    fitted = calibrate_fsdp.with_fsdp2(local, report)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "components.json").write_text(json.dumps(report, indent=1))
    lines = [
        f"load average {load:.1f} before / {os.getloadavg()[0]:.1f} after",
        "",
        "| size | all_gather_into_tensor ms | reduce_scatter_tensor ms | all_reduce ms "
        "| reduce-scatter / allreduce | all-gather / allreduce |",
        "|---|---|---|---|---|---|",
    ]
    for size, ar in report["all_reduce"].items():
        ag, rs = report["all_gather"][size], report["reduce_scatter"][size]
        lines.append(
            f"| {int(size) / 2**20:g} MB | {ag * 1e3:.2f} | {rs * 1e3:.2f} | {ar * 1e3:.2f} "
            f"| {rs / ar:.2f} | {ag / ar:.2f} |"
        )
    lines += ["", "| units x layers, width | FSDP2 step - plain step ms |", "|---|---|"]
    for shape in report["fsdp2"]:
        lines.append(
            f"| {shape['units']} x {shape['layers']}, {shape['width']} "
            f"| {shape['extra_s'] * 1e3:.2f} |"
        )
    host = fitted.fsdp2
    assert host is not None
    c = fitted.collectives
    lines += [
        "",
        f"fitted: all-gather bandwidth x {c['all_gather'].bandwidth_efficiency:.3f} "
        f"+{c['all_gather'].overhead * 1e6:.0f} us, reduce-scatter bandwidth x "
        f"{c['reduce_scatter'].bandwidth_efficiency:.3f} +{c['reduce_scatter'].overhead * 1e6:.0f}"
        f" us; FSDP2 host work {host.step_overhead * 1e3:.2f} ms per step + "
        f"{host.unit_overhead * 1e3:.2f} ms per unit + {host.param_overhead * 1e6:.0f} us per "
        f"parameter tensor + {host.byte_overhead * 2**20 * 1e3:.2f} ms per MB the collectives move",
    ]
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| config | run | units | load before / after | stage 3 ms (measured / predicted) "
        "| unsharded ms (measured / predicted) | ratio measured (p25-p75) "
        "| predicted from the profile | compute from the same rounds "
        "| without the stage 3 calibration |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )

    def pct(value: float) -> str:
        return f"{value * 100:+.1f}%"

    lines = []
    for r in rows:
        q, m = r["measured_ratio_p25_p75"], r["measured_ratio"]
        lines.append(
            f"| {r['config']} | {r['run']} | {r['units']} | {r['load'][0]:.1f} / "
            f"{r['load'][1]:.1f} | {r['measured_stage3_ms']:.1f} / {r['predicted_stage3_ms']:.1f} "
            f"| {r['measured_unsharded_ms']:.1f} / {r['predicted_unsharded_ms']:.1f} "
            f"| {m:.2f} ({q[0]:.2f}-{q[1]:.2f}) | {r['predicted_ratio']:.2f} ({pct(r['error'])}) "
            f"| {r['predicted_ratio_rounds']:.2f} ({pct(r['error_rounds'])}) "
            f"| {r['predicted_ratio_uncorrected']:.2f} "
            f"({pct(r['predicted_ratio_uncorrected'] / m - 1)}) |"
        )

    def summary(label: str, errors: list[float]) -> str:
        errors = [abs(e) for e in errors]
        return (
            f"{label}: median |error| {statistics.median(errors) * 100:.1f}%, "
            f"max {max(errors) * 100:.1f}%"
        )

    summaries = [
        summary("predicted from the profile", [r["error"] for r in rows]),
        summary("compute from the same rounds", [r["error_rounds"] for r in rows]),
        summary(
            "without the stage 3 calibration",
            [r["predicted_ratio_uncorrected"] / r["measured_ratio"] - 1 for r in rows],
        ),
    ]
    return head + "\n".join(lines) + f"\n\n{len(rows)} runs; " + "; ".join(summaries)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/sim_stage3_validation")
    p.add_argument("--only", default=",".join(CONFIGS), help="comma list of configurations")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--runs", type=int, default=2, help="bench train runs per configuration")
    p.add_argument("--repeats", type=int, default=7, help="calibration repeats per size")
    p.add_argument("--profile-repeats", type=int, default=20, help="timed profile steps")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--recompute", metavar="DIR", help="predict again from the runs kept in DIR")
    p.add_argument(
        "--components", action="store_true", help="only measure and print the cost components"
    )
    args = p.parse_args()
    if args.recompute:
        print(markdown(evaluate_all(Path(args.recompute), args.nproc)))
        return
    if args.components:
        print(components(args))
        return
    rows = run(args)
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
