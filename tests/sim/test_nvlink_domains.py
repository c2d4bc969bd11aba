"""NVLink that spans only part of a node (bridged pairs on PCIe servers) and PCIe by device
generation: a ring wider than one NVLink domain is bound by PCIe, never by NVLink."""

from __future__ import annotations

import json

import pytest

from longboat.sim import cluster as cluster_mod
from longboat.sim import cost, nccl
from longboat.sim.cluster import ClusterError
from longboat.sim.devices import DeviceError
from longboat.sim.predict import simulate
from longboat.sim.profile import Param, Profile

# 8 A100 PCIe per node, NVLink bridges joining pairs (12 ports of 25 GB/s per GPU), Gen4 x16.
BRIDGED = {
    "nodes": 1,
    "devices_per_node": 8,
    "device": "A100",
    "intra": {"kind": "nvlink", "links": 12, "group": 2},
}


def bridged(**intra: object) -> cluster_mod.Cluster:
    return cluster_mod.from_dict(BRIDGED | {"intra": BRIDGED["intra"] | intra})


def late_gradients() -> Profile:
    """400 MB of gradients ready only when backward ends: the allreduce is all exposed."""
    params = (Param("emb.weight", (200_000, 512), "float32", "emb", 0.05),)
    return Profile("lm", 16, 0.02, 0.05, 0.0, 1e12, params, device="cuda")


def test_pcie_bandwidth_follows_the_device_generation() -> None:
    one = {"nodes": 1, "devices_per_node": 4, "intra": {"kind": "pcie"}}
    assert cluster_mod.from_dict(one | {"device": "V100"}).intra.bandwidth == 15.75e9  # Gen3
    assert cluster_mod.from_dict(one | {"device": "A100"}).intra.bandwidth == 31.5e9  # Gen4
    assert cluster_mod.from_dict(one | {"device": "H100"}).intra.bandwidth == 63e9  # Gen5
    described = {"name": "L4", "peak_flops": {"fp32": "30TFLOPS"}, "memory_bandwidth": "300GB/s",
                 "pcie_bandwidth": "31.5GB/s"}  # fmt: skip
    c = cluster_mod.from_dict(one | {"device": described})
    assert c.intra.bandwidth == 31.5e9 and c.spec.pcie_bandwidth == 31.5e9
    assert cluster_mod.from_dict(c.to_dict()) == c
    with pytest.raises(ClusterError, match="pcie_bandwidth"):
        cluster_mod.from_dict(one | {"device": described | {"pcie_bandwidth": "fast"}})


def test_a_job_inside_one_domain_keeps_nvlink() -> None:
    pair = bridged().with_devices(2)
    assert pair.node_link.kind == "nvlink"
    assert pair.node_link.bandwidth == pytest.approx(300e9)  # all 12 ports join the pair
    assert cost.fabric(pair).bus_bw == pytest.approx(300e9 * nccl.NVLINK_SHARE["ampere"])


@pytest.mark.parametrize("devices", [4, 8])
def test_a_job_across_domains_is_bound_by_pcie(devices: int) -> None:
    c = bridged().with_devices(devices)
    assert c.node_link.kind == "pcie" and c.node_link.bandwidth == 31.5e9
    assert cost.fabric(c).bus_bw == pytest.approx(31.5e9 * nccl.PCIE_SHARE)
    assert cost.fabric(c).intra_hop == "pcie"
    full = bridged()  # the whole node, not cut by with_devices
    assert full.node_link.kind == "pcie"
    mesh = cluster_mod.from_dict(BRIDGED | {"intra": {"kind": "nvlink", "links": 12}})
    assert cost.fabric(mesh.with_devices(devices)).bus_bw > 3 * cost.fabric(c).bus_bw


def test_what_bounds_the_bus_is_named() -> None:
    assert cost.bus_limit(bridged()) == (
        pytest.approx(31.5e9 * nccl.PCIE_SHARE),
        "PCIe between NVLink groups of 2",
    )
    assert cost.bus_limit(bridged().with_devices(2))[1] == "nvlink"
    slow_nic = {"nodes": 2, "inter": {"bandwidth": "10Gb/s", "gpudirect": False}}
    assert cost.bus_limit(cluster_mod.from_dict(BRIDGED | slow_nic))[1] == (
        "1 NIC(s) per node, no GPUDirect"
    )


def test_across_nodes_the_crossing_still_binds() -> None:
    two_nodes = cluster_mod.from_dict(BRIDGED | {"nodes": 2, "inter": {"bandwidth": "400Gb/s",
                                                                      "nics_per_node": 8}})  # fmt: skip
    assert cost.fabric(two_nodes).bus_bw == pytest.approx(31.5e9 * nccl.PCIE_SHARE)


def test_prediction_pays_for_the_pcie_crossing() -> None:
    prof = late_gradients()
    pcie = simulate(prof, bridged())
    mesh = simulate(prof, cluster_mod.from_dict(BRIDGED | {"intra": {"kind": "nvlink",
                                                                     "links": 12}}))  # fmt: skip
    assert pcie.exposed_comm_s > 4 * mesh.exposed_comm_s
    faster = simulate(prof, bridged(pcie_bandwidth="63GB/s"))
    assert faster.exposed_comm_s < 0.6 * pcie.exposed_comm_s


def test_without_gpudirect_a_nic_gets_half_the_devices_pcie() -> None:
    assert nccl.nic_rate(50e9, gpudirect=False) == pytest.approx(6e9)  # Gen3: as before
    assert nccl.nic_rate(50e9, gpudirect=False, pcie=31.5e9) == pytest.approx(12e9)
    assert nccl.nic_rate(50e9, gpudirect=True, pcie=31.5e9) == pytest.approx(48e9)


def test_domain_round_trip_and_refusals() -> None:
    c = bridged(pcie_bandwidth="63GB/s")
    assert cluster_mod.from_dict(c.to_dict()) == c
    with pytest.raises(ClusterError, match="group: only with kind nvlink"):
        bridged(kind="nvswitch")
    with pytest.raises(ClusterError, match="does not divide"):
        bridged(group=3)
    with pytest.raises(ClusterError, match="more than devices_per_node"):
        bridged(group=16)
    with pytest.raises(ClusterError, match="positive integer"):
        bridged(group=0)
    with pytest.raises((ClusterError, DeviceError), match="pcie_bandwidth"):
        bridged(pcie_bandwidth="12")


def test_command_line_group(tmp_path, capsys) -> None:  # noqa: ANN001
    from longboat.cli import main

    path, out = tmp_path / "p.json", tmp_path / "out.json"
    late_gradients().save(path)
    node = ["--nodes", "1", "--devices-per-node", "8", "--device", "A100", "--intra-kind",
            "nvlink", "--intra-links", "12", "--json", str(out)]  # fmt: skip

    def efficiency_at_8(*extra: str) -> float:
        assert main(["sim", "predict", "--profile", str(path), *node, *extra]) == 0
        return json.loads(out.read_text())["sweep"][-1]["efficiency"]

    assert efficiency_at_8("--intra-group", "2") < 0.85 * efficiency_at_8()
    printed = capsys.readouterr().out
    assert "NCCL bus bandwidth per rank" in printed and "PCIe between NVLink groups of 2" in printed
    assert main(["sim", "predict", "--profile", str(path), *node, "--intra-group", "3"]) == 2
    assert "does not divide devices_per_node (8)" in capsys.readouterr().err


def test_pcie_cards_default_to_their_pcie_link() -> None:
    for name, gen in (("A100-PCIe", 31.5e9), ("H100-PCIe", 63e9), ("L40S", 31.5e9), ("L4", 31.5e9)):
        c = cluster_mod.from_dict({"nodes": 1, "devices_per_node": 8, "device": name})
        assert c.intra.kind == "pcie" and c.intra.bandwidth == gen, name
    sxm = cluster_mod.from_dict({"nodes": 1, "devices_per_node": 8, "device": "A100"})
    assert sxm.intra.kind == "nvswitch"
    card = cluster_mod.from_dict({"nodes": 1, "devices_per_node": 8, "device": "H100-PCIe"})
    assert card.spec.peak("bf16") == 756e12 and card.spec.memory_bandwidth == 2000e9  # not SXM
