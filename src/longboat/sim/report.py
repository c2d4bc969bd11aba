"""Rich tables for `longboat sim`."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from longboat.sim import cost
from longboat.sim.cluster import Cluster
from longboat.sim.compression import UNPRICED
from longboat.sim.predict import Prediction
from longboat.sim.profile import Profile
from longboat.sim.units import human_rate, human_time


def _console() -> Console:
    console = Console()
    console.width = max(console.width, 110)
    return console


def profile_summary(prof: Profile, path: str) -> None:
    table = Table(
        title=f"profile of {prof.model} (batch {prof.batch}, {prof.threads} thread(s)) -> {path}"
    )
    for col in ("forward", "backward", "optimizer", "params", "grad MB", "GFLOP/step"):
        table.add_column(col, justify="right")
    table.add_row(
        human_time(prof.forward_s),
        human_time(prof.backward_s),
        human_time(prof.optimizer_s),
        f"{prof.param_count / 1e6:.2f} M",
        f"{prof.grad_bytes / 2**20:.1f}",
        f"{prof.flops / 1e9:.2f}",
    )
    _console().print(table)


def cluster_summary(cl: Cluster, path: str) -> None:
    table = Table(title=f"calibrated cluster -> {path}")
    table.add_column("parameter")
    table.add_column("value", justify="right")
    table.add_row("nodes x devices", f"{cl.nodes} x {cl.devices_per_node}")
    table.add_row(
        "intra link",
        f"{cl.intra.kind}: {human_rate(cl.intra.rate)}, alpha {human_time(cl.intra.latency)}",
    )
    table.add_row(
        "inter link",
        f"{human_rate(cl.inter.bandwidth)} x {cl.inter.efficiency:.3f}, alpha {human_time(cl.inter.latency)}",
    )
    table.add_row("memory bandwidth", human_rate(cl.mem_bw))
    table.add_row("shm passes", f"{cl.shm_passes:.2f}")
    table.add_row("effective cores (shared host)", f"{cl.shared_host_cores:.2f}")
    for name, c in [*cl.algorithms.items(), *cl.collectives.items()]:
        table.add_row(
            f"{name}",
            f"bandwidth x {c.bandwidth_efficiency:.3f}, +{human_time(c.overhead)} per call",
        )
    if cl.fsdp2 is not None:
        f = cl.fsdp2
        table.add_row(
            "FSDP2 host work",
            f"{human_time(f.step_overhead)} per step, +{human_time(f.unit_overhead)} per unit, "
            f"+{human_time(f.param_overhead)} per parameter, "
            f"+{human_time(f.byte_overhead * 2**20)} per MB moved",
        )
    _console().print(table)


def breakdown(prof: Profile, cl: Cluster, p: Prediction) -> None:
    backend = cl.resolved_backend(prof.device)
    table = Table(
        title=f"{prof.model} (batch {prof.batch}) on {cl.nodes} node(s) x {cl.devices_per_node} "
        f"{cl.device} device(s), {backend}: predicted step"
    )
    table.add_column("phase")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    rows = [
        ("compute (forward + backward)", p.compute_s - p.contention_s),
        ("slowed by collectives beside it", p.contention_s),
        ("exposed communication", p.exposed_comm_s),
        ("optimizer", p.optimizer_s),
        ("FSDP2's host work (hooks, per unit)", p.host_overhead_s),
        ("waiting for the slowest rank", p.straggler_s),
        ("waiting for input", p.input_wait_s),
    ]
    for i, (name, value) in enumerate(rows):
        if value > 0 or i in (0, 2, 3):
            table.add_row(name, human_time(value), f"{value / p.step_s:.1%}")
    table.add_section()
    table.add_row("step", human_time(p.step_s), f"{p.samples_per_s:,.0f} samples/s")
    table.add_row("communication (all)", human_time(p.comm_s), f"{p.overlap:.1%} hidden")
    table.add_row("buckets / algorithm", f"{p.buckets}", p.algorithm)
    table.add_row("bytes sent per rank", f"{p.bytes_sent / 2**20:.2f} MB", "; ".join(p.notes))
    if p.memory:
        held = sum(p.memory.values())
        parts = ", ".join(f"{k.replace('_', ' ')} {v / 2**20:.1f}" for k, v in p.memory.items())
        table.add_row("memory per rank", f"{held / 2**20:.1f} MB", f"{parts} (Adam's state)")
    if backend == "nccl" and cl.world > 1:
        bus, bound = cost.bus_limit(cl)
        table.add_row("NCCL bus bandwidth per rank", human_rate(bus), bound)
    _console().print(table)
    for note in p.notes:  # what the figures above could not price, one line each
        if UNPRICED in note:
            print(f"note: {note}")


def sweep_table(points: Sequence, model: str) -> None:  # noqa: ANN001
    table = Table(title=f"{model}: predicted scaling")
    for col in (
        "devices",
        "nodes",
        "step ms",
        "samples/s",
        "speedup",
        "efficiency",
        "exposed comm ms",
    ):
        table.add_column(col, justify="right")
    for pt in points:
        p = pt.prediction
        table.add_row(
            str(p.devices),
            str(p.nodes),
            f"{p.step_s * 1e3:.3f}",
            f"{p.samples_per_s:,.0f}",
            f"{pt.speedup:.1f}x",
            f"{pt.efficiency:.1%}",
            f"{p.exposed_comm_s * 1e3:.3f}",
        )
    _console().print(table)


def recommend_table(choices: Sequence, current: Prediction) -> None:  # noqa: ANN001
    table = Table(title=f"--recommend (current strategy: {current.step_s * 1e3:.3f} ms/step)")
    for col in ("#", "settings", "step ms", "exposed comm ms", "vs current"):
        table.add_column(col, justify="right" if col != "settings" else "left")
    for i, c in enumerate(choices, 1):
        settings = ", ".join(f"{k}={v}" for k, v in c.fields.items()) or "(all defaults)"
        table.add_row(
            str(i),
            settings,
            f"{c.prediction.step_s * 1e3:.3f}",
            f"{c.prediction.exposed_comm_s * 1e3:.3f}",
            f"{current.step_s / c.prediction.step_s:.2f}x",
        )
    _console().print(table)
