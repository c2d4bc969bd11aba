"""One resolution of a Strategy into what collective training runs with: a frozen plan.

``resolve(strategy, placement)`` is pure: it reads the Strategy's fields and the placement of
the ranks it is given (never the live cluster) and returns a :class:`CollectivePlan`. The
engine builds communicators, reducer, compressors and wrappers from the plan; the auto-tuner's
candidates are variants of its :class:`CommPlan`; the simulator resolves the same Strategy on
the cluster it is asked about; the cluster line prints the plan's choice. So every consumer
sees the same answer to "which algorithm, how large the buckets, how many communicators".

The rule for settings the topology decides: the user's value where the Strategy's field was
set (any source but the default), else the topology's (`longboat.cluster.topology.comm_defaults`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from longboat.cluster.topology import comm_defaults
from longboat.recompute import RecomputeConfig
from longboat.registry import ALGORITHMS, COMPRESSORS, Entry
from longboat.sharding.config import ShardingPlan
from longboat.trace.config import TraceConfig

if TYPE_CHECKING:
    from longboat.strategy import Strategy

TOPOLOGY = "topology"
"""The default ``allreduce_algorithm``: chosen from the placement of the ranks (no trial)."""

INTER_NRANKS = "hierarchical_allreduce_inter_nranks"

TUNABLE = ("algorithm", "bucket_mb", "communicators")
"""The :class:`CommPlan` settings ``Strategy(auto=True)`` may try other values of."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where the ranks of a group run."""

    node_of: tuple[int, ...]
    """The node index of each rank of the group, by rank."""
    backend: str
    """``"gloo"`` or ``"nccl"``."""
    spans_world: bool = True
    """The group is the whole world (hierarchical allreduce makes sub-groups of it)."""

    @classmethod
    def of(cls, node_of: Sequence[int], backend: str, spans_world: bool = True) -> Placement:
        return cls(node_of=tuple(node_of), backend=backend, spans_world=spans_world)


@dataclass(frozen=True, kw_only=True, slots=True)
class CommPlan:
    """How gradient buckets travel."""

    algorithm: str
    """The registered allreduce algorithm every communicator runs."""
    reason: str
    """Why: the topology's reason (``"one node, CPU"``) or ``"set by the strategy"``."""
    broadcast: bool
    """The start-up broadcast of rank 0's state goes through the algorithm."""
    fuse: bool
    """``fuse_all_reduce_ops``: False sends one allreduce per gradient tensor."""
    bucket_mb: float
    """The bucket cap in MB (``fuse_grad_size_in_MB``, or the topology's)."""
    layers_per_bucket: int
    """At most this many layers per bucket (``fuse_grad_size_in_TFLOPS``, read as Fleet does)."""
    last_bucket_mb: float
    """The cap of the final bucket(s) (``last_comm_group_size_MB``)."""
    communicators: int
    """Process groups the buckets are spread over (``nccl_comm_num``, or the topology's)."""
    serial: bool
    """``sync_nccl_allreduce``: one allreduce in flight per communicator."""
    tunable: frozenset[str] = frozenset()
    """The names of `TUNABLE` the user left at their defaults (``auto`` may change them)."""
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Settings for the algorithms that take them (``inter_nranks`` of ``hierarchical``, from
    ``hierarchical_allreduce_inter_nranks`` when set); `longboat.comm.algorithms.make`."""

    def describe(self) -> str:
        """E.g. ``shm (one node, CPU)``."""
        return f"{self.algorithm} ({self.reason})"

    def settings(self) -> str:
        """The tuned settings in the Strategy's words."""
        return (
            f"algorithm={self.algorithm}, fuse_grad_size_in_MB={self.bucket_mb:g}, "
            f"nccl_comm_num={self.communicators}"
        )

    def with_settings(self, algorithm: str, bucket_mb: float, communicators: int) -> CommPlan:
        """This plan with other tuned settings (an auto-tuner candidate)."""
        reason = self.reason if algorithm == self.algorithm else "tried by auto"
        return replace(
            self,
            algorithm=algorithm,
            reason=reason,
            broadcast=ALGORITHMS.entry(algorithm).broadcast,
            bucket_mb=float(bucket_mb),
            communicators=int(communicators),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class CompressionPlan:
    """The gradient compressor and its configuration."""

    name: str
    """A registered compressor (``none`` only counts bytes)."""
    config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Its ``<name>_configs``, as plain values."""
    lossy: bool = False
    """Lossy compressors get the used-parameter flags sent apart, exactly."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MergePlan:
    """Gradient merge: communicate every ``k_steps`` backward passes."""

    k_steps: int
    avg: bool
    """Divide the merged sum by ``k_steps`` (Fleet's ``avg``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalSGDPlan:
    """Local SGD: average parameters every k steps instead of allreducing gradients."""

    adaptive: bool
    """``adaptive_localsgd``: k follows the loss."""
    k_steps: int
    """k (the initial k when adaptive)."""
    begin_step: int


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerPlan:
    """What becomes of the user's optimizer, besides the stages the other plans add."""

    replace_with: str | None
    """``"lars"`` or ``"lamb"``: Fleet's meta-optimizer the user's SGD/Adam becomes."""
    config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Its ``lars_configs`` / ``lamb_configs``."""
    fused_kernels: bool = False
    """``fuse_all_optimizer_ops``: the optimizer's multi-tensor (foreach/fused) kernels."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeSettings:
    """Fleet fields that map onto PyTorch process settings; None leaves PyTorch's own."""

    num_threads: int | None = None
    """``num_threads``: ``torch.set_num_threads``."""
    cudnn_benchmark: bool | None = None
    """``cudnn_exhaustive_search``: ``torch.backends.cudnn.benchmark``."""
    conv_workspace_mb: int | None = None
    """``conv_workspace_size_limit``: cuDNN's workspace limit (``CUDNN_CONV_WSCAP_DBG``)."""
    compiled_fusion: bool = False
    """``fuse_elewise_add_act_ops``/``fuse_bn_act_ops``/``fuse_relu_depthwise_conv``: the
    model runs under ``torch.compile``, which fuses such kernels."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectivePlan:
    """Everything collective training runs with, resolved once from a Strategy."""

    comm: CommPlan
    compression: CompressionPlan
    amp: Mapping[str, Any] | None
    """``amp_configs`` when AMP is on, else None."""
    merge: MergePlan | None
    local_sgd: LocalSGDPlan | None
    find_unused_parameters: bool
    sync_batch_norm: bool
    broadcast_buffers: bool
    """Rank 0's buffers to every rank before each training forward (DDP's default)."""
    coalesce_broadcast: bool
    """``fuse_broadcast_ops``: the start-up broadcast in one message per dtype."""
    auto: bool
    """``Strategy(auto=True)``: try other `CommPlan` settings on the first steps."""
    choice: CommChoice
    """What `comm` was placed from; `on` places it anew."""
    optimizer: OptimizerPlan
    runtime: RuntimeSettings
    recompute: RecomputeConfig | None
    trace: TraceConfig
    shared_settings: Mapping[str, tuple[Any, str]]
    """Every Strategy setting ranks must agree on, as ``{"field" or "field.key": (value,
    source)}``; ``lb.distribute`` compares them across ranks."""
    sharding: ShardingPlan | None = None
    """``sharding`` (ZeRO stage 1/2) and its ``sharding_configs``, or None."""

    def on(self, placement: Placement) -> CollectivePlan:
        """This plan on another placement (an elastic job's new world)."""
        return replace(self, comm=self.choice.on(placement))

    @property
    def label(self) -> str:
        """The algorithm as the timeline names it (``native+fp16`` under fp16 allreduce)."""
        return (
            f"{self.comm.algorithm}+fp16"
            if self.compression.name == "fp16"
            else self.comm.algorithm
        )

    @property
    def k_steps(self) -> int:
        return self.merge.k_steps if self.merge is not None else 1


def resolve(strategy: Strategy, placement: Placement) -> CollectivePlan:
    """The plan ``strategy`` runs with on ``placement`` (pure: no collective, no live state)."""
    choice = CommChoice.of(strategy)
    return CollectivePlan(
        comm=choice.on(placement),
        compression=resolve_compression(strategy),
        amp=MappingProxyType(dict(strategy.amp_configs)) if strategy.amp else None,
        merge=_merge(strategy),
        local_sgd=_local_sgd(strategy),
        find_unused_parameters=strategy.find_unused_parameters,
        sync_batch_norm=strategy.sync_batch_norm,
        broadcast_buffers=strategy.broadcast_buffers,
        coalesce_broadcast=strategy.fuse_broadcast_ops,
        auto=strategy.auto,
        choice=choice,
        optimizer=_optimizer(strategy),
        runtime=_runtime(strategy),
        recompute=RecomputeConfig.of(strategy.recompute, strategy.recompute_configs),
        trace=TraceConfig.of(strategy),
        shared_settings=MappingProxyType(strategy.shared_settings()),
        sharding=ShardingPlan.of(strategy),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class CommChoice:
    """The Strategy's communication settings before a placement is known: None (or
    `TOPOLOGY`) where the topology decides. An elastic rebuild places it anew."""

    algorithm: str
    """A registered algorithm, ``"hierarchical"`` for ``use_hierarchical_allreduce``, or
    `TOPOLOGY`."""
    reason: str
    """Why, when the algorithm is the user's."""
    fuse: bool
    bucket_mb: float | None
    layers_per_bucket: int
    last_bucket_mb: float
    communicators: int | None
    serial: bool
    tunable: frozenset[str]
    options: Mapping[str, Any]

    @classmethod
    def of(cls, strategy: Strategy) -> CommChoice:
        """What ``strategy`` says; a field left at its default leaves the choice open."""

        def user_set(*names: str) -> bool:
            return any(strategy.source(name) != "default" for name in names)

        if strategy.use_hierarchical_allreduce:
            algorithm, reason = "hierarchical", "use_hierarchical_allreduce"
        else:
            algorithm, reason = strategy.allreduce_algorithm, "set by the strategy"
        bucket = strategy.fuse_grad_size_in_MB if user_set("fuse_grad_size_in_MB") else None
        comms = strategy.nccl_comm_num if user_set("nccl_comm_num") else None
        options: dict[str, Any] = {}
        if user_set(INTER_NRANKS):
            options["inter_nranks"] = strategy.hierarchical_allreduce_inter_nranks
        tunable = {
            "algorithm": not user_set("allreduce_algorithm", "use_hierarchical_allreduce"),
            "bucket_mb": strategy.fuse_all_reduce_ops and bucket is None,
            "communicators": comms is None,
        }
        return cls(
            algorithm=algorithm,
            reason=reason,
            fuse=strategy.fuse_all_reduce_ops,
            bucket_mb=bucket,
            layers_per_bucket=math.ceil(strategy.fuse_grad_size_in_TFLOPS),
            last_bucket_mb=strategy.last_comm_group_size_MB,
            communicators=comms,
            serial=strategy.sync_nccl_allreduce,
            tunable=frozenset(name for name, free in tunable.items() if free),
            options=MappingProxyType(options),
        )

    def on(self, placement: Placement) -> CommPlan:
        """The plan on ``placement``: the user's values, else the topology's."""
        rule = comm_defaults(placement.node_of, placement.backend, placement.spans_world)
        algorithm, reason = self.algorithm, self.reason
        if algorithm == TOPOLOGY:
            algorithm, reason = rule.algorithm, rule.reason
        return CommPlan(
            algorithm=algorithm,
            reason=reason,
            broadcast=ALGORITHMS.entry(algorithm).broadcast,
            fuse=self.fuse,
            bucket_mb=float(
                rule.fuse_grad_size_in_MB if self.bucket_mb is None else self.bucket_mb
            ),
            layers_per_bucket=self.layers_per_bucket,
            last_bucket_mb=self.last_bucket_mb,
            communicators=int(
                rule.nccl_comm_num if self.communicators is None else self.communicators
            ),
            serial=self.serial,
            tunable=self.tunable,
            options=self.options,
        )


def resolve_comm(strategy: Strategy, placement: Placement) -> CommPlan:
    """The algorithm, buckets and communicators: the user's values, else the topology's."""
    return CommChoice.of(strategy).on(placement)


def selected_compressor(strategy: Strategy) -> Entry:
    """The compressor ``strategy`` selects: one whose ``switch`` field is on, else ``fp16``
    under ``fp16_allreduce``, else ``gradient_compression`` ('none' counts bytes only)."""
    for entry in COMPRESSORS.entries():
        if entry.switch is not None and getattr(strategy, entry.switch) is True:
            return entry
    name = "fp16" if strategy.fp16_allreduce else strategy.gradient_compression
    return COMPRESSORS.entry(name)


def resolve_compression(strategy: Strategy) -> CompressionPlan:
    """The selected compressor with its ``<name>_configs`` as a plain mapping."""
    entry = selected_compressor(strategy)
    config: dict[str, Any] = {}
    if entry.config is not None:
        config = entry.config.plain(getattr(strategy, f"{entry.name}_configs"))
    return CompressionPlan(name=entry.name, config=MappingProxyType(config), lossy=entry.lossy)


def _merge(strategy: Strategy) -> MergePlan | None:
    if not strategy.gradient_merge:
        return None
    c = strategy.gradient_merge_configs
    return MergePlan(k_steps=c["k_steps"], avg=c["avg"])


def _local_sgd(strategy: Strategy) -> LocalSGDPlan | None:
    if strategy.localsgd:
        c = strategy.localsgd_configs
        return LocalSGDPlan(adaptive=False, k_steps=c["k_steps"], begin_step=c["begin_step"])
    if strategy.adaptive_localsgd:
        a = strategy.adaptive_localsgd_configs
        return LocalSGDPlan(adaptive=True, k_steps=a["init_k_steps"], begin_step=a["begin_step"])
    return None


def _optimizer(strategy: Strategy) -> OptimizerPlan:
    kind = "lars" if strategy.lars else "lamb" if strategy.lamb else None
    config = dict(getattr(strategy, f"{kind}_configs")) if kind is not None else {}
    return OptimizerPlan(
        replace_with=kind,
        config=MappingProxyType(config),
        fused_kernels=strategy.fuse_all_optimizer_ops,
    )


def _runtime(strategy: Strategy) -> RuntimeSettings:
    """Only the fields the user set: at their defaults PyTorch's own behaviour is left alone."""

    def user_set(name: str) -> bool:
        return strategy.source(name) != "default"

    s = strategy
    return RuntimeSettings(
        num_threads=s.num_threads if user_set("num_threads") else None,
        cudnn_benchmark=s.cudnn_exhaustive_search if user_set("cudnn_exhaustive_search") else None,
        conv_workspace_mb=(
            s.conv_workspace_size_limit if user_set("conv_workspace_size_limit") else None
        ),
        compiled_fusion=(
            s.fuse_elewise_add_act_ops or s.fuse_bn_act_ops or s.fuse_relu_depthwise_conv
        ),
    )
