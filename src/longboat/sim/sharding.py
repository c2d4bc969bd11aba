"""Sharding (ZeRO stage 1 and 2) in the simulator: what it changes in a step and in memory.

Stage 1 keeps the gradient allreduce, runs the optimizer on 1/d of the elements and then
all-gathers the updated parameters bucket by bucket, overlapped with the next forward: a
bucket's layers wait for its gather (`Sharded.exposed_gather`). Stage 2 also replaces each
bucket's allreduce by a reduce-scatter, half an allreduce's steps and bytes, during backward
as before. ``d`` is the shard group's size (``sharding_degree``, 0: every rank). Where the
shard group spans nodes (or runs on NCCL) these are the backend's own reduce-scatter and
all-gather, priced with the cluster's calibrated corrections of them (Gloo's reduce-scatter
costs more than an allreduce on CPU ranks, not half); within one Gloo node, longboat's
shared-memory ones. Stage 3 (FSDP2) is priced apart: `longboat.sim.stage3`.
"""

from __future__ import annotations

from dataclasses import dataclass

from longboat.comm.algorithms import Parts
from longboat.sharding.config import ShardingPlan
from longboat.sim import cost
from longboat.sim.cluster import Cluster
from longboat.sim.profile import Profile

#: optimizer-state bytes per parameter byte assumed for the memory estimate: Adam's two
#: moments in the parameters' dtype (SGD with momentum holds 1, plain SGD 0)
STATE_PER_PARAM = 2


@dataclass(frozen=True)
class Sharded:
    """One sharded step's differences from an unsharded one, per rank."""

    stage: int
    degree: int
    group: Cluster  # the ranks of one shard group
    gather_bytes: int  # what this rank sends in the parameters' all-gather

    @property
    def backend_collectives(self) -> bool:
        """Does the shard group use the backend's own reduce-scatter and all-gather (it spans
        nodes, or is not Gloo), rather than longboat's shared-memory ones?"""
        return self.group.nodes > 1 or self.group.resolved_backend() != "gloo"

    def collective(self, allreduce: Parts) -> Parts:
        """A bucket's collective: its allreduce (stage 1), a reduce-scatter (stage 2)."""
        if self.stage == 1:
            return allreduce
        half = allreduce[0] / 2, allreduce[1] / 2
        return (
            cost.corrected(half, self.group, "reduce_scatter") if self.backend_collectives else half
        )

    def sent(self, allreduce_bytes: int) -> int:
        """Bytes a bucket's collective sends, from its allreduce's."""
        return allreduce_bytes if self.stage == 1 else allreduce_bytes // 2

    def optimizer_s(self, unsharded_s: float) -> float:
        """The optimizer on this rank's 1/degree of the elements."""
        return unsharded_s / self.degree

    def gather_s(self, bucket_bytes: int) -> float:
        """One bucket's all-gather (latency + link)."""
        parts = cost.allgather(bucket_bytes / self.degree, self.group)
        if self.backend_collectives:
            parts = cost.corrected(parts, self.group, "all_gather")
        return sum(parts)

    def exposed_gather(self, bucket_bytes: list[int], forward_s: float) -> float:
        """The forward's wait for the gathers: ``bucket_bytes`` in the order the forward reads
        the buckets, gathered one after another from the step's end; each bucket's share of
        the forward (by bytes) starts when its gather has landed."""
        total = sum(bucket_bytes) or 1
        landed = computed = 0.0
        for nbytes in bucket_bytes:
            landed += self.gather_s(nbytes)
            computed = max(computed, landed) + forward_s * nbytes / total
        return max(0.0, computed - forward_s)

    def note(self) -> str:
        scatter = "reduce-scatter, " if self.stage == 2 else ""
        return (
            f"sharding stage {self.stage} over {self.degree} ranks: {scatter}optimizer on 1/"
            f"{self.degree} of the elements, parameters all-gathered during the next forward"
        )


def sharded(plan: ShardingPlan | None, profile: Profile, cluster: Cluster) -> Sharded | None:
    """What ``plan`` changes on ``cluster`` (None: no sharding, or a single rank)."""
    if plan is None or cluster.world <= 1:
        return None
    if plan.stage not in (1, 2):
        raise ValueError(f"sharding stage {plan.stage} is priced by longboat.sim.stage3")
    degree = plan.degree_in(cluster.world, 0)
    group = cluster if degree == cluster.world else cluster.with_devices(degree)
    param_bytes = sum(p.nbytes for p in profile.params)
    return Sharded(plan.stage, degree, group, int((degree - 1) * param_bytes / degree))


def memory_per_rank(profile: Profile, shard: Sharded | None) -> dict[str, int]:
    """Bytes one rank holds: parameters, gradients, optimizer state (`STATE_PER_PARAM`)."""
    params = sum(p.nbytes for p in profile.params)
    degree = shard.degree if shard is not None else 1
    grads = params // degree if shard is not None and shard.stage == 2 else params
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer_state": STATE_PER_PARAM * params // degree,
    }
