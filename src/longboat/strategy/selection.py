"""Which allreduce algorithm and gradient compressor a Strategy selects: the one rule the
collective engine, the auto-tuner and the timeline share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from longboat.registry import ALGORITHMS, COMPRESSORS, Entry

if TYPE_CHECKING:
    from longboat.cluster.topology import CommDefaults
    from longboat.strategy.core import Strategy


@dataclass(frozen=True)
class AllreduceChoice:
    """The selected algorithm, its timeline label, and whether the start-up broadcast of rank
    0's state goes through it (its declaration says so)."""

    algorithm: str
    label: str
    broadcast: bool


TOPOLOGY = "topology"
"""The default ``allreduce_algorithm``: chosen from the cluster's topology (no trial)."""


def topology_defaults() -> CommDefaults | None:
    """The topology rule on the initialised cluster (all ranks), or None before init."""
    import longboat.cluster as cluster

    if not cluster.is_initialized():
        return None
    from longboat.cluster.topology import comm_defaults

    return comm_defaults(cluster.topology().node_of, str(cluster.cluster().backend))


def selected_algorithm(strategy: Strategy) -> str:
    """The allreduce algorithm ``strategy`` selects (``use_hierarchical_allreduce`` wins);
    'topology' is resolved to its choice once the cluster is initialised."""
    if strategy.use_hierarchical_allreduce:
        return "hierarchical"
    name = str(strategy.allreduce_algorithm)
    defaults = topology_defaults() if name == TOPOLOGY else None
    return defaults.algorithm if defaults is not None else name


def describe_algorithm(strategy: Strategy) -> str:
    """The allreduce choice for the cluster line, e.g. ``shm (one node, CPU)``."""
    if strategy.use_hierarchical_allreduce:
        return "hierarchical (use_hierarchical_allreduce)"
    name = str(strategy.allreduce_algorithm)
    defaults = topology_defaults() if name == TOPOLOGY else None
    return defaults.describe() if defaults is not None else f"{name} (set by the strategy)"


def fuse_grad_size_mb(strategy: Strategy) -> float:
    """``fuse_grad_size_in_MB``: the user's value, else the topology's default."""
    return float(_topology_value(strategy, "fuse_grad_size_in_MB"))


def comm_num(strategy: Strategy) -> int:
    """``nccl_comm_num``: the user's value, else the topology's default."""
    return int(_topology_value(strategy, "nccl_comm_num"))


def _topology_value(strategy: Strategy, field: str) -> Any:
    defaults = topology_defaults() if strategy.source(field) == "default" else None
    return getattr(defaults if defaults is not None else strategy, field)


def allreduce_choice(strategy: Strategy) -> AllreduceChoice:
    """The selected algorithm with its label (``+fp16`` under ``fp16_allreduce``)."""
    name = selected_algorithm(strategy)
    label = f"{name}+fp16" if strategy.fp16_allreduce else name
    return AllreduceChoice(name, label, ALGORITHMS.entry(name).broadcast)


def selected_compressor(strategy: Strategy) -> Entry:
    """The compressor ``strategy`` selects: one whose ``switch`` field is on, else ``fp16``
    under ``fp16_allreduce``, else ``gradient_compression`` ('none' counts bytes only)."""
    for entry in COMPRESSORS.entries():
        if entry.switch is not None and getattr(strategy, entry.switch) is True:
            return entry
    name = "fp16" if strategy.fp16_allreduce else str(strategy.gradient_compression)
    return COMPRESSORS.entry(name)


def compressor_config(strategy: Strategy, entry: Entry) -> dict[str, Any]:
    """``entry``'s ``<name>_configs`` as a plain dict ({} when it declares no config)."""
    if entry.config is None:
        return {}
    return entry.config.plain(getattr(strategy, f"{entry.name}_configs"))
