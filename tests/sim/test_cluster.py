"""Cluster YAML: units, defaults and clear errors."""

from __future__ import annotations

import pytest

from longboat.sim import cluster
from longboat.sim.cluster import ClusterError


def write(tmp_path, text: str):  # noqa: ANN001, ANN201
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_full_file(tmp_path) -> None:  # noqa: ANN001
    c = cluster.load(
        write(
            tmp_path,
            """
nodes: 4
devices_per_node: 8
device: a100
intra: {kind: nvswitch, bandwidth: 300GB/s, latency: 3us}
inter: {bandwidth: 200gbit, latency: 5us, nics_per_node: 4, efficiency: 0.9}
compute: {jitter: 0.02, contention: 0.1, precision: tf32}
input: {samples_per_s: 20000}
ps: {servers: 2, bandwidth: 25gbit}
algorithms: {ring: {bandwidth_efficiency: 0.8, overhead: 50us}}
""",
        )
    )
    assert c.world == 32 and c.device == "a100"
    assert c.intra.bandwidth == 300e9 and c.intra.latency == pytest.approx(3e-6)
    assert c.inter.rate == pytest.approx(25e9 * 0.9) and c.inter.nics_per_node == 4
    assert c.ps is not None and c.ps.servers == 2 and c.ps.link.bandwidth == 25e9 / 8
    assert c.cost("ring").overhead == pytest.approx(50e-6)
    assert c.mem_bw == 2039e9  # the device table's
    assert (c.jitter, c.contention, c.precision, c.input_rate) == (0.02, 0.1, "tf32", 20000.0)
    assert cluster.from_dict(c.to_dict()) == c


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nodes: 2\n", "'devices_per_node' is required"),
        ("nodes: 0\ndevices_per_node: 1\n", "'nodes' must be a positive integer"),
        ("nodes: 1\ndevices_per_node: 1\nnode: 3\n", r"unknown key\(s\) \['node'\]"),
        ("nodes: 1\ndevices_per_node: 1\ndevice: TPU\n", "unknown device 'TPU'"),
        ("nodes: 1\ndevices_per_node: 1\ninter: {bandwidth: fast}\n", "inter.bandwidth: 'fast'"),
        ("nodes: 1\ndevices_per_node: 1\ninter: {bandwidth: 10parsecs}\n", "unknown unit"),
        ("nodes: 1\ndevices_per_node: 1\nintra: {kind: wifi}\n", "intra.kind: 'wifi'"),
        ("nodes: 1\ndevices_per_node: 1\ninter: {latency: soon}\n", "inter.latency"),
        ("nodes: 1\ndevices_per_node: 1\nalgorithms: {tree: {}}\n", "'tree' is not one of"),
        ("nodes: 1\ndevices_per_node: 1\ninter: {bandwidth: 100gbps}\n", "ambiguous"),
        ("nodes: 1\ndevices_per_node: 1\ninter: {bandwidth: 12500000000}\n", "bare number"),
        ("nodes: 1\ndevices_per_node: 1\nbackend: mpi\n", "backend: 'mpi'"),
        ("nodes: 1\ndevices_per_node: 1\ncompute: {precision: fp8}\n", "precision: 'fp8'"),
        ("nodes: 1\ndevices_per_node: 1\ncompute: {jitter: -1}\n", "jitter: a number >= 0"),
        ("nodes: 1\ndevices_per_node: 1\ninput: {samples_per_s: 0}\n", "samples/s per node"),
        ("nodes: 1\ndevices_per_node: 1\ninter: {gpudirect: maybe}\n", "true or false"),
        ("nodes: 1\ndevices_per_node: 1\nintra: {kind: pcie, links: 4}\n", "only with kind nvlink"),
        ("nodes: 1\ndevices_per_node: 1\ndevice: {name: X}\n", "peak_flops.fp32 is required"),
        ("nodes: [1\n", "not valid YAML"),
        ("", "empty"),
    ],
)
def test_errors_name_the_key(tmp_path, text: str, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ClusterError, match=message):
        cluster.load(write(tmp_path, text))


def test_missing_file() -> None:
    with pytest.raises(ClusterError, match="does not exist"):
        cluster.load("/nonexistent/cluster.yaml")


def test_with_devices() -> None:
    c = cluster.from_dict({"nodes": 4, "devices_per_node": 8})
    assert (c.with_devices(4).nodes, c.with_devices(4).devices_per_node) == (1, 4)
    assert c.with_devices(64).nodes == 8
    with pytest.raises(ClusterError, match="do not fill"):
        c.with_devices(12)
