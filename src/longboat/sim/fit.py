"""Calibrate a GPU cluster from measured step times: the compute efficiency from one device's
step, the contention from a step on several devices.

One device's predicted step is ``A / efficiency + B``: ``A`` the profile's FLOPs over the
device's peak in the step's precision, ``B`` what does not scale with efficiency (per-layer
launch costs and the memory-bound optimizer, per micro-step). Two predictions give ``A`` and
``B``; the measured step then gives ``efficiency = A / (measured - B)``. Everything else in a
multi-device prediction (links, NCCL, contention, stragglers) is left as described.

The contention (how much collectives slow the backward they overlap) is what a measured step on
N devices adds to the prediction with everything else fixed: the predicted step grows with it,
so bisection finds the value that reproduces the measurement.
"""

from __future__ import annotations

import dataclasses

from longboat.sim.cluster import Cluster, ClusterError
from longboat.sim.predict import simulate
from longboat.sim.profile import Profile
from longboat.strategy import Strategy


def compute_efficiency(
    profile: Profile, cluster: Cluster, step_s: float, strategy: Strategy | None = None
) -> float:
    """The ``compute.efficiency`` with which one device of ``cluster`` takes ``step_s`` seconds
    per step of ``profile`` (at the profile's batch) under ``strategy``."""
    if not cluster.is_gpu:
        raise ClusterError(
            f"a measured step calibrates a GPU's compute efficiency; device {cluster.device!r} "
            "uses the profile's own times (profile on the target machine instead)"
        )
    if not step_s > 0:
        raise ClusterError(f"measured step must be a positive time, got {step_s!r}")
    one = cluster.with_devices(1).without_input()
    full = simulate(profile, dataclasses.replace(one, compute_efficiency=1.0), strategy).step_s
    half = simulate(profile, dataclasses.replace(one, compute_efficiency=0.5), strategy).step_s
    scaled, fixed = half - full, 2 * full - half
    if step_s <= fixed:
        raise ClusterError(
            f"measured step {step_s * 1e3:.4g} ms is shorter than what does not depend on compute "
            f"efficiency ({fixed * 1e3:.4g} ms: launches and optimizer); check the batch, "
            "the device's memory bandwidth and optimizer_bytes_per_param"
        )
    efficiency = scaled / (step_s - fixed)
    if efficiency > 1:
        raise ClusterError(
            f"measured step {step_s * 1e3:.4g} ms needs {efficiency:.0%} of the device's peak; "
            "check the device, its precision (tf32? amp?) and the profile's FLOPs and batch"
        )
    return efficiency


def calibrated(
    profile: Profile, cluster: Cluster, step_s: float, strategy: Strategy | None = None
) -> Cluster:
    """``cluster`` with the compute efficiency that reproduces ``step_s`` on one device."""
    efficiency = compute_efficiency(profile, cluster, step_s, strategy)
    return dataclasses.replace(cluster, compute_efficiency=efficiency)


#: The largest contention `contention` fits: backward three times as slow beside collectives.
MAX_CONTENTION = 3.0


def contention(
    profile: Profile, cluster: Cluster, step_s: float, strategy: Strategy | None = None
) -> float:
    """The ``compute.contention`` with which all devices of ``cluster`` take ``step_s`` seconds
    per step: found by bisection, as the predicted step grows with it. Everything else (the
    compute efficiency, links, stragglers) stays as described, so fit the efficiency first.

    Refused when the Strategy's collectives do not overlap backward (contention cannot
    change the step), when the measured step is faster than the prediction without contention
    or slower than with ``MAX_CONTENTION``: the difference is then not contention."""
    if cluster.world < 2:
        raise ClusterError("a measured step calibrates contention on 2 or more devices")
    if not step_s > 0:
        raise ClusterError(f"measured step must be a positive time, got {step_s!r}")

    def step(value: float) -> float:
        trial = dataclasses.replace(cluster, contention=value)
        return simulate(profile, trial, strategy).step_s

    where = f"{cluster.world} {cluster.device} devices"
    low, high = step(0.0), step(MAX_CONTENTION)
    measured, without = step_s * 1e3, low * 1e3
    if high <= low * (1 + 1e-9):
        raise ClusterError(
            f"on {where} no collective overlaps backward, so contention cannot change the "
            f"step (predicted {without:.4g} ms, measured {measured:.4g} ms); the difference "
            "is something else: links, stragglers, the host"
        )
    if step_s < low:
        raise ClusterError(
            f"measured step {measured:.4g} ms on {where} is faster than predicted without any "
            f"contention ({without:.4g} ms); check the links (bandwidth, efficiency), the "
            "compute efficiency (--measured-step on one device) and the batch"
        )
    if step_s > high:
        raise ClusterError(
            f"measured step {measured:.4g} ms on {where} is slower than predicted even with "
            f"contention {MAX_CONTENTION:g} ({high * 1e3:.4g} ms): collectives slowing backward "
            "do not explain it; check the links, the input pipeline and stragglers"
        )
    lo, hi = 0.0, MAX_CONTENTION
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < step_s else (lo, mid)
    return (lo + hi) / 2


def calibrated_contention(
    profile: Profile, cluster: Cluster, step_s: float, strategy: Strategy | None = None
) -> Cluster:
    """``cluster`` with the contention that reproduces ``step_s`` on all its devices."""
    value = contention(profile, cluster, step_s, strategy)
    return dataclasses.replace(cluster, contention=value)
