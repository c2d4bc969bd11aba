"""`longboat sim calibrate`: fit the cluster model's link parameters to this machine.

On this machine (``nproc`` local ranks, `longboat.tools.bench.comm`'s measurement): the
backend's allreduce gives the intra-node link (``t = 2 alpha + S / rate`` for two ranks),
``ring`` and ``shm`` their corrections (overhead per call, bandwidth efficiency, shm passes),
the memory-copy limit the memory bandwidth, concurrent matrix products the effective number of
cores (``compute.shared_host_cores``: ranks beyond it share the cores), and sharding stage 3's
costs (the backend's all-gather and reduce-scatter, FSDP2's host work:
`longboat.sim.calibrate_fsdp`). With ``emulate_rate`` (root): two emulated nodes of
two ranks (`longboat emulate`) give the inter-node link's latency and payload efficiency
(``rate / tc rate``), hierarchical's corrections, and how fast compute runs when all four ranks
share this host under the launcher (the effective cores, replacing the measurement without it). Every fit is least squares of
``t = a + b S`` over the measured sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from longboat.launch.link_rates import parse_rate
from longboat.sim import cost
from longboat.sim.cluster import AlgorithmCost, Cluster, Link

LOCAL_SIZES = (64 << 10, 1 << 20, 4 << 20, 16 << 20)
LINK_SIZES = (64 << 10, 512 << 10, 2 << 20, 4 << 20)
BURN_REPS = 600


def fit(times: Mapping[Any, float]) -> tuple[float, float]:
    """``(a, b)`` of ``t = a + b * size`` by least squares of relative errors (small sizes
    weigh as much as large ones); a clipped at 0, b at a tiny positive."""
    sizes = np.array([float(s) for s in times])
    t = np.array(list(times.values()))
    b, a = np.polyfit(sizes, t, 1, w=1 / t)
    return max(0.0, float(a)), max(float(b), 1e-15)


def measure_local(
    nproc: int = 2, repeats: int = 5, sizes: Sequence[int] = LOCAL_SIZES
) -> dict[str, Any]:
    """bench comm's report for native, ring and shm on ``nproc`` local ranks."""
    from longboat.launch.local import launch_local
    from longboat.tools.bench.comm import rank_main

    return launch_local(rank_main, (["native", "ring", "shm"], list(sizes), repeats), nproc=nproc)[
        0
    ]


def local_cluster(report: Mapping[str, Any]) -> Cluster:
    """One node of ``world_size`` CPU ranks fitted to a bench comm report."""
    n = int(report["world_size"])
    res = report["results"]
    times = {name: {int(s): r["seconds"] for s, r in res[name].items()} for name in res}
    a, b = fit(times["native"])
    steps = 2 * cost._log2(n)
    ring_factor = 2 * (n - 1) / n
    intra = Link(ring_factor / b, a / max(steps, 1), "loopback")
    mem_bw = float(report["memcpy_GBps"]) * 1e9
    algorithms = {}
    if "ring" in times:
        ar, br = fit(times["ring"])
        algorithms["ring"] = AlgorithmCost(b / br, max(0.0, ar - 2 * (n - 1) * intra.latency))
    passes = 3.0
    if "shm" in times:
        a_s, b_s = fit(times["shm"])
        passes = b_s * mem_bw / n
        algorithms["shm"] = AlgorithmCost(1.0, a_s)
    return Cluster(
        nodes=1,
        devices_per_node=n,
        device="cpu",
        intra=intra,
        inter=Link(1e9 / 8, 50e-6),
        memory_bandwidth=mem_bw,
        shm_passes=passes,
        shared_host_cores=min(float(os.cpu_count() or 1), effective_cores()),
        algorithms=algorithms,
    )


def _burn(args: tuple[int, float]) -> float:
    """Seconds of ``reps`` single-threaded 192x192 matrix products, started at ``start``."""
    import time

    import torch

    reps, start = args
    torch.set_num_threads(1)
    a = torch.randn(192, 192)
    while time.time() < start:
        time.sleep(0.001)
    t = time.perf_counter()
    for _ in range(reps):
        a = torch.tanh(a @ a)
    return time.perf_counter() - t


def effective_cores(max_procs: int = 4, reps: int = BURN_REPS, trials: int = 3) -> float:
    """How many single-threaded ranks this machine runs at full speed right now: the median
    over trials and k = 2..max_procs of ``k * t1 / tk`` (``tk``: one rank's time with k
    running at once)."""
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    ratios = []
    with ctx.Pool(max_procs) as pool:
        pool.map(_burn, [(10, 0.0)] * max_procs)  # start the workers
        for _ in range(trials):
            times = {}
            for k in range(1, max_procs + 1):
                start = time.time() + 0.2
                times[k] = float(np.median(pool.map(_burn, [(reps, start)] * k)))
            ratios += [k * times[1] / times[k] for k in range(2, max_procs + 1)]
    return float(np.median(ratios))


def measure_emulated(
    rate: str, repeats: int = 5, sizes: Sequence[int] = LINK_SIZES, timeout: float = 300
) -> dict[str, Any]:
    """The probe's report from two emulated nodes of two ranks at ``rate`` (needs root)."""
    probe = Path(__file__).with_name("probe.py")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        cmd = [
            sys.executable, "-m", "longboat", "emulate", "--nodes", "2", "--nproc-per-node", "2",
            "--bandwidth", rate, "--timeout", str(timeout), "--log-dir", str(Path(tmp) / "logs"),
            str(probe), str(out), ",".join(str(s) for s in sizes), str(repeats),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode or not out.exists():
            tail = (proc.stdout + proc.stderr)[-2000:]
            raise RuntimeError(f"emulated calibration failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())


def with_emulated_link(local: Cluster, report: Mapping[str, Any], rate: str) -> Cluster:
    """``local`` as two nodes joined by the measured emulated link (fitted, see the module)."""
    import dataclasses

    tc_rate = parse_rate(rate) / 8  # read as `longboat emulate` and tc read it
    a, b = fit({int(s): t for s, t in report["link"].items()})
    inter = Link(tc_rate, a / 2, "net", 1, min(1.0, 1 / b / tc_rate))
    per = int(report["world"]) // int(report["nodes"])
    cluster = dataclasses.replace(local, nodes=2, devices_per_node=per, inter=inter)
    if report.get("burn"):
        alone = min(_burn((BURN_REPS, 0.0)) for _ in range(5))
        together = float(np.median(list(report["burn"].values())))
        cores = min(float(os.cpu_count() or 1), len(report["burn"]) * alone / together)
        cluster = dataclasses.replace(cluster, shared_host_cores=cores)
    algorithms = dict(cluster.algorithms)
    if report.get("hierarchical"):
        ah, bh = fit({int(s): t for s, t in report["hierarchical"].items()})
        small, large = 1 << 20, 4 << 20
        m_small = sum(cost.allreduce(small, cluster, "hierarchical"))
        m_large = sum(cost.allreduce(large, cluster, "hierarchical"))
        slope = (m_large - m_small) / (large - small)
        algorithms["hierarchical"] = AlgorithmCost(
            slope / bh, max(0.0, ah - (m_small - slope * small))
        )
    return dataclasses.replace(cluster, algorithms=algorithms)


def calibrate(nproc: int = 2, emulate_rate: str | None = None, repeats: int = 5) -> Cluster:
    """Measure and fit; the result is a cluster of this machine (two emulated nodes with
    ``emulate_rate``)."""
    from longboat.sim import calibrate_fsdp

    local = local_cluster(measure_local(nproc, repeats))
    local = calibrate_fsdp.with_fsdp2(local, calibrate_fsdp.measure(nproc, repeats))
    if emulate_rate is None:
        return local
    return with_emulated_link(local, measure_emulated(emulate_rate, repeats), emulate_rate)
