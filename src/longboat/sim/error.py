"""How far the simulator's step times have been off, per kind of cluster: the margin a predicted
gain must clear before `--recommend` proposes a change.

Each figure is the median |error| of predicted against measured step times, from the
validations in docs/BENCHMARKS.md and docs/sim.md: the published GPU scaling tables, grouped by
interconnect (`tests/sim/test_gpu_validation.py` checks the figures against the rows), and this
project's own runs on emulated CPU nodes. A cluster of a kind no validation covered gets the
largest of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from longboat.sim.cluster import Cluster


@dataclass(frozen=True)
class KnownError:
    """The simulator's median relative error on one kind of cluster, and where it comes from."""

    kind: str
    median: float
    source: str

    def __str__(self) -> str:
        return f"{self.median * 100:.1f} % on {self.kind}, {self.source}"


NVSWITCH_NODE = KnownError(
    "GPUs on one NVSwitch node", 0.019, "43 published rows (DGX-2H, DGX A100)"
)
NVSWITCH_NODES = KnownError(
    "NVSwitch nodes over InfiniBand", 0.011, "20 published rows (DGX A100, 2-32 nodes)"
)
NVLINK_NODE = KnownError("GPUs on one NVLink node", 0.054, "26 published rows (DGX-1)")
EMULATED_HOSTS = KnownError(
    "CPU nodes over Ethernet (Gloo)", 0.058, "9 emulated runs on 100 Mbit/s-1 Gbit/s links"
)
KNOWN = (NVSWITCH_NODE, NVSWITCH_NODES, NVLINK_NODE, EMULATED_HOSTS)
UNVALIDATED_MARGIN = max(k.median for k in KNOWN)


def kind_of(cluster: Cluster) -> KnownError | None:
    """The validated kind ``cluster`` belongs to, or None where no validation covered it."""
    if not cluster.is_gpu:
        return EMULATED_HOSTS
    kind = cluster.intra.kind
    if kind == "nvswitch":
        return NVSWITCH_NODES if cluster.nodes > 1 else NVSWITCH_NODE
    if kind == "nvlink" and cluster.nodes == 1:
        return NVLINK_NODE
    return None


def known_error(cluster: Cluster) -> KnownError:
    """The error to expect of a prediction on ``cluster`` (the largest known where its kind was
    never validated)."""
    found = kind_of(cluster)
    if found is not None:
        return found
    return KnownError(
        "a cluster of a kind no validation covered",
        UNVALIDATED_MARGIN,
        "the largest validated median",
    )
