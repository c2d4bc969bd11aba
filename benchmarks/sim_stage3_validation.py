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
3. a table of predicted and measured ratios, the error, the load average before and after.
"""

from __future__ import annotations

import argparse
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
    """Per run: calibrate, then per configuration profile, measure and predict, so that each
    row's inputs are measured minutes apart on the shared machine."""
    from longboat import sim
    from longboat.sim import cluster as cluster_mod
    from longboat.sim.calibrate import calibrate

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for run_index in range(args.runs):
        cluster = calibrate(args.nproc, None, args.repeats)
        cluster_mod.save(cluster, out / f"cluster-{run_index}.yaml")
        for name in args.only.split(","):
            model, fields = CONFIGS[name]
            profile = sim.profile_model(model, repeats=args.profile_repeats)
            profile.save(out / f"{name}-{run_index}.profile.json")
            stage3, unsharded, prediction = _predicted(profile, cluster, fields)
            before = os.getloadavg()[0]
            systems = _bench(model, fields, args, out / f"{name}-{run_index}.bench.json")
            after = os.getloadavg()[0]
            lb3, plain = systems["longboat"], systems["longboat unsharded"]
            measured = plain["longboat_over_this"]
            rows.append(
                {
                    "config": name,
                    "run": run_index + 1,
                    "units": _units(profile, cluster, fields),
                    "load": (before, after),
                    "measured_stage3_ms": lb3["step_ms"],
                    "measured_unsharded_ms": plain["step_ms"],
                    "measured_ratio": measured,
                    "measured_ratio_p25_p75": plain["longboat_over_this_p25_p75"],
                    "predicted_stage3_ms": stage3 * 1e3,
                    "predicted_unsharded_ms": unsharded * 1e3,
                    "predicted_ratio": stage3 / unsharded,
                    "error": stage3 / unsharded / measured - 1,
                    "host_work_ms": prediction.host_overhead_s * 1e3,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    (out / "validation.json").write_text(json.dumps(rows, indent=1))
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| config | run | units | load before / after | stage 3 ms (measured / predicted) "
        "| unsharded ms (measured / predicted) | ratio measured (p25-p75) | ratio predicted "
        "| error |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        q = r["measured_ratio_p25_p75"]
        lines.append(
            f"| {r['config']} | {r['run']} | {r['units']} | {r['load'][0]:.1f} / "
            f"{r['load'][1]:.1f} | {r['measured_stage3_ms']:.1f} / {r['predicted_stage3_ms']:.1f} "
            f"| {r['measured_unsharded_ms']:.1f} / {r['predicted_unsharded_ms']:.1f} "
            f"| {r['measured_ratio']:.2f} ({q[0]:.2f}-{q[1]:.2f}) | {r['predicted_ratio']:.2f} "
            f"| {r['error'] * 100:+.1f}% |"
        )
    errors = [abs(r["error"]) for r in rows]
    summary = (
        f"\n{len(rows)} runs: median |error| of the ratio {statistics.median(errors) * 100:.1f}%, "
        f"max {max(errors) * 100:.1f}%"
    )
    return head + "\n".join(lines) + summary


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
    args = p.parse_args()
    rows = run(args)
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
