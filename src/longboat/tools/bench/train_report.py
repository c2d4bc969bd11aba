"""`longboat bench train`'s results: rows per system and rank count (samples/s, speedup,
efficiency, input-boundness, paired step-time ratios), as a table, Markdown or a plot; with
sharding on, a second table sets sharded longboat against unsharded longboat, DDP and DDP with
``ZeroRedundancyOptimizer`` (at stage 3: torch's FSDP2 applied by hand), with each one's memory
per rank."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from longboat.tools.bench.train_fsdp import FSDP_BY_HAND
from longboat.tools.bench.train_memory import FIELDS
from longboat.tools.bench.train_rank import DDP_LEAN, DDP_ZERO, NO_SYNC, UNSHARDED

INPUT_BOUND_FRACTION = 0.1
ROWS = ("longboat", UNSHARDED, "ddp", DDP_ZERO, FSDP_BY_HAND)
"""The systems that get a row, in this order, where the run has them."""


def summarise(raw: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows per (system, nproc): samples/s, speedup and efficiency vs 1 rank (None without a
    1-rank run), input-boundness, the longboat/DDP ratio and the no-sync floor's ratio to DDP
    (the same steps without any gradient exchange: the best any allreduce could reach); every
    row also has its step-time quartiles, longboat over that system paired round by round
    (``longboat_over_this``) and, with sharding on, its memory per rank."""
    rows = []
    base: dict[str, float] = {}
    for nproc in sorted(raw):
        r = raw[nproc]
        ratio, (q1, q3) = paired(r, "longboat", "ddp")
        floor = paired(r, NO_SYNC, "ddp")[0] if NO_SYNC in r else None
        lean = paired(r, "longboat", DDP_LEAN) if DDP_LEAN in r else None
        over_plain = paired(r, "longboat", NO_SYNC) if NO_SYNC in r else None
        for system in (s for s in ROWS if s in r):
            step = statistics.median(r[system]["step_s"])
            over_this = paired(r, "longboat", system)
            data = statistics.median(r[system]["data_s"])
            throughput = r["batch_per_rank"] * nproc / step
            if nproc == 1:
                base[system] = throughput
            speedup = throughput / base[system] if system in base else None  # needs a 1-rank run
            rows.append(
                {
                    "system": system,
                    "nproc": nproc,
                    "step_ms": step * 1e3,
                    "samples_per_s": throughput,
                    "speedup": speedup,
                    "efficiency": speedup / nproc if speedup is not None else None,
                    "data_fraction": data / step,
                    "input_bound": data / step > INPUT_BOUND_FRACTION,
                    "longboat_over_ddp": ratio,
                    "longboat_over_ddp_p25_p75": [q1, q3],
                    "no_sync_over_ddp": floor,
                    "longboat_over_ddp_lean": lean[0] if lean else None,
                    "longboat_over_ddp_lean_p25_p75": list(lean[1]) if lean else None,
                    "longboat_over_no_sync": over_plain[0] if over_plain else None,
                    "longboat_over_no_sync_p25_p75": list(over_plain[1]) if over_plain else None,
                    "params": r["params"],
                    "device": r.get("device", "cpu"),
                    "compiled": r.get("compiled", False),
                    "batch_per_rank": r["batch_per_rank"],
                    "rounds": len(r[system]["step_s"]),
                    "step_ms_p25_p75": [q * 1e3 for q in _quartiles(r[system]["step_s"])],
                    "longboat_over_this": over_this[0],
                    "longboat_over_this_p25_p75": list(over_this[1]),
                    "sharding": r.get("sharding"),
                    **dict.fromkeys(FIELDS),
                    **r[system].get("memory", {}),
                }
            )
    return rows


def paired(raw: dict[str, Any], system: str, baseline: str) -> tuple[float, tuple[float, float]]:
    """Median and quartiles of ``system``/``baseline`` step-time ratios, round by round (the
    two ran back to back in each round, so machine noise hits both alike)."""
    ratios = [a / b for a, b in zip(raw[system]["step_s"], raw[baseline]["step_s"], strict=True)]
    return statistics.median(ratios), _quartiles(ratios)


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    """(p25, p75) of ``values`` (both the value itself when there is one)."""
    if len(values) < 2:
        median = statistics.median(values)
        return median, median
    q1, _, q3 = statistics.quantiles(sorted(values), n=4)
    return q1, q3


def _ratio(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _label(model: str, rows: Sequence[dict[str, Any]]) -> str:
    """The model's name, marked when every system ran compiled."""
    return f"{model} (compiled)" if rows and rows[0].get("compiled") else model


#: the terminal table's ratio columns and what each one divides (step times, paired by round)
RATIO_COLUMNS = (
    ("lb/DDP", "longboat_over_ddp", "longboat over DDP"),
    (
        "lb/lean",
        "longboat_over_ddp_lean",
        "longboat over lean DDP (no buffer broadcast, bucket views)",
    ),
    ("nosync/DDP", "no_sync_over_ddp", "no gradient exchange over DDP (the floor)"),
)
LEGEND = "step-time ratios, paired round by round (below 1: the first is faster): " + "; ".join(
    f"{head} = {what}" for head, _, what in RATIO_COLUMNS
)


#: the sharding table's headers in a terminal, where its Markdown ones would not fit 100 columns
SHORT_HEADS = {
    "sharded longboat / system": "sharded/this",
    "optimizer state MB": "optim. MB",
    "gradients MB": "grads MB",
    "allocated MB": "alloc. MB",
}


def render(model: str, rows: Sequence[dict[str, Any]]) -> None:
    """The rows as a table that fits a 100-column terminal (cells wrap, never cut) and a legend
    line for the ratio columns; with sharding, the sharding table after it."""
    from rich.table import Table

    from longboat.console import table_console

    first = rows[0]
    table = Table(
        title=f"bench train: {_label(model, rows)} ({first['params'] / 1e6:.2f} M params, batch "
        f"{first['batch_per_rank']}/rank, {first.get('device', 'cpu')})"
    )
    heads = ("system", "ranks", "step ms", "samples/s", "speedup", "effic.", "input wait")
    for column in heads + tuple(head for head, _, _ in RATIO_COLUMNS):
        table.add_column(column, justify="right", overflow="fold")
    for r in rows:
        table.add_row(
            r["system"],
            str(r["nproc"]),
            f"{r['step_ms']:.2f}",
            f"{r['samples_per_s']:.1f}",
            _ratio(r["speedup"], "{:.2f}x"),
            _ratio(r["efficiency"], "{:.0%}"),
            f"{r['data_fraction']:.0%}" + (" INPUT-BOUND" if r["input_bound"] else ""),
            *(_ratio(r.get(key), "{:.3f}") for _, key, _ in RATIO_COLUMNS),
        )
    console = table_console()
    console.print(table)
    console.print(LEGEND, highlight=False)
    shards = sharding_table(rows)
    if shards is not None:
        head, cells = shards
        second = Table(title=f"bench train: {_label(model, rows)}, sharding against the rest")
        for column in head:
            second.add_column(SHORT_HEADS.get(column, column), justify="right", overflow="fold")
        for row in cells:
            second.add_row(*row)
        console.print(second)
        console.print(
            "sharded/this: sharded longboat's step time over this system's, paired round by "
            "round (below 1: sharded longboat is faster)",
            highlight=False,
        )


def markdown(model: str, rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| model | system | ranks | step ms | samples/s | speedup | efficiency | input wait | longboat/DDP | longboat/DDP lean | no-sync/DDP |",  # noqa: E501
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    label = _label(model, rows)
    for r in rows:
        flag = " (input-bound)" if r["input_bound"] else ""
        lines.append(
            f"| {label} | {r['system']} | {r['nproc']} | {r['step_ms']:.2f} | {r['samples_per_s']:.1f} "
            f"| {_ratio(r['speedup'], '{:.2f}x')} | {_ratio(r['efficiency'], '{:.0%}')} "
            f"| {r['data_fraction']:.0%}{flag} "
            f"| {r['longboat_over_ddp']:.3f} | {_ratio(r.get('longboat_over_ddp_lean'), '{:.3f}')} "
            f"| {_ratio(r.get('no_sync_over_ddp'), '{:.3f}')} |"
        )
    shards = sharding_table(rows)
    if shards is not None:
        head, cells = shards
        lines += ["", "| model | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
        lines += [f"| {label} | " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def sharding_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]] | None:
    """Headers and cells of the sharding comparison (None for a run without sharding): each
    system's step time with its quartiles, sharded longboat over it (paired round by round,
    with quartiles) and its memory per rank (the largest over the ranks)."""
    mine = [r for r in rows if r.get("sharding") is not None]
    if not mine:
        return None
    gpu = any(r.get("device_allocated_mb") is not None for r in mine)
    head = ["system", "ranks", "step ms", "p25-p75", "sharded longboat / system", "p25-p75"]
    head += ["optimizer state MB", "gradients MB", "parameters MB"]
    head += ["allocated MB", "peak MB"] if gpu else []
    stage = mine[0]["sharding"].get("stage", 1)
    cells = []
    for r in mine:
        system = f"longboat, sharding stage {stage}" if r["system"] == "longboat" else r["system"]
        low, high = r["step_ms_p25_p75"]
        q1, q3 = r["longboat_over_this_p25_p75"]
        row = [system, str(r["nproc"]), f"{r['step_ms']:.2f}", f"{low:.2f}-{high:.2f}"]
        row += [f"{r['longboat_over_this']:.3f}", f"{q1:.3f}-{q3:.3f}"]
        columns = ("optimizer_state_mb", "gradient_mb", "parameter_mb")
        columns += ("device_allocated_mb", "device_peak_mb") if gpu else ()
        row += [_ratio(r.get(c), "{:.2f}") for c in columns]
        cells.append(row)
    return head, cells


def plot(results: dict[str, list[dict[str, Any]]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.5), squeeze=False)
    for ax, (model, rows) in zip(axes[0], results.items(), strict=True):
        for system, style in (("longboat", "o-"), ("ddp", "s--")):
            mine = [r for r in rows if r["system"] == system]
            ax.plot(
                [r["nproc"] for r in mine], [r["samples_per_s"] for r in mine], style, label=system
            )  # noqa: E501
        ax.set_title(model)
        ax.set_xlabel("ranks")
        ax.set_ylabel("samples/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
