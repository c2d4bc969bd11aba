"""Predict one training step of a profile on a cluster under a Strategy.

Collective mode: backward produces the gradients at the profiled times; the real bucket plan
(`longboat.collective.buckets.plan_buckets`, with the Strategy's caps; settings chosen by the
topology rule are resolved for the cluster, see `collective_plan`) groups them; each bucket
is launched when its last gradient is ready (in plan order) on the communicator the
reducer gives it (`longboat.collective.buckets.assign_communicators`) and costed by
`longboat.sim.compression` / `longboat.sim.cost`; the timeline (`longboat.sim.timeline`)
overlaps it with the rest of backward. The step is
``forward + max(backward, last collective) + optimizer``. Gradient merge runs k-1 micro-steps
without communication; local SGD averages all parameters (not overlapped) every k steps.
Sharding stages 1 and 2 are `longboat.sim.sharding`, stage 3 (FSDP2) `longboat.sim.stage3`,
parameter-server mode `longboat.sim.ps`.

What else a synchronous step loses on GPUs (each 0 unless the cluster sets or implies it):

* contention: while collectives run, the backward computing beside them is slowed by the factor
  ``1 + contention`` (NCCL's kernels take SMs and memory bandwidth, see `default_contention`);
* stragglers: every rank waits for the slowest (`longboat.sim.straggler`), ``jitter`` being the
  coefficient of variation of one rank's compute per step and ``device_spread`` that of the
  devices' persistent speeds;
* input: a node's input pipeline delivering ``input.samples_per_s`` (or ``input.workers`` loader
  processes of ``worker_samples_per_s`` each) bounds the step from below at
  ``batch * ranks per node / samples_per_s``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

from longboat.collective.buckets import assign_communicators, plan_buckets
from longboat.collective.plan import TOPOLOGY, CollectivePlan, Placement, resolve_compression
from longboat.collective.plan import resolve as resolve_plan
from longboat.sim import cost, devices
from longboat.sim.cluster import Cluster, ClusterError
from longboat.sim.compression import bucket_parts, unpriced_note
from longboat.sim.profile import Profile
from longboat.sim.sharding import Sharded, memory_per_rank, sharded
from longboat.sim.straggler import spread_seconds, straggler_seconds
from longboat.sim.timeline import Job, busy_before, finish_times
from longboat.strategy import Strategy


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
    straggler_s: float = 0.0  # waiting for the slowest rank, per step
    contention_s: float = 0.0  # backward slowed by the collectives beside it, per step
    input_wait_s: float = 0.0  # waiting for the input pipeline, per step
    host_overhead_s: float = 0.0  # the sharding engine's own host work (FSDP2 on CPU ranks)
    memory: dict[str, int] = field(default_factory=dict)  # bytes per rank (`sim.sharding`)

    @property
    def overlap(self) -> float:
        """Fraction of the communication hidden behind backward."""
        return 1.0 - self.exposed_comm_s / self.comm_s if self.comm_s > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self) | {"overlap": self.overlap}


def collective_plan(strategy: Strategy, cluster: Cluster) -> CollectivePlan:
    """What the engine runs ``strategy`` with on ``cluster``: the Strategy resolved on the
    cluster's placement and backend (`longboat.collective.plan.resolve`, the engine's own
    resolution), except that a topology-chosen ``shm`` becomes ``native`` where the cost model
    has no host link between the ranks."""
    node_of = [rank // cluster.devices_per_node for rank in range(cluster.world)]
    plan = resolve_plan(strategy, Placement.of(node_of, cluster.resolved_backend()))
    by_topology = strategy.allreduce_algorithm == TOPOLOGY
    chosen = plan.comm.algorithm
    if (
        by_topology
        and not strategy.use_hierarchical_allreduce
        and not cost.applicable(chosen, cluster)
    ):  # Gloo's shared-memory rule on ranks without a host link
        plan = replace(plan, comm=replace(plan.comm, algorithm="native"))
    return plan


#: Coefficient of variation of one rank's compute per step on a GPU when the cluster does not
#: set ``compute.jitter`` (see docs/sim.md: where it comes from and how to measure it).
DEFAULT_GPU_JITTER = 0.01
#: Coefficient of variation of GPUs' persistent speeds (same model, same settings) when the
#: cluster does not set ``compute.device_spread``: Sinha et al., SC22 (see docs/sim.md).
DEFAULT_GPU_SPREAD = 0.011
#: Share of backward time bound by memory bandwidth (for the default contention).
MEMORY_BOUND_SHARE = 0.5
#: Device-memory bytes a collective moves per byte on the bus (read own chunk, read the
#: received one, write the sum).
MEMORY_BYTES_PER_BUS_BYTE = 3.0


def resolve(cluster: Cluster, profile: Profile) -> Cluster:
    """``cluster`` with its backend resolved for ``profile`` (see `Cluster.resolved_backend`);
    a GPU profile taken as measured (``device: profiled``) on NCCL needs its links and memory
    bandwidth described, since there is no device table to take them from."""
    backend = cluster.resolved_backend(profile.device)
    if cluster.device == "profiled" and backend == "nccl":
        if cluster.intra.kind in ("shm", "loopback"):
            raise ClusterError(
                "device: profiled with NCCL needs the GPUs' intra-node link: "
                "intra: {kind: nvlink|nvswitch|pcie, links: N | bandwidth: RATE}"
            )
        if not cluster.memory_bandwidth:
            raise ClusterError(
                "device: profiled with NCCL needs memory_bandwidth (the GPU's, e.g. 2039GB/s)"
            )
    return cluster if backend == cluster.backend else dataclasses.replace(cluster, backend=backend)


def precision(strategy: Strategy, cluster: Cluster) -> str:
    """What the step computes in: fp16/bf16 under AMP (amp_configs' dtype), else the
    cluster's fp32 or tf32."""
    if strategy.amp:
        return "bf16" if strategy.amp_configs.get("dtype") == "bfloat16" else "fp16"
    return cluster.precision


def device_profile(profile: Profile, cluster: Cluster, strategy: Strategy | None = None) -> Profile:
    """The profile's times on the cluster's devices (see `longboat.sim.devices`)."""
    strategy = strategy if strategy is not None else Strategy()
    if not cluster.is_gpu:
        factor = 1.0
        if cluster.shared_host_cores:
            busy = cluster.world * profile.threads
            factor = max(1.0, busy / cluster.shared_host_cores)
        return profile.scaled(factor) if factor != 1.0 else profile
    if profile.flops <= 0:
        raise ValueError(
            f"profile of {profile.model} has no FLOP count; re-run `longboat sim profile` "
            "or simulate with device: profiled"
        )
    spec = cluster.spec
    layers = len({p.layer for p in profile.params}) or 1
    seconds = devices.compute_seconds(
        profile.flops, layers, spec, cluster.compute_efficiency, precision(strategy, cluster)
    )
    return profile.scaled(
        seconds / profile.compute_s,
        devices.optimizer_seconds(profile.param_count, spec, cluster.optimizer_bytes),
    )


def flop_rate(profile: Profile, cluster: Cluster) -> float:
    """FLOP/s the compute reaches (PowerSGD's matrix products run at this rate)."""
    if cluster.is_gpu:
        return cluster.spec.peak("fp32") * cluster.compute_efficiency
    return profile.flops / profile.compute_s if profile.flops > 0 else 1e10


def default_contention(cluster: Cluster) -> float:
    """The slowdown of compute while an NCCL allreduce runs beside it, from the device's
    figures: the SMs NCCL's channels occupy (one thread block each) plus, for the memory-bound
    share of backward, the device-memory bandwidth the collective consumes
    (``MEMORY_BYTES_PER_BUS_BYTE`` x bus bandwidth). 0 without NCCL or device figures."""
    if cluster.resolved_backend() != "nccl" or not cluster.is_gpu or cluster.world <= 1:
        return 0.0
    spec, fabric = cluster.spec, cost.fabric(cluster)
    sms = fabric.channels / spec.sms if spec.sms else 0.0
    memory = MEMORY_BYTES_PER_BUS_BYTE * fabric.bus_bw / cluster.mem_bw
    return sms + MEMORY_BOUND_SHARE * min(memory, 1.0)


def contention_of(cluster: Cluster) -> float:
    return cluster.contention if cluster.contention is not None else default_contention(cluster)


def jitter_of(cluster: Cluster) -> float:
    if cluster.jitter is not None:
        return cluster.jitter
    return DEFAULT_GPU_JITTER if cluster.resolved_backend() == "nccl" else 0.0


def spread_of(cluster: Cluster) -> float:
    if cluster.device_spread is not None:
        return cluster.device_spread
    return DEFAULT_GPU_SPREAD if cluster.resolved_backend() == "nccl" else 0.0


def _finish(
    cluster: Cluster,
    prof: Profile,
    step: float,
    micro_steps: int,
    **kw: Any,
) -> Prediction:
    """The prediction of one micro-step of ``step`` seconds, with the wait for the slowest rank
    (per-step jitter and the devices' persistent spread) and for the input pipeline added."""
    straggle = straggler_seconds(prof.compute_s, jitter_of(cluster), cluster.world, micro_steps)
    straggle += spread_seconds(prof.compute_s, spread_of(cluster), cluster.world)
    step += straggle
    wait = 0.0
    rate = cluster.node_input_rate
    if rate:
        needed = prof.batch * cluster.devices_per_node / rate
        wait = max(0.0, needed - step)
        step += wait
    return Prediction(
        devices=cluster.world,
        nodes=cluster.nodes,
        step_s=step,
        samples_per_s=prof.batch * cluster.world / step,
        straggler_s=straggle,
        input_wait_s=wait,
        **kw,
    )


def _timeline(
    jobs: list[Job], backward: float, contention: float
) -> tuple[list[float], float, float]:
    """Finish times, the backward's end and the seconds contention added to it: backward is
    stretched by ``contention`` x the share of it that collectives overlapped, and the buckets'
    ready times with it (one fixed-point step)."""
    finishes = finish_times(jobs)
    if contention <= 0 or backward <= 0:
        return finishes, backward, 0.0
    stretch = 1 + contention * busy_before(jobs, backward) / backward
    if stretch == 1:
        return finishes, backward, 0.0
    stretched = [dataclasses.replace(j, ready=j.ready * stretch) for j in jobs]
    return finish_times(stretched), backward * stretch, backward * (stretch - 1)


def _local_sgd_step(prof: Profile, cluster: Cluster, algorithm: str, k: int) -> Prediction:
    """Local SGD: no gradient exchange; all parameters averaged (one allreduce, not
    overlapped) every ``k`` steps."""
    fwd, bwd, opt = prof.forward_s, prof.backward_s, prof.optimizer_s
    algo = cost.best_algorithm(prof.grad_bytes, cluster) if algorithm == "auto" else algorithm
    lat, bw = cost.allreduce(prof.grad_bytes, cluster, algo)
    average = (lat + bw + 2 * prof.grad_bytes / cluster.mem_bw) if cluster.world > 1 else 0.0
    n = cluster.world
    sent = int(2 * (n - 1) / n * prof.grad_bytes) if n > 1 else 0
    return _finish(
        cluster,
        prof,
        fwd + bwd + opt + average / k,
        k,
        compute_s=fwd + bwd,
        exposed_comm_s=average / k,
        optimizer_s=opt,
        comm_s=average / k,
        buckets=1,
        bytes_sent=sent // k,
        algorithm=algo,
        notes=(f"local SGD: parameters averaged every {k} steps",),
    )


def _bucket_jobs(
    prof: Profile,
    cluster: Cluster,
    plan: CollectivePlan,
    buckets: list[list[int]],
    shard: Sharded | None,
    rate: float,
) -> tuple[list[Job], int, float, set[str], float]:
    """Each bucket's collective as a timeline job (ready when its last gradient is, plus its
    share of the bucket copies); the bytes sent, the time on the links, the algorithms, the
    bytes of compressor state kept per rank."""
    compression, config = plan.compression.name, dict(plan.compression.config)
    algorithm = plan.comm.algorithm
    copy_s = 2 * prof.grad_bytes / cluster.mem_bw if cluster.world > 1 else 0.0
    jobs, sent, total, chosen, state = [], 0, 0.0, set(), 0.0
    on_comm = assign_communicators(
        [sum(prof.params[i].nbytes for i in members) for members in buckets],
        plan.comm.communicators,
    )
    for b, members in enumerate(buckets):
        params = [prof.params[i] for i in members]
        extra = 4 * len(prof.params) if b == len(buckets) - 1 else 0
        algo = algorithm
        if algorithm == "auto":
            algo = cost.best_algorithm(sum(p.nbytes for p in params), cluster)
        chosen.add(algo)
        priced = bucket_parts(params, extra, cluster, algo, compression, config, rate)
        (lat, bw), nbytes = priced.parts, priced.sent
        state += priced.state
        if shard is not None:
            (lat, bw), nbytes = shard.collective((lat, bw)), shard.sent(nbytes)
        ready = max(p.ready_s for p in params) + copy_s * (b + 1) / len(buckets)
        jobs.append(Job(ready, on_comm[b], lat, bw))
        sent += nbytes
        total += lat + bw
    return jobs, sent, total, chosen, state


def simulate(profile: Profile, cluster: Cluster, strategy: Strategy | None = None) -> Prediction:
    """Predict one step of ``profile`` on ``cluster`` under ``strategy`` (default Strategy)."""
    strategy = strategy if strategy is not None else Strategy()
    cluster = resolve(cluster, profile)
    if strategy.mode == "ps":
        from longboat.sim.ps import simulate_ps

        return simulate_ps(profile, cluster, strategy)
    prof = device_profile(profile, cluster, strategy)
    fwd, bwd, opt = prof.forward_s, prof.backward_s, prof.optimizer_s
    plan = collective_plan(strategy, cluster)
    algorithm = plan.comm.algorithm
    notes: list[str] = []
    if algorithm == "shm" and cluster.nodes > 1:
        raise cost.CostError("allreduce_algorithm='shm' works on one node only")
    if plan.local_sgd is not None:
        return _local_sgd_step(prof, cluster, algorithm, int(plan.local_sgd.k_steps))
    if plan.sharding is not None and plan.sharding.stage == 3 and cluster.world > 1:
        from longboat.sim.stage3 import simulate_stage3

        return simulate_stage3(prof, cluster, plan, notes)
    merge = plan.k_steps
    shard = sharded(plan.sharding, prof, cluster)
    buckets = plan_buckets(
        prof.grad_specs(),
        fuse=plan.comm.fuse,
        cap_mb=plan.comm.bucket_mb,
        max_layers=plan.comm.layers_per_bucket,
        last_cap_mb=plan.comm.last_bucket_mb,
    )
    compression = plan.compression.name
    rate = flop_rate(profile, cluster)
    copy_s = 2 * prof.grad_bytes / cluster.mem_bw if cluster.world > 1 else 0.0
    jobs, sent, total, chosen, state = _bucket_jobs(
        prof, cluster, plan, buckets.buckets, shard, rate
    )
    exposed, contended = 0.0, 0.0
    if cluster.world > 1:
        finishes, backward, contended = _timeline(jobs, bwd + copy_s, contention_of(cluster))
        exposed = max(0.0, max(finishes) - backward)
    if shard is not None:
        opt = shard.optimizer_s(opt)
        sizes = [sum(prof.params[i].nbytes for i in m) for m in reversed(buckets.buckets)]
        exposed += shard.exposed_gather(sizes, fwd)  # the forward reads the last bucket first
        total += sum(shard.gather_s(n) for n in sizes)
        sent += shard.gather_bytes
        notes.append(shard.note())
    cycle = merge * (fwd + bwd) + copy_s + contended + exposed + opt
    if merge > 1:
        notes.append(f"gradient merge: one allreduce every {merge} micro-steps")
    if compression != resolve_compression(Strategy()).name:
        notes.append(f"compression {compression}")
    unpriced = unpriced_note(compression)
    if unpriced is not None:
        notes.append(unpriced)
    memory = memory_per_rank(prof, shard)
    if state:
        memory["compressor_state"] = int(state)
    return _finish(
        cluster,
        prof,
        cycle / merge,
        merge,
        compute_s=fwd + bwd + (copy_s + contended) / merge,
        exposed_comm_s=exposed / merge,
        optimizer_s=opt / merge,
        comm_s=total / merge,
        buckets=len(buckets.buckets),
        bytes_sent=sent // merge,
        algorithm="+".join(sorted(chosen)),
        notes=tuple(notes),
        contention_s=contended / merge,
        memory=memory,
    )


def single_device_step(
    profile: Profile, cluster: Cluster, strategy: Strategy | None = None
) -> float:
    """The step time on one device of the cluster: the efficiency baseline."""
    return simulate(profile, cluster.with_devices(1), strategy).step_s
