"""Calibrate a GPU's compute efficiency from one measured step time on one device.

One device's predicted step is ``A / efficiency + B``: ``A`` the profile's FLOPs over the
device's peak in the step's precision, ``B`` what does not scale with efficiency (per-layer
launch costs and the memory-bound optimizer, per micro-step). Two predictions give ``A`` and
``B``; the measured step then gives ``efficiency = A / (measured - B)``. Everything else in a
multi-device prediction (links, NCCL, contention, stragglers) is left as described.
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
