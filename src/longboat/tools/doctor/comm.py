"""``--comm``: pairwise connectivity and bandwidth between nodes (ranks, on one node), under
the launcher."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping
from typing import Any

from longboat.tools.doctor.checks import FAIL, PASS, WARN, Check
from longboat.tools.doctor.fixes import fix_text


def comm_checks(
    size_bytes: int = 16 << 20, repeats: int = 3, timeout_s: float = 60.0
) -> list[Check]:
    """Every pair of nodes (of ranks, on one node): one small and timed large allreduces.

    Collective: every rank calls it. Returns the checks on rank 0, [] elsewhere.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import longboat as lb
    from longboat.comm.exchange import allgather_bytes

    lb.init()
    topo = lb.topology()
    per_node = topo.nodes > 1
    units = topo.leaders() if per_node else list(range(lb.world_size()))
    label = (lambda r: f"node {topo.node_of[r]}") if per_node else (lambda r: f"rank {r}")
    me = lb.rank()
    results: dict[str, dict[str, Any]] = {}
    for i, a in enumerate(units):
        for b in units[i + 1 :]:
            key = f"{label(a)} <-> {label(b)}"
            group = dist.new_group([a, b], timeout=timedelta(seconds=timeout_s))
            if me in (a, b):
                results[key] = _measure_pair(group, size_bytes, repeats, torch)
            dist.barrier()
    gathered = allgather_bytes(json.dumps(results).encode())  # JSON bytes: nothing unpickled
    if me != 0:
        return []
    merged: dict[str, dict[str, Any]] = {}
    for part in gathered:
        merged.update(json.loads(part))
    return pair_checks(merged, size_bytes)


def _measure_pair(group: Any, size_bytes: int, repeats: int, torch: Any) -> dict[str, Any]:
    import torch.distributed as dist

    try:
        dist.all_reduce(torch.ones(1), group=group)
        tensor = torch.ones(size_bytes // 4)
        dist.all_reduce(tensor, group=group)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            times.append(time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - reported as an unreachable pair
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    seconds = statistics.median(times)
    return {"ok": True, "seconds": seconds, "gbps": size_bytes / seconds / 1e9}


def pair_checks(pairs: Mapping[str, Mapping[str, Any]], size_bytes: int) -> list[Check]:
    """PASS/WARN/FAIL per pair; a pair below half the median bandwidth is slow, and a member
    common to every slow pair is named as the slow node."""
    rates = [p["gbps"] for p in pairs.values() if p.get("ok")]
    median = statistics.median(rates) if rates else 0.0
    checks: list[Check] = []
    slow: list[set[str]] = []
    for key, p in pairs.items():
        if not p.get("ok"):
            checks.append(
                Check(
                    f"link {key}",
                    FAIL,
                    f"unreachable: {p['error']}",
                    fix_text("unreachable pair"),
                    dict(p),
                )
            )
            continue
        text = (
            f"allreduce of {size_bytes >> 20} MB: {p['seconds'] * 1e3:.1f} ms, "
            f"algbw = busbw {p['gbps']:.2f} GB/s (2 ranks)"
        )
        if len(rates) > 1 and p["gbps"] < 0.5 * median:
            slow.append(set(key.split(" <-> ")))
            checks.append(
                Check(
                    f"link {key}",
                    WARN,
                    f"{text}: below half the median {median:.2f} GB/s",
                    fix_text("slow pair"),
                    dict(p),
                )
            )
        else:
            checks.append(Check(f"link {key}", PASS, text, data=dict(p)))
    if slow:
        common = set.intersection(*slow)
        if common and len(pairs) > len(slow):
            checks.append(
                Check(
                    "slow node",
                    WARN,
                    f"{', '.join(sorted(common))} is in every slow pair",
                    fix_text("slow node"),
                )
            )
    return checks
