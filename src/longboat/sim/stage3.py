"""Sharding stage 3 (FSDP2) in the simulator: per unit, the all-gathers, the reduce-scatter and
their overlap with compute; the memory one rank holds.

The units are the engine's own (`longboat.sim.stage3_units`), each with its share of the
forward and backward time (from when its gradients became ready in the profile), the root
(the parameters in no unit) first in forward and last in backward. As torch's FSDP2 runs them:

* forward: each unit all-gathers its parameters before its forward; the root's stay gathered
  until the end of backward (FSDP2 does not reshard the root after forward), every other unit
  is resharded after its forward and gathered again before its backward;
* backward: each unit's gradients are reduce-scattered after its backward (with
  ``sharding_degree`` below the world size, HSDP, then the shard is allreduced across the
  replicas); the optimizer waits for the last;
* overlap, on GPUs: FSDP2 keeps one unit ahead: unit ``i+1``'s all-gather is issued when unit
  ``i``'s compute starts (forward: the host runs ahead of the device; backward: FSDP2's
  explicit prefetch), and a unit's compute waits for its own gather. A rank's collectives run
  one at a time, in the order they are issued (one communicator). On CPU ranks FSDP2 issues
  every collective synchronously (its streams are no-ops there): nothing overlaps, the step
  is compute plus every collective;
* with gradient merge (k micro-steps), every micro-step gathers, only the last reduces.

The gathers send the parameters in AMP's compute dtype (bfloat16), the reduce-scatters the
gradients in the reduce dtype (``fp16_allreduce``/``gradient_compression``; float32 under AMP
alone), each priced by the backend's rule with the cluster's calibrated correction
(`cost.all_gather_tensor`, `cost.reduce_scatter_tensor`). Each gathered or scattered byte also
passes once through device memory (FSDP2's copy-out and copy-in). On CPU ranks FSDP2's own host
work (hooks, DTensors, fresh buffers) adds to the step as the cluster's ``fsdp2`` entry gives it
(`longboat.sim.calibrate_fsdp` measures it). Not priced: contention of collectives with
compute, FSDP2's host work on GPUs, and offload's host-device copies and CPU optimizer step
(named in the prediction's notes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from longboat.collective.plan import CollectivePlan
from longboat.sim import cost
from longboat.sim.cluster import Cluster, Fsdp2Cost
from longboat.sim.profile import Profile
from longboat.sim.sharding import STATE_PER_PARAM
from longboat.sim.stage3_units import unit_params

if TYPE_CHECKING:
    from longboat.sim.predict import Prediction


@dataclass(frozen=True)
class Piece:
    """One unit (or the root) as the step meets it."""

    numel: int
    tensors: int  # parameter tensors
    stored_bytes: int  # its parameters as the profile stores them (the shards' dtype)
    gather_bytes: int  # the whole parameters in the compute dtype
    reduce_bytes: int  # the whole gradients in the reduce dtype
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class Stage3:
    """A stage 3 step's pieces and collectives on one rank."""

    degree: int
    replicas: int
    root: Piece
    units: tuple[Piece, ...]  # forward order
    group: Cluster  # one shard group
    replica_group: Cluster | None  # the ranks holding the same shard (HSDP), or None
    overlap: bool  # GPUs: collectives beside compute; CPU ranks: every collective blocks
    host: Fsdp2Cost | None = None  # FSDP2's calibrated host work (CPU ranks), None: not priced

    def host_s(self, sync: bool) -> float:
        """FSDP2's host work in one micro-step beyond its collectives and copies: on CPU ranks,
        as calibrated (per step, per unit holding parameters, per parameter tensor, per byte
        gathered or scattered); on GPUs it runs ahead of the device and is not priced."""
        if self.overlap or self.host is None:
            return 0.0
        held = [p for p in (self.root, *self.units) if p.numel]
        tensors = sum(p.tensors for p in held)
        return self.host.seconds(len(held), tensors, self.copied_bytes(sync))

    def gather_s(self, piece: Piece) -> float:
        if piece.gather_bytes == 0:
            return 0.0
        return sum(cost.all_gather_tensor(piece.gather_bytes / self.degree, self.group))

    def scatter_s(self, piece: Piece) -> float:
        """The reduce-scatter, then the HSDP allreduce of the shard."""
        if piece.reduce_bytes == 0:
            return 0.0
        seconds = sum(cost.reduce_scatter_tensor(piece.reduce_bytes, self.group))
        if self.replica_group is not None:
            shard = piece.reduce_bytes / self.degree
            seconds += sum(cost.allreduce(shard, self.replica_group))
        return seconds

    def sent_bytes(self, sync: bool) -> float:
        """What this rank sends in one micro-step (``sync``: with the gradients' reduction)."""
        d, r = self.degree, self.replicas
        gathered = self.root.gather_bytes + 2 * sum(u.gather_bytes for u in self.units)
        sent = (d - 1) / d * gathered
        if sync:
            reduced = self.root.reduce_bytes + sum(u.reduce_bytes for u in self.units)
            sent += (d - 1) / d * reduced + 2 * (r - 1) / r * reduced / d
        return sent

    def copied_bytes(self, sync: bool) -> int:
        """Bytes one micro-step moves through memory around its collectives: every gather's
        copy-out of the whole parameters, every reduce-scatter's copy-in of the gradients."""
        pieces = (self.root, *self.units)
        gathered = self.root.gather_bytes + 2 * sum(u.gather_bytes for u in self.units)
        return gathered + (sum(p.reduce_bytes for p in pieces) if sync else 0)

    def comm_s(self, sync: bool) -> float:
        """Link and latency seconds of one micro-step's collectives."""
        total = self.gather_s(self.root) + 2 * sum(self.gather_s(u) for u in self.units)
        if sync:
            total += sum(self.scatter_s(p) for p in (self.root, *self.units))
        return total

    def micro_step_s(self, sync: bool) -> float:
        """Forward and backward of one micro-step, collectives included."""
        forward = [self.root, *self.units]
        backward = [*reversed(self.units), self.root]
        if not self.overlap:
            return sum(p.forward_s + p.backward_s for p in forward) + self.comm_s(sync)
        ends = _timeline(
            [p.forward_s for p in forward],
            [self.gather_s(p) for p in forward],
            [0.0] * len(forward),
        )
        gathers = [self.gather_s(p) for p in backward[:-1]] + [0.0]  # the root stays gathered
        scatters = [self.scatter_s(p) if sync else 0.0 for p in backward]
        return ends + _timeline([p.backward_s for p in backward], gathers, scatters)

    def memory(self, merge: int, offload: bool) -> tuple[dict[str, int], int]:
        """(bytes one rank holds on its device, bytes offloaded to host memory). The shards of
        the parameters, gradients (whole while gradient merge accumulates them) and optimizer
        state split over the degree; gathered: the root's parameters (whole from forward to
        the end of backward) and the largest two consecutive units (one computing, the next
        prefetched), in the compute dtype."""
        stored = self.root.stored_bytes + sum(u.stored_bytes for u in self.units)
        sizes = [u.gather_bytes for u in self.units]
        pairs = [a + b for a, b in zip(sizes, sizes[1:], strict=False)] or sizes or [0]
        shards = {
            "parameters": stored // self.degree,
            "gradients": stored if merge > 1 else stored // self.degree,
            "optimizer_state": STATE_PER_PARAM * stored // self.degree,
        }
        gathered = {"gathered_parameters": self.root.gather_bytes + max(pairs)}
        if offload:
            return gathered, sum(shards.values())
        return shards | gathered, 0


def _timeline(
    compute: Sequence[float], gathers: Sequence[float], scatters: Sequence[float]
) -> float:
    """Seconds until the last piece's compute and collectives end. Piece ``k``'s gather is
    issued at the start (the first) or when piece ``k-1``'s compute starts (one ahead), its
    compute waits for it, its scatter is issued when its compute ends; the collectives run one
    at a time in the order issued."""
    link = gathers[0]
    landed = [link] + [0.0] * (len(compute) - 1)
    clock = 0.0
    for k, seconds in enumerate(compute):
        start = max(clock, landed[k])
        if k + 1 < len(compute):
            link = max(link, start) + gathers[k + 1]
            landed[k + 1] = link
        clock = start + seconds
        if scatters[k]:
            link = max(link, clock) + scatters[k]
    return max(clock, link)


def _shares(profile: Profile, groups: Sequence[Sequence[int]]) -> list[float]:
    """Each group's share of the backward: every parameter owns the time from the previous
    gradient's readiness to its own (the tail after the last one goes to the last); by bytes
    when the profile has no readiness times."""
    ready = sorted((p.ready_s, i) for i, p in enumerate(profile.params))
    owned = [0.0] * len(profile.params)
    previous = 0.0
    for t, i in ready:
        owned[i] = max(0.0, t - previous)
        previous = max(previous, t)
    if previous <= 0:
        owned = [float(p.nbytes) for p in profile.params]
    elif ready:
        owned[ready[-1][1]] += max(0.0, profile.backward_s - previous)
    total = sum(owned) or 1.0
    return [sum(owned[i] for i in g) / total for g in groups]


def stage3(profile: Profile, cluster: Cluster, plan: CollectivePlan) -> Stage3:
    """The stage 3 step of ``profile`` on ``cluster`` under ``plan`` (sharding stage 3)."""
    from longboat.sharding.policies import FullyShardPolicy

    policy = FullyShardPolicy.of(plan, cluster.world, cluster.devices_per_node, cluster.nodes)
    units, root = unit_params(profile, plan)
    groups = [root, *units]
    shares = _shares(profile, groups)

    def piece(members: Sequence[int], share: float) -> Piece:
        params = [profile.params[i] for i in members]
        numel = sum(p.numel for p in params)
        stored = sum(p.nbytes for p in params)
        compute = policy.param_dtype
        gather = numel * compute.itemsize if compute is not None else stored
        reduce_dtype = policy.reduce_dtype or compute
        reduce = numel * reduce_dtype.itemsize if reduce_dtype is not None else stored
        return Piece(
            numel,
            len(params),
            stored,
            gather,
            reduce,
            profile.forward_s * share,
            profile.backward_s * share,
        )

    pieces = [piece(g, s) for g, s in zip(groups, shares, strict=True)]
    degree = policy.degree
    group = cluster if degree == cluster.world else cluster.with_devices(degree)
    return Stage3(
        degree=degree,
        replicas=policy.replicas,
        root=pieces[0],
        units=tuple(pieces[1:]),
        group=group,
        replica_group=replica_group(cluster, degree) if policy.replicas > 1 else None,
        overlap=cluster.is_gpu,
        host=cluster.fsdp2,
    )


def replica_group(cluster: Cluster, degree: int) -> Cluster:
    """The ranks holding the same shard (one per consecutive group of ``degree``) as a cluster,
    on the share of the node's NICs left to it: every shard position allreduces at once."""
    per, replicas = cluster.devices_per_node, cluster.world // degree
    if cluster.nodes == 1:
        return cluster.with_devices(replicas)
    inter = cluster.inter
    nics = min(inter.nics_per_node, per)
    if degree >= per:  # one rank per node, per groups at once on a node's NICs
        share = dataclasses.replace(inter, bandwidth=inter.bandwidth * nics / per, nics_per_node=1)
        return dataclasses.replace(cluster, nodes=replicas, devices_per_node=1, inter=share)
    local = per // degree  # members per node; degree groups at once on a node's NICs
    rate = inter.bandwidth * nics / degree / min(nics, local)
    intra = cluster.intra.among(local, per, cluster.pcie_bandwidth)
    return dataclasses.replace(
        cluster,
        devices_per_node=local,
        intra=intra,
        inter=dataclasses.replace(inter, bandwidth=rate),
    )


def simulate_stage3(
    profile: Profile, cluster: Cluster, plan: CollectivePlan, notes: list[str]
) -> Prediction:
    """One step at sharding stage 3, averaged over a gradient-merge cycle."""
    from longboat.sim.predict import _finish

    step = stage3(profile, cluster, plan)
    assert plan.sharding is not None
    merge = plan.k_steps
    copies = ((merge - 1) * step.copied_bytes(False) + step.copied_bytes(True)) / cluster.mem_bw
    optimizer = profile.optimizer_s / step.degree
    compute = profile.forward_s + profile.backward_s
    overhead = (merge - 1) * step.host_s(False) + step.host_s(True)
    cycle = (merge - 1) * step.micro_step_s(False) + step.micro_step_s(True) + copies + optimizer
    exposed = cycle - merge * compute - copies - optimizer
    cycle += overhead
    memory, host = step.memory(merge, plan.sharding.offload)
    notes.append(_note(step))
    if not step.overlap:
        notes.append("CPU ranks: FSDP2 runs every collective synchronously, nothing overlaps")
        missing = [what for what, known in _CALIBRATED if not known(cluster)]
        if missing:
            notes.append(
                f"not calibrated on this cluster: {' and '.join(missing)}; `longboat sim "
                "calibrate` measures them (without, stage 3 on CPU ranks is predicted too fast)"
            )
    if host:
        notes.append(
            f"offload: {host / 2**20:.1f} MB of shards per rank in host memory; the host-device "
            "copies and the CPU optimizer step are not priced"
        )
    if merge > 1:
        notes.append(f"gradient merge: one reduce-scatter every {merge} micro-steps")
    comm = (merge - 1) * step.comm_s(False) + step.comm_s(True)
    sent = (merge - 1) * step.sent_bytes(False) + step.sent_bytes(True)
    return _finish(
        cluster,
        profile,
        cycle / merge,
        merge,
        compute_s=compute + copies / merge,
        exposed_comm_s=max(0.0, exposed) / merge,
        optimizer_s=optimizer / merge,
        host_overhead_s=overhead / merge,
        comm_s=comm / merge,
        buckets=len(step.units) + (1 if step.root.numel else 0),
        bytes_sent=int(sent / merge),
        algorithm="fsdp2",
        notes=tuple(notes),
        memory=memory,
    )


_CALIBRATED = (
    ("FSDP2's host work per unit", lambda c: c.fsdp2 is not None),
    ("Gloo's all-gather and reduce-scatter", lambda c: len(c.collectives) == 2),
)


def _note(step: Stage3) -> str:
    hsdp = f" x {step.replicas} replicas (HSDP)" if step.replicas > 1 else ""
    return (
        f"sharding stage 3 (FSDP2) over {step.degree} ranks{hsdp}: {len(step.units)} unit(s) "
        "and the root, each unit all-gathered in forward and again in backward, gradients "
        "reduce-scattered"
    )
