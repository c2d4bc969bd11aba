"""`longboat.sim`: predict step time, scaling efficiency and the best Strategy of a model on a
cluster of up to thousands of devices, from a profile measured here (see docs/sim.md).

    from longboat import sim
    prof = sim.profile_model("resnet")                       # or sim.load_profile("p.json")
    cluster = sim.load_cluster("cluster.yaml")               # or sim.Cluster(...)
    cluster = sim.fit.calibrated(prof, cluster, 0.104)       # one GPU's measured step (optional)
    sim.simulate(prof, cluster, lb.Strategy(nccl_comm_num=2))  # -> Prediction
    sim.sweep(prof, cluster)                                 # N = 1, 2, 4, ... devices
    sim.recommend(prof, cluster)[0].strategy                 # fastest settings found
"""

from __future__ import annotations

from typing import Any

from longboat.sim import fit
from longboat.sim.calibrate import calibrate
from longboat.sim.cluster import AlgorithmCost, Cluster, ClusterError, Link, PsServers
from longboat.sim.cluster import from_dict as cluster_from_dict
from longboat.sim.cluster import load as load_cluster
from longboat.sim.predict import Prediction, simulate
from longboat.sim.profile import Param, Profile, ProfileError
from longboat.sim.profile import load as load_profile
from longboat.sim.recommend import Choice, recommend, to_yaml
from longboat.sim.sweep import Point, plot, sweep


def profile_model(
    model: str, batch: int | None = None, input_shape: list[int] | None = None, **kw: Any
) -> Profile:
    """Measure ``model`` (a bench model name or ``pkg.module:factory``) on this machine."""
    from longboat.sim import measure

    name, module, sample = measure.load_model(model, batch, input_shape)
    return measure.measure(name, module, sample, **kw)


__all__ = [
    "AlgorithmCost",
    "Choice",
    "Cluster",
    "ClusterError",
    "Link",
    "Param",
    "Point",
    "Prediction",
    "Profile",
    "ProfileError",
    "PsServers",
    "calibrate",
    "cluster_from_dict",
    "fit",
    "load_cluster",
    "load_profile",
    "plot",
    "profile_model",
    "recommend",
    "simulate",
    "sweep",
    "to_yaml",
]
