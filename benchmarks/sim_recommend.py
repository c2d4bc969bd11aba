"""Does `longboat sim --recommend` pay off? The default and the recommended Strategy measured
on `longboat emulate` (needs root).

    sudo python benchmarks/sim_recommend.py [--out DIR] [--models mlp,convnet,transformer]
        [--ppn 1,2] [--rounds 3] [--compression | --lossy] [--markdown] [--reuse]

1. calibration of this machine and the emulated link, and a profile of each model, as
   benchmarks/sim_validation.py does (shared code: benchmarks/_emulated_runs.py);
2. per model and cluster (2 nodes x ``ppn`` ranks at ``--rate``): `longboat.sim.recommend`'s
   best settings. By default only exact ones (algorithm, bucket cap, communicators: the
   gradients are sent as they are, so training gives the default's result up to summation
   order); ``--compression`` adds bf16/fp16 (the `--recommend` default), ``--lossy`` adds
   PowerSGD, DGC and local SGD;
3. ``--rounds`` paired rounds of real jobs (default Strategy = ``lb.Strategy()`` with nothing
   set, then the recommended one; each job: bench train's step loop, warm-up discarded, median
   of timed rounds); medians over the paired rounds;
4. a table: predicted and measured step times, the measured ratio default / recommended, and
   whether the recommendation won (the measured ratio above 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _emulated_runs import (
    Job,
    calibrated_links,
    job_cluster,
    predict,
    predicted_settings,
    profiles,
    run_job,
)

MODELS = ("mlp", "convnet", "transformer")
COLUMNS = (
    "model",
    "cluster",
    "default (resolved)",
    "recommended",
    "predicted ms (default / rec.)",
    "measured ms (default / rec.)",
    "measured ratio",
    "won",
)


def recommendation(
    model: str, ppn: int, rate: str, profile: Any, calibrated: dict[str, Any], level: str
) -> tuple[Job, Job]:
    """(default job, recommended job) for ``model`` on 2 nodes x ``ppn`` ranks."""
    from longboat.sim import recommend

    base = Job(f"{model}-2x{ppn}-{rate}-default", model, 2, ppn, rate, {})
    best = recommend(
        profile,
        job_cluster(base, calibrated),
        lossy=level == "lossy",
        top=1,
        show=False,
        exact=level == "exact",
    )[0]
    rec = Job(f"{model}-2x{ppn}-{rate}-recommended", model, 2, ppn, rate, dict(best.fields))
    return base, rec


def paired_rounds(base: Job, rec: Job, rounds: int, tmp: Path) -> dict[str, Any]:
    """Interleaved jobs (default, recommended, default, ...); each job's median step time and
    the settings each ran with, as rank 0 saw them."""
    times: dict[str, list[float]] = {"default": [], "recommended": []}
    ran: dict[str, str] = {}
    for _ in range(rounds):
        for key, job in (("default", base), ("recommended", rec)):
            result = run_job(job, tmp)
            times[key].append(result["median"])
            ran[key] = result["settings"]
    return {"runs_s": times, "ran": ran}


def fields_text(fields: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in fields.items()) or "(the default)"


def row_cells(r: dict[str, Any]) -> list[str]:
    """The table's cells of one result row."""
    pd, pr = r["predicted_s"]["default"] * 1e3, r["predicted_s"]["recommended"] * 1e3
    measured = r.get("measured_s")
    if measured is None:
        md_text, ratio, won = "not run", "-", "default is best"
    else:
        md, mr = measured["default"] * 1e3, measured["recommended"] * 1e3
        md_text = f"{md:.1f} / {mr:.1f}"
        ratio = f"{md / mr:.2f}x (pred. {pd / pr:.2f}x)"
        won = "yes" if md > mr else "no"
    return [
        r["model"],
        r["cluster"],
        r["default_settings"],
        fields_text(r["recommended"]),
        f"{pd:.1f} / {pr:.1f}",
        md_text,
        ratio,
        won,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sim-recommend", help="directory for calibration etc.")
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of bench models")
    parser.add_argument("--ppn", default="1,2", help="comma list of ranks per node (2 nodes)")
    parser.add_argument("--rate", default="1gbit", help="emulated link rate")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds per configuration")
    level = parser.add_mutually_exclusive_group()
    level.add_argument("--compression", action="store_true", help="also bf16/fp16 compression")
    level.add_argument("--lossy", action="store_true", help="also PowerSGD, DGC, local SGD")
    parser.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    parser.add_argument(
        "--reuse", action="store_true", help="reuse the calibration and profiles in --out"
    )
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    from longboat.tools.progress import progress

    level_name = "lossy" if args.lossy else "compression" if args.compression else "exact"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    ppns = [int(p) for p in args.ppn.split(",")]
    calibrated = calibrated_links([args.rate], out, args.reuse)
    profs = profiles(sorted(set(models)), out, args.reuse)
    rows = []
    configs = [(m, p) for m in models for p in ppns]
    with (
        tempfile.TemporaryDirectory() as tmp,
        progress("sim recommend", len(configs), last="-") as done,
    ):
        for model, ppn in configs:
            base, rec = recommendation(model, ppn, args.rate, profs[model], calibrated, level_name)
            pred = {
                "default": predict(base, profs[model], calibrated),
                "recommended": predict(rec, profs[model], calibrated),
            }
            row: dict[str, Any] = {
                "model": model,
                "cluster": f"2x{ppn} {args.rate}",
                "default_settings": predicted_settings(base, calibrated),
                "recommended": rec.strategy,
                "predicted_s": {k: p.step_s for k, p in pred.items()},
            }
            if rec.strategy:
                row |= paired_rounds(base, rec, args.rounds, Path(tmp))
                row["measured_s"] = {k: statistics.median(v) for k, v in row["runs_s"].items()}
                if row["ran"]["default"] != row["default_settings"]:
                    row["default_settings"] += f" (ran {row['ran']['default']})"
            rows.append(row)
            done(last=f"{model} 2x{ppn}")
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    title = f"longboat sim --recommend ({level_name} settings) vs the default Strategy"
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in COLUMNS[:4] + ("won",) else "right")
    for r in rows:
        table.add_row(*row_cells(r))
    console = Console()
    console.width = max(console.width, 150)
    console.print(table)
    if args.markdown:
        print("| " + " | ".join(COLUMNS) + " |\n" + "|---" * len(COLUMNS) + "|")
        for r in rows:
            print("| " + " | ".join(row_cells(r)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
