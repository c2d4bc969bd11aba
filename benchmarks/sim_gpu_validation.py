"""Validate `longboat sim` against published multi-GPU throughput (NVIDIA DeepLearningExamples).

    python benchmarks/sim_gpu_validation.py [--markdown] [--only SUBSTRING] [--json OUT]

For every table of benchmarks/sim_gpu_published.yaml: the model's profile from its
architecture (benchmarks/sim_gpu_models.py), the system as a cluster description, the run's
communication as a Strategy, its data loader where it has one; the table's 1-GPU row
calibrates the compute efficiency (`longboat.sim.fit`), every other row is predicted with nothing
else fitted and compared with the published throughput. A row marked ``held_out`` is where a
default of the model comes from: it is shown, not counted. A pure computation: no GPU, no timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sim_gpu_models as models  # noqa: E402

DATA = HERE / "sim_gpu_published.yaml"
TOKENS = {"transformer-xl-base": 192, "transformer-xl-large": 384}


@dataclasses.dataclass(frozen=True)
class Row:
    table: str
    model: str
    system: str
    precision: str
    batch: int
    gpus: int
    accumulation: int
    published: float
    predicted: float
    unit: str
    published_efficiency: float
    predicted_efficiency: float
    calibration: bool  # the 1-GPU row the compute efficiency was fitted to
    held_out: bool = False  # a row a default of the model comes from (not a prediction)

    @property
    def predicts(self) -> bool:
        return not (self.calibration or self.held_out)

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1


def load(path: Path = DATA) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def profile_of(table: dict[str, Any]) -> Any:
    model, batch, dtype = table["model"], table["batch"], table["grads"]
    if model == "resnet50":
        return models.resnet50(batch, dtype)
    if model.startswith("bert-large-"):
        return models.bert_large(batch, table["seq"], model.removeprefix("bert-large-"), dtype)
    if model.startswith("transformer-xl-"):
        return models.transformer_xl(model.removeprefix("transformer-xl-"), batch, dtype)
    raise ValueError(f"unknown model {model!r}")


def cluster_of(data: dict[str, Any], table: dict[str, Any], gpus: int) -> Any:
    from longboat.sim import cluster_from_dict

    system = dict(data["systems"][table["system"]])
    per = system["devices_per_node"]
    compute = {
        "precision": "tf32" if table["precision"] == "tf32" else "fp32",
        "optimizer_bytes_per_param": table["optimizer_bytes_per_param"],
    }
    extra = {"input": table["input"]} if "input" in table else {}
    cluster = cluster_from_dict(system | extra | {"nodes": max(1, gpus // per), "compute": compute})
    return cluster.with_devices(gpus)


def strategy_of(table: dict[str, Any], accumulation: int) -> Any:
    from longboat.strategy import Strategy

    fields = dict(table["strategy"]) | {"amp": table["precision"] == "amp"}
    if accumulation > 1:
        fields |= {"gradient_merge": True, "gradient_merge_configs": {"k_steps": accumulation}}
    return Strategy(**fields)


def _rows(table: dict[str, Any]) -> list[tuple[int, float, int]]:
    return [(int(r[0]), float(r[1]), int(r[2]) if len(r) > 2 else 1) for r in table["rows"]]


def excluded(data: dict[str, Any] | None = None) -> dict[str, str]:
    """Tables left out of the validation, with the reason."""
    data = data or load()
    return {t["name"]: " ".join(t["excluded"].split()) for t in data["tables"] if "excluded" in t}


def known_misses(data: dict[str, Any] | None = None) -> dict[tuple[str, int], str]:
    """(table, GPUs) -> why the model misses that row by more than 10 %."""
    data = data or load()
    return {
        (m["table"], gpus): " ".join(m["why"].split())
        for m in data.get("known_misses", [])
        for gpus in m["gpus"]
    }


def validate(data: dict[str, Any] | None = None, only: str = "") -> list[Row]:
    """Every row of every table (``only``: tables whose name contains it)."""
    from longboat.sim import simulate
    from longboat.sim.fit import calibrated

    data = data or load()
    by_name = {t["name"]: t for t in data["tables"]}
    out = []
    for table in data["tables"]:
        if (only and only not in table["name"]) or "excluded" in table:
            continue
        per_sample = TOKENS.get(table["model"], 1)
        prof = profile_of(table)
        ref = by_name[table.get("calibrate_with", table["name"])]
        gpus1, value1, k1 = next(r for r in _rows(ref) if r[0] == 1)
        held = table.get("held_out", {}).get("gpus")
        step1 = table["batch"] * per_sample / value1
        base = calibrated(prof, cluster_of(data, table, 1), step1, strategy_of(table, k1))
        for gpus, value, k in _rows(table):
            cluster = dataclasses.replace(
                cluster_of(data, table, gpus), compute_efficiency=base.compute_efficiency
            )
            p = simulate(prof, cluster, strategy_of(table, k))
            predicted = p.samples_per_s * per_sample
            out.append(
                Row(
                    table=table["name"],
                    model=table["model"],
                    system=table["system"],
                    precision=table["precision"],
                    batch=table["batch"],
                    gpus=gpus,
                    accumulation=k,
                    published=value,
                    predicted=predicted,
                    unit=table["unit"],
                    published_efficiency=value / (gpus * value1),
                    predicted_efficiency=predicted / (gpus * value1),
                    calibration=table is ref and gpus == 1,
                    held_out=gpus == held,
                )
            )
    return out


def summary(rows: list[Row]) -> dict[str, float]:
    errors = [abs(r.error) for r in rows if r.predicts]
    return {
        "rows": len(errors),
        "median": statistics.median(errors),
        "max": max(errors),
        "within_10": sum(e <= 0.10 for e in errors),
    }


def sources_markdown(data: dict[str, Any] | None = None) -> str:
    """One line per table: where its numbers come from and the inputs of its prediction."""
    data = data or load()
    src = data["source"]
    lines = [
        f"Source: {src['repository']} at commit `{src['commit']}`.",
        "",
        "| table | README, section, column | system | precision, batch/GPU, gradients | "
        "communication |",
        "|---|---|---|---|---|",
    ]
    kinds = {id(v): k for k, v in data["strategies"].items()}
    for t in data["tables"]:
        comm = kinds.get(id(t["strategy"]), "custom")
        lines.append(
            f"| {t['name']} | `{t['path']}`, {t['section']}, {t['column']} | {t['system']} | "
            f"{t['precision']}, {t['batch']}, {t['grads']} | {comm} |"
        )
    return "\n".join(lines)


def markdown(rows: list[Row]) -> str:
    misses = known_misses()
    lines = [
        "| table | GPUs | accum. | published | predicted | error | efficiency published / predicted |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        error = "(calibration)" if r.calibration else f"{r.error:+.1%}"
        if r.held_out:
            error += " (held out)"
        if (r.table, r.gpus) in misses:
            error += " (miss)"
        lines.append(
            f"| {r.table} | {r.gpus} | {r.accumulation} | {r.published:,.1f} {r.unit} | "
            f"{r.predicted:,.1f} | {error} | {r.published_efficiency:.1%} / "
            f"{r.predicted_efficiency:.1%} |"
        )
    s = summary(rows)
    lines.append(
        f"\n{s['rows']} predicted rows: median |error| {s['median']:.1%}, max {s['max']:.1%}, "
        f"within 10 %: {s['within_10']}/{s['rows']}"
    )
    for t in load()["tables"]:
        if "held_out" in t:
            why = " ".join(str(t["held_out"]["why"]).split())
            lines.append(f"\nHeld out: {t['name']}, {t['held_out']['gpus']} GPUs: {why}")
    for name, why in excluded().items():
        lines.append(f"\nExcluded: {name}: {why}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--only", default="", help="tables whose name contains this")
    parser.add_argument("--json", default=None, help="write the rows as JSON")
    args = parser.parse_args()
    rows = validate(only=args.only)
    if args.json:
        Path(args.json).write_text(
            json.dumps([dataclasses.asdict(r) | {"error": r.error} for r in rows], indent=1)
        )
    if args.markdown:
        print(sources_markdown())
        print()
        print(markdown(rows))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="longboat sim vs published multi-GPU throughput")
    for col in ("table", "GPUs", "accum.", "published", "predicted", "error", "eff. pub/pred"):
        table.add_column(col, justify="left" if col == "table" else "right")
    for r in rows:
        table.add_row(
            r.table,
            str(r.gpus),
            str(r.accumulation),
            f"{r.published:,.1f}",
            f"{r.predicted:,.1f}",
            "(fit)" if r.calibration else f"{r.error:+.1%}" + (" (held out)" if r.held_out else ""),
            f"{r.published_efficiency:.1%} / {r.predicted_efficiency:.1%}",
        )
    console = Console()
    console.width = max(console.width, 130)
    console.print(table)
    s = summary(rows)
    console.print(
        f"{s['rows']} predicted rows: median |error| {s['median']:.1%}, max {s['max']:.1%}, "
        f"within 10 %: {s['within_10']}/{s['rows']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
