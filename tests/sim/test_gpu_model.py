"""What GPU clusters lose: NCCL's size-dependent cost, NVLink and NIC descriptions, contention,
stragglers, the input pipeline; devices described by the user; backend apart from device."""

from __future__ import annotations

import dataclasses

import pytest

from longboat.sim import cluster as cluster_mod
from longboat.sim import cost, nccl
from longboat.sim.cluster import ClusterError
from longboat.sim.devices import DeviceError
from longboat.sim.fit import compute_efficiency
from longboat.sim.predict import simulate
from longboat.sim.profile import Param, Profile
from longboat.sim.straggler import expected_max
from longboat.strategy import Strategy
from tests.sim.helpers import resnet50_like

V100_NODES = {
    "nodes": 4,
    "devices_per_node": 8,
    "device": "V100",
    "intra": {"kind": "nvlink", "links": 6, "link_bandwidth": "25GB/s"},
    "inter": {"bandwidth": "100Gb/s", "nics_per_node": 1},
}


def gpu(**over: object) -> cluster_mod.Cluster:
    return cluster_mod.from_dict(V100_NODES | over)


def embedding_last(batch: int = 16) -> Profile:
    """A language model whose 400 MB embedding gradient is ready when backward ends."""
    params = [Param("emb.weight", (200_000, 512), "float32", "emb", 1.0)]
    for i in range(12):
        ready = 1.0 - (i + 1) / 13
        params.append(Param(f"l{i}.weight", (2048, 512), "float32", f"l{i}", ready))
    return Profile("lm", batch, 0.5, 1.0, 0.0, 3e12 * batch / 16, tuple(params), device="cuda")


def test_nvlink_ports_and_a_partial_directly_linked_node() -> None:
    c = gpu()
    assert c.intra.bandwidth == pytest.approx(150e9) and c.intra.links == 6
    two = c.with_devices(2)
    assert two.intra.bandwidth == pytest.approx(150e9 / 7)  # one of 7 peers' share of ports
    switched = gpu(intra={"kind": "nvswitch", "links": 6})
    assert switched.with_devices(2).intra.bandwidth == pytest.approx(150e9)
    with pytest.raises(ClusterError, match="give bandwidth"):
        gpu(intra={"kind": "nvlink", "bandwidth": "150GB/s", "link_bandwidth": "25GB/s"})
    with pytest.raises(ClusterError, match="host link"):
        gpu(intra={"kind": "loopback"})


def test_small_buckets_are_latency_bound_large_ones_bandwidth_bound() -> None:
    fabric = cost.fabric(gpu().with_devices(32))
    small_lat, small_bw = nccl.allreduce(4096, fabric)
    big_lat, big_bw = nccl.allreduce(256 << 20, fabric)
    assert small_lat > 5 * small_bw and big_bw > 50 * big_lat
    assert nccl.choice(4096, fabric)[1] == "LL" and nccl.choice(256 << 20, fabric)[1] != "LL"
    # bus bandwidth grows with the message until the latency is amortised
    bus = [s / sum(nccl.allreduce(s, fabric)) for s in (1 << 12, 1 << 16, 1 << 20, 1 << 26)]
    assert bus == sorted(bus)
    # across many nodes the tree's logarithmic latency wins for small messages
    assert nccl.choice(4096, cost.fabric(gpu(nodes=64)))[0] == "tree"


def test_nvlink_bandwidth_now_matters() -> None:
    prof = embedding_last()
    slow = simulate(prof, gpu(intra={"kind": "nvswitch", "bandwidth": "60GB/s"}).with_devices(8))
    fast = simulate(prof, gpu(intra={"kind": "nvswitch", "bandwidth": "150GB/s"}).with_devices(8))
    assert slow.exposed_comm_s > 2 * fast.exposed_comm_s
    assert slow.step_s / fast.step_s > 1.02


def test_the_network_and_gpudirect_matter_across_nodes() -> None:
    prof = embedding_last()
    hundred = simulate(prof, gpu())
    ten = simulate(prof, gpu(inter={"bandwidth": "10Gb/s", "nics_per_node": 1}))
    no_gdr = simulate(prof, gpu(inter={"bandwidth": "100Gb/s", "gpudirect": False}))
    assert ten.step_s > 1.5 * hundred.step_s
    assert no_gdr.exposed_comm_s > 1.5 * hundred.exposed_comm_s


def test_straggler_wait_grows_with_the_number_of_ranks() -> None:
    values = [expected_max(n) for n in (1, 2, 4, 8, 64, 1024)]
    assert values[0] == 0 and values == sorted(values)
    assert values[1] == pytest.approx(0.5642, abs=1e-3) and values[3] == pytest.approx(1.4236, 1e-3)
    prof = resnet50_like()
    jitter = {"jitter": 0.02, "device_spread": 0.0}
    waits = [simulate(prof, gpu(compute=jitter).with_devices(n)).straggler_s
             for n in (1, 2, 8, 32)]  # fmt: skip
    assert waits[0] == 0 and waits == sorted(waits) and waits[-1] > 0
    merged = Strategy(gradient_merge=True, gradient_merge_configs={"k_steps": 4})
    one = simulate(prof, gpu(compute=jitter), merged).straggler_s
    assert one == pytest.approx(waits[-1] / 2, rel=0.05)  # spread over sqrt(4) micro-steps


def test_persistent_device_spread_does_not_average_out() -> None:
    prof = resnet50_like()
    spread = {"jitter": 0.0, "device_spread": 0.02}
    merged = Strategy(gradient_merge=True, gradient_merge_configs={"k_steps": 4})
    single = simulate(prof, gpu(compute=spread))
    four = simulate(prof, gpu(compute=spread), merged)
    assert four.straggler_s == pytest.approx(single.straggler_s, rel=1e-6)  # per micro-step
    wait = 0.02 * expected_max(32) * single.compute_s
    assert single.straggler_s == pytest.approx(wait, rel=0.02)
    assert simulate(prof, gpu().with_devices(1)).straggler_s == 0
    assert (
        simulate(prof, gpu()).straggler_s
        > simulate(prof, gpu(compute={"device_spread": 0})).straggler_s
    )
    cpu = cluster_mod.from_dict({"nodes": 2, "devices_per_node": 2})
    assert simulate(prof, cpu).straggler_s == 0  # Gloo on CPU: no default jitter or spread


def test_contention_slows_the_overlapped_backward() -> None:
    prof = embedding_last()
    none = simulate(prof, gpu(compute={"contention": 0.0}))
    some = simulate(prof, gpu(compute={"contention": 0.3}))
    assert none.contention_s == 0 and some.contention_s > 0
    assert some.step_s > none.step_s
    assert simulate(prof, gpu()).contention_s > 0  # derived from the device by default
    cpu = cluster_mod.from_dict({"nodes": 2, "devices_per_node": 2})
    assert simulate(resnet50_like(), cpu).contention_s == 0  # Gloo on CPU: none


def test_input_pipeline_bounds_the_step() -> None:
    prof = resnet50_like()
    free = simulate(prof, gpu())
    bound = simulate(prof, gpu(input={"samples_per_s": 100.0}))
    assert free.input_wait_s == 0 and bound.input_wait_s > 0
    assert bound.samples_per_s == pytest.approx(100.0 * 4)  # per node, 4 nodes
    loaders = simulate(prof, gpu(input={"workers": 2}))
    assert loaders.samples_per_s == pytest.approx(2 * cluster_mod.DEFAULT_WORKER_RATE * 4)
    own = simulate(prof, gpu(input={"workers": 2, "worker_samples_per_s": 10.0}))
    assert own.samples_per_s == pytest.approx(2 * 10.0 * 4)
    node = gpu(input={"workers": 2, "worker_samples_per_s": 10.0})
    assert cluster_mod.from_dict(node.to_dict()).node_input_rate == 20.0
    assert node.without_input().node_input_rate is None
    with pytest.raises(ClusterError, match="not both"):
        gpu(input={"samples_per_s": 10.0, "workers": 2})
    with pytest.raises(ClusterError, match="needs workers"):
        gpu(input={"worker_samples_per_s": 10.0})


def test_described_device_and_precisions() -> None:
    desc = {"name": "A40", "peak_flops": {"fp32": "37.4TFLOPS", "bf16": "149.7TFLOPS"},
            "memory_bandwidth": "696GB/s", "sms": 84}  # fmt: skip
    c = gpu(device=desc, intra={"kind": "pcie"})
    assert c.device == "A40" and c.spec.peak("bf16") == 149.7e12 and c.mem_bw == 696e9
    assert cluster_mod.from_dict(c.to_dict()) == c
    prof = resnet50_like()
    amp_bf16 = Strategy(amp=True, amp_configs={"dtype": "bfloat16"})
    assert simulate(prof, c, amp_bf16).compute_s < simulate(prof, c).compute_s
    with pytest.raises(DeviceError, match="no peak FLOP/s for fp16"):
        simulate(prof, c, Strategy(amp=True))
    with pytest.raises(ClusterError, match="peak_flops.fp32 is required"):
        gpu(device={"name": "X1", "memory_bandwidth": "1TB/s"})
    with pytest.raises(ClusterError, match="unknown device 'TPU'"):
        gpu(device="TPU")
    tf32 = gpu(device="A100", compute={"precision": "tf32"})
    assert simulate(prof, tf32).compute_s < simulate(prof, gpu(device="A100")).compute_s


def test_profile_device_is_apart_from_the_backend() -> None:
    on_gpu = dataclasses.replace(embedding_last(), device="cuda")
    on_cpu = dataclasses.replace(embedding_last(), device="cpu")
    described = {"nodes": 2, "devices_per_node": 8, "device": "profiled",
                 "intra": {"kind": "nvswitch", "links": 12}, "memory_bandwidth": "2TB/s"}  # fmt: skip
    c = cluster_mod.from_dict(described)
    assert c.resolved_backend(on_gpu.device) == "nccl"
    assert c.resolved_backend(on_cpu.device) == "gloo"
    p = simulate(on_gpu, c)
    assert p.compute_s == pytest.approx(on_gpu.compute_s + p.contention_s, rel=0.05)
    with pytest.raises(ClusterError, match="memory_bandwidth"):
        simulate(on_gpu, cluster_mod.from_dict(described | {"memory_bandwidth": None}))
    with pytest.raises(ClusterError, match="intra-node link"):
        simulate(on_gpu, cluster_mod.from_dict({"nodes": 2, "devices_per_node": 8,
                                                "device": "profiled"}))  # fmt: skip
    cpu = cluster_mod.from_dict({"nodes": 2, "devices_per_node": 2, "device": "cpu"})
    assert cpu.resolved_backend("cuda") == "gloo"  # device: cpu keeps Gloo, as before
    forced = cluster_mod.from_dict(described | {"backend": "gloo"})
    assert forced.resolved_backend("cuda") == "gloo"


def test_batch_scales_compute_from_the_profile() -> None:
    prof = resnet50_like()
    double = prof.with_batch(2 * prof.batch)
    assert double.flops == pytest.approx(2 * prof.flops)
    assert double.compute_s == pytest.approx(2 * prof.compute_s)
    assert double.optimizer_s == prof.optimizer_s
    one = gpu().with_devices(1)
    assert simulate(double, one).compute_s == pytest.approx(
        2 * simulate(prof, one).compute_s, rel=0.02
    )


def test_compute_efficiency_from_one_measured_step() -> None:
    prof, c = resnet50_like(), gpu()
    eff = compute_efficiency(prof, c, 0.4)
    fitted = dataclasses.replace(c, compute_efficiency=eff)
    assert simulate(prof, fitted.with_devices(1)).step_s == pytest.approx(0.4)
    with pytest.raises(ClusterError, match="of the device's peak"):
        compute_efficiency(prof, c, 0.02)
    with pytest.raises(ClusterError, match="GPU's compute efficiency"):
        compute_efficiency(prof, cluster_mod.from_dict({"nodes": 1, "devices_per_node": 1}), 1.0)
