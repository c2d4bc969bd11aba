"""What ``Strategy(sharding=True)`` asks for, resolved once (``CollectivePlan.sharding``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from longboat.words import plural

if TYPE_CHECKING:
    from longboat.strategy import Strategy


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingPlan:
    """ZeRO stage and the number of ranks the state is split over."""

    stage: int
    """1: optimizer state; 2: + gradients; 3: + parameters (FSDP2, ``longboat.sharding``)."""
    degree: int
    """Ranks per shard group; 0: every rank of the job."""
    dp_degree: int
    """``sharding_configs['dp_degree']``: 1, or the number of shard groups."""
    overlap: bool = False
    """``sharding_configs['comm_overlap']``: all-gather the parameters during the next forward
    (False: inside ``optimizer.step()``)."""
    units: tuple[str, ...] = ()
    """Stage 3: ``sharding_configs['units']``, module classes or names; empty: from the plan."""
    offload: bool = False
    """Stage 3: ``sharding_configs['offload']``, the shards in CPU memory."""

    @classmethod
    def of(cls, strategy: Strategy) -> ShardingPlan | None:
        """The plan of ``strategy``, or None when sharding is off."""
        if not strategy.sharding:
            return None
        c = strategy.sharding_configs
        return cls(
            stage=c["stage"],
            degree=c["sharding_degree"],
            dp_degree=c["dp_degree"],
            overlap=c["comm_overlap"],
            units=tuple(c["units"]),
            offload=c["offload"],
        )

    def describe(self, degree: int) -> str:
        """One line for ``lb.distribute``'s log: the stage, the ranks, when parameters are whole."""
        split = "optimizer state" if self.stage == 1 else "optimizer state and gradients"
        if self.overlap:
            after = (
                "comm_overlap: optimizer.step() leaves the parameters' all-gather to the next "
                "forward, which completes them; read them before it through the model "
                "(model.module, model.parameters()) or call model.settle_parameters()"
            )
        else:
            after = "every parameter is whole when optimizer.step() returns"
        return f"sharding stage {self.stage}: {split} split over {plural(degree, 'rank')}; {after}"

    def degree_in(self, world: int, rank: int) -> int:
        """The shard group size in a job of ``world`` ranks; ValueError naming the fields when
        it does not divide the world."""
        degree = world if self.degree == 0 else self.degree
        if degree > world or world % degree:
            raise ValueError(
                f"rank {rank}: sharding_configs['sharding_degree']={self.degree} must divide "
                f"the {world} ranks of the job (0 shards over every rank)"
            )
        if self.dp_degree not in (1, world // degree):
            raise ValueError(
                f"rank {rank}: sharding_configs['dp_degree']={self.dp_degree} must be 1 or "
                f"{world // degree} (the world size over sharding_degree={degree})"
            )
        return degree
