"""Scaling sweeps: predicted step time and efficiency for N = 1, 2, 4, ... devices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from longboat.sim.cluster import Cluster
from longboat.sim.predict import Prediction, simulate
from longboat.sim.profile import Profile
from longboat.strategy import Strategy
from longboat.tools.progress import progress


@dataclass(frozen=True)
class Point:
    prediction: Prediction
    speedup: float
    efficiency: float


def device_counts(cluster: Cluster, max_devices: int) -> list[int]:
    """Powers of two up to ``max_devices`` that the cluster's node size can hold, plus the
    node size and ``max_devices`` themselves."""
    per = cluster.devices_per_node
    counts = {1, per, max_devices}
    n = 1
    while n <= max_devices:
        counts.add(n)
        n *= 2
    return sorted(c for c in counts if c <= max_devices and (c <= per or c % per == 0))


def sweep(
    profile: Profile,
    cluster: Cluster,
    strategy: Strategy | None = None,
    counts: Sequence[int] | None = None,
    show: bool = True,
) -> list[Point]:
    """One prediction per device count; efficiency against one device of the same cluster."""
    counts = list(counts) if counts else device_counts(cluster, cluster.world)
    base = simulate(profile, cluster.with_devices(1), strategy)
    points = []
    with progress("sim sweep", len(counts), show, devices="-") as done:
        for n in counts:
            p = simulate(profile, cluster.with_devices(n), strategy)
            speedup = p.samples_per_s / base.samples_per_s
            points.append(Point(p, speedup, speedup / n))
            done(devices=n)
    return points


def plot(series: dict[str, Sequence[Point]], out: str, title: str = "") -> None:
    """Scaling efficiency against devices (log2 axis), one line per series, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for label, points in series.items():
        ax.plot(
            [p.prediction.devices for p in points],
            [p.efficiency * 100 for p in points],
            "o-",
            label=label,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_ylim(0, 105)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or "predicted scaling efficiency")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
