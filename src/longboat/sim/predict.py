"""Predict one training step of a profile on a cluster under a Strategy.

Collective mode: backward produces the gradients at the profiled times; the real bucket plan
(`longboat.collective.buckets.plan_buckets`, with the Strategy's caps; settings chosen by the
topology rule are resolved for the cluster, see `comm_settings`) groups them; each bucket
is launched when its last gradient is ready (in plan order) on the communicator the
reducer gives it (`longboat.collective.buckets.assign_communicators`) and costed by
`longboat.sim.compression` / `longboat.sim.cost`; the timeline (`longboat.sim.timeline`) overlaps it with the rest of backward. The step is
``forward + max(backward, last collective) + optimizer``. Gradient merge runs k-1 micro-steps
without communication; local SGD averages all parameters (not overlapped) every k steps.
Parameter-server mode is `longboat.sim.ps`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from longboat.cluster.topology import comm_defaults
from longboat.collective.buckets import assign_communicators, plan_buckets
from longboat.sim import cost, devices
from longboat.sim.cluster import Cluster
from longboat.sim.compression import bucket_parts
from longboat.sim.profile import Profile
from longboat.sim.timeline import Job, finish_times
from longboat.strategy import Strategy
from longboat.strategy.selection import (
    TOPOLOGY,
    compressor_config,
    selected_algorithm,
    selected_compressor,
)


@dataclass(frozen=True)
class Prediction:
    """One step (one forward/backward of a rank's batch), averaged over merge/local-SGD cycles."""

    devices: int
    nodes: int
    step_s: float
    samples_per_s: float
    compute_s: float
    exposed_comm_s: float
    optimizer_s: float
    comm_s: float  # link+latency time of the step's collectives, overlapped or not
    buckets: int
    bytes_sent: int  # per rank and step
    algorithm: str
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def overlap(self) -> float:
        """Fraction of the communication hidden behind backward."""
        return 1.0 - self.exposed_comm_s / self.comm_s if self.comm_s > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self) | {"overlap": self.overlap}


@dataclass(frozen=True)
class CommSettings:
    """The allreduce algorithm, bucket cap and communicator count a job runs with."""

    algorithm: str
    cap_mb: float
    comms: int


def comm_settings(strategy: Strategy, cluster: Cluster) -> CommSettings:
    """What the engine runs ``strategy`` with on ``cluster``: ``allreduce_algorithm='topology'``
    and a bucket cap or communicator count left at its default follow the topology rule
    (`longboat.cluster.topology.comm_defaults`) of the cluster's placement and backend."""
    node_of = [rank // cluster.devices_per_node for rank in range(cluster.world)]
    rule = comm_defaults(node_of, "gloo" if cluster.device == "cpu" else "nccl")
    algorithm = selected_algorithm(strategy)
    if strategy.allreduce_algorithm == TOPOLOGY and not strategy.use_hierarchical_allreduce:
        algorithm = rule.algorithm  # the rule of this cluster, not of a live one in this process
    by_rule = {
        field: getattr(rule if strategy.source(field) == "default" else strategy, field)
        for field in ("fuse_grad_size_in_MB", "nccl_comm_num")
    }
    return CommSettings(
        algorithm, float(by_rule["fuse_grad_size_in_MB"]), int(by_rule["nccl_comm_num"])
    )


def device_profile(profile: Profile, cluster: Cluster, amp: bool) -> Profile:
    """The profile's times on the cluster's devices (see `longboat.sim.devices`)."""
    if cluster.device == "cpu":
        factor = 1.0
        if cluster.shared_host_cores:
            busy = cluster.world * profile.threads
            factor = max(1.0, busy / cluster.shared_host_cores)
        return profile.scaled(factor) if factor != 1.0 else profile
    if profile.flops <= 0:
        raise ValueError(
            f"profile of {profile.model} has no FLOP count; re-run `longboat sim profile` "
            "or simulate with device: cpu"
        )
    device = devices.get(cluster.device)
    layers = len({p.layer for p in profile.params}) or 1
    seconds = devices.compute_seconds(
        profile.flops, layers, device, cluster.compute_efficiency, amp
    )
    return profile.scaled(
        seconds / profile.compute_s, devices.optimizer_seconds(profile.param_count, device)
    )


def flop_rate(profile: Profile, cluster: Cluster) -> float:
    """FLOP/s the compute reaches (PowerSGD's matrix products run at this rate)."""
    if cluster.device != "cpu":
        return devices.get(cluster.device).fp32_flops * cluster.compute_efficiency
    return profile.flops / profile.compute_s if profile.flops > 0 else 1e10


def compression_of(strategy: Strategy) -> tuple[str, dict[str, Any]]:
    """The compressor the engine would use for ``strategy``, and its settings."""
    entry = selected_compressor(strategy)
    return entry.name, compressor_config(strategy, entry)


def _result(cluster: Cluster, batch: int, step: float, **kw: Any) -> Prediction:
    return Prediction(
        devices=cluster.world,
        nodes=cluster.nodes,
        step_s=step,
        samples_per_s=batch * cluster.world / step,
        **kw,
    )


def simulate(profile: Profile, cluster: Cluster, strategy: Strategy | None = None) -> Prediction:
    """Predict one step of ``profile`` on ``cluster`` under ``strategy`` (default Strategy)."""
    strategy = strategy if strategy is not None else Strategy()
    if strategy.mode == "ps":
        from longboat.sim.ps import simulate_ps

        return simulate_ps(profile, cluster, strategy)
    prof = device_profile(profile, cluster, bool(strategy.amp))
    fwd, bwd, opt = prof.forward_s, prof.backward_s, prof.optimizer_s
    settings = comm_settings(strategy, cluster)
    algorithm = settings.algorithm
    notes: list[str] = []
    if algorithm == "shm" and cluster.nodes > 1:
        raise cost.CostError("allreduce_algorithm='shm' works on one node only")
    if strategy.localsgd or strategy.adaptive_localsgd:
        k = int(
            strategy.localsgd_configs["k_steps"]
            if strategy.localsgd
            else strategy.adaptive_localsgd_configs["init_k_steps"]
        )
        algo = cost.best_algorithm(prof.grad_bytes, cluster) if algorithm == "auto" else algorithm
        lat, bw = cost.allreduce(prof.grad_bytes, cluster, algo)
        average = (lat + bw + 2 * prof.grad_bytes / cluster.mem_bw) if cluster.world > 1 else 0.0
        n = cluster.world
        sent = int(2 * (n - 1) / n * prof.grad_bytes) if n > 1 else 0
        return _result(
            cluster,
            prof.batch,
            fwd + bwd + opt + average / k,
            compute_s=fwd + bwd,
            exposed_comm_s=average / k,
            optimizer_s=opt,
            comm_s=average / k,
            buckets=1,
            bytes_sent=sent // k,
            algorithm=algo,
            notes=(f"local SGD: parameters averaged every {k} steps",),
        )
    merge = int(strategy.gradient_merge_configs["k_steps"]) if strategy.gradient_merge else 1
    plan = plan_buckets(
        prof.grad_specs(),
        fuse=bool(strategy.fuse_all_reduce_ops),
        cap_mb=settings.cap_mb,
        max_layers=int(strategy.fuse_grad_size_in_TFLOPS),
        last_cap_mb=float(strategy.last_comm_group_size_MB),
    )
    compression, config = compression_of(strategy)
    comms = settings.comms
    rate = flop_rate(profile, cluster)
    copy_s = 2 * prof.grad_bytes / cluster.mem_bw if cluster.world > 1 else 0.0
    jobs, sent, total, chosen = [], 0, 0.0, set()
    on_comm = assign_communicators(
        [sum(prof.params[i].nbytes for i in members) for members in plan.buckets], comms
    )
    for b, members in enumerate(plan.buckets):
        params = [prof.params[i] for i in members]
        extra = 4 * len(prof.params) if b == len(plan.buckets) - 1 else 0
        algo = algorithm
        if algorithm == "auto":
            algo = cost.best_algorithm(sum(p.nbytes for p in params), cluster)
        chosen.add(algo)
        (lat, bw), nbytes = bucket_parts(params, extra, cluster, algo, compression, config, rate)
        ready = max(p.ready_s for p in params) + copy_s * (b + 1) / len(plan.buckets)
        jobs.append(Job(ready, on_comm[b], lat, bw))
        sent += nbytes
        total += lat + bw
    finishes = finish_times(jobs) if cluster.world > 1 else [0.0]
    backward = bwd + copy_s
    exposed = max(0.0, max(finishes) - backward) if cluster.world > 1 else 0.0
    cycle = merge * (fwd + bwd) + copy_s + exposed + opt
    if merge > 1:
        notes.append(f"gradient merge: one allreduce every {merge} micro-steps")
    if compression != "none":
        notes.append(f"compression {compression}")
    return _result(
        cluster,
        prof.batch,
        cycle / merge,
        compute_s=fwd + bwd + copy_s / merge,
        exposed_comm_s=exposed / merge,
        optimizer_s=opt / merge,
        comm_s=total / merge,
        buckets=len(plan.buckets),
        bytes_sent=sent // merge,
        algorithm="+".join(sorted(chosen)),
        notes=tuple(notes),
    )


def single_device_step(
    profile: Profile, cluster: Cluster, strategy: Strategy | None = None
) -> float:
    """The step time on one device of the cluster: the efficiency baseline."""
    return simulate(profile, cluster.with_devices(1), strategy).step_s
