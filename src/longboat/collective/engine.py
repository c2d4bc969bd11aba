"""Collective ``lb.distribute``: build the communicators, the reducer and the wrappers that make a
model and optimizer data-parallel."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

import longboat.cluster as cluster
from longboat.cluster.backends import runs_on_device
from longboat.collective.amp import Amp
from longboat.collective.autotune import AutoTuner, Builder, make_tuner
from longboat.collective.buckets import (
    Allreduce,
    BucketCollective,
    BucketPlan,
    GradSpec,
    layer_of,
    plan_buckets,
)
from longboat.collective.consistency import (
    broadcast_state,
    verify_same_model,
    verify_same_settings,
)
from longboat.collective.live import live_placement, state_carried_over
from longboat.collective.localsgd import AdaptiveLocalSGD, LocalSGD
from longboat.collective.model import DistributedModel
from longboat.collective.optimizer import (
    DGCMomentum,
    LocalSGDStep,
    LossScaling,
    MergeGate,
    dgc_momentum,
    use_multi_tensor_kernels,
)
from longboat.collective.plan import (
    CollectivePlan,
    CommPlan,
    RuntimeSettings,
    resolve,
)
from longboat.collective.reducer import Reducer
from longboat.collective.sync_bn import convert_sync_batchnorm
from longboat.comm import algorithms
from longboat.comm.algorithms import AllreduceFn
from longboat.comm.background import AsyncAllreduce
from longboat.comm.compress import ThreadedCompressor, make_compressor
from longboat.comm.exchange import bind_device
from longboat.comm.groups import make_communicators
from longboat.comm.serial import SerialAllreduce
from longboat.log import get_logger
from longboat.optim import wrap_optimizer
from longboat.optim.staged import Stage, StagedOptimizer
from longboat.ownership import admit
from longboat.recompute import apply_recompute
from longboat.registry import COMPRESSORS
from longboat.sharding.zero.groups import ShardGroups
from longboat.sharding.zero.scatter import WIRE_DTYPES
from longboat.sharding.zero.setup import ShardSetup
from longboat.sharding.zero.step import ShardedStep
from longboat.strategy import Strategy
from longboat.trace import attach
from longboat.trace.stall import waiting, watch_collectives
from longboat.words import plural

log = get_logger("longboat.collective")


def distribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strategy: Strategy | None = None,
) -> tuple[DistributedModel, torch.optim.Optimizer | None]:
    """Make ``model`` data-parallel across all ranks according to ``strategy`` (collective mode;
    ``lb.distribute`` dispatches here).

    Initialises the cluster if needed, checks that every rank runs the same Strategy and built
    the same model, builds the communicators, broadcasts rank 0's parameters and buffers,
    installs the gradient reducer and wraps the model and the optimizer. Returns the wrapped
    model and the optimizer (a `longboat.optim.StagedOptimizer` around the one given, with the
    stages the plan asks for).
    """
    strategy = strategy or cluster.current_strategy() or Strategy()
    admit(model, optimizer)
    if strategy.mode != "collective":
        raise ValueError(f"mode={strategy.mode!r} is not collective: call lb.distribute")
    strategy.check()
    if not cluster.is_initialized():  # lb.distribute has called lb.init; a direct call joins
        cluster.init(strategy)
    plan = resolve(strategy, live_placement())  # below here only the plan is read
    if plan.sharding is not None and plan.sharding.stage == 3:  # FSDP2: longboat.sharding
        from longboat.sharding.fsdp import distribute_fully_sharded

        return distribute_fully_sharded(model, optimizer, plan)  # type: ignore[return-value]
    model, named = _prepare(model, plan)
    comm = join_world(model, plan)
    sharding = shard_setup(named, plan, optimizer, comm.fns)  # collective, in the same order
    if plan.runtime.compiled_fusion:
        model = cast(nn.Module, torch.compile(model))
    amp = Amp(plan.amp, named[0][1].device.type) if plan.amp is not None else None
    scaled = amp is not None and amp.scaler is not None
    reducer, compressors = build_reducer(
        named, plan, optimizer, communicators=comm.pair, check_finite=scaled, sharding=sharding
    )
    _warn_if_sync_bn_order_may_differ(plan, [*comm.fns, *compressors])
    tuner = (
        make_tuner(plan, _candidate_builder(named, plan, optimizer, scaled, comm))
        if plan.auto
        else None
    )
    wrapped = _wrap_model(model, plan, reducer, compressors, amp, named, tuner)
    wrapped.keep_overlap()  # a compiled module: cut its graph at the buckets
    optimizer = _wrap_optimizer(optimizer, plan, wrapped, named, scaled, sharding)
    return wrapped, attach(wrapped, optimizer, plan.trace)


def join_world(model: nn.Module, plan: CollectivePlan) -> Comm:
    """The collective steps of ``lb.distribute``, in the order every rank runs them: check that
    all ranks run the same settings and model, build the communicators, broadcast rank 0's
    parameters. A rank rebuilding after an elastic membership change runs them too, so that
    it meets a rank joining for the first time in the same collectives."""
    _verify_ranks(model, plan)
    comm = build_comm(plan.comm)
    if not state_carried_over():
        _broadcast_initial_state(model, plan, comm)  # else State.sync brings the state
    return comm


@dataclasses.dataclass(frozen=True)
class Comm:
    """The plan's allreduce algorithm on each of its communicators."""

    plan: CommPlan
    groups: list[dist.ProcessGroup]
    fns: list[AllreduceFn]

    @property
    def pair(self) -> tuple[list[dist.ProcessGroup], list[AllreduceFn]]:
        return self.groups, self.fns


def build_comm(plan: CommPlan) -> Comm:
    """Communicators and the plan's algorithm on each (collective: every rank, in order)."""
    groups = make_communicators(plan.communicators)
    return Comm(plan, groups, [algorithms.make(plan.algorithm, g, plan.options) for g in groups])


def _prepare(
    model: nn.Module, plan: CollectivePlan
) -> tuple[nn.Module, list[tuple[str, nn.Parameter]]]:
    """Apply per-process settings, convert batch norms, wrap recomputed submodules; the
    parameters to train, checked against the backend."""
    if isinstance(model, DistributedModel):
        raise ValueError("this model was already passed to lb.distribute")
    _apply_runtime_settings(plan.runtime)
    if plan.sync_batch_norm:
        model = convert_sync_batchnorm(model)
    apply_recompute(model, plan.recompute)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no parameters that require grad: nothing to train")
    _check_devices(named)
    bind_device(named[0][1].device)  # control collectives go to the model's GPU
    return model, named


def _verify_ranks(model: nn.Module, plan: CollectivePlan) -> None:
    """Every rank runs the same settings and built the same model (bounded waits, named)."""
    watch_collectives(plan.trace)  # the stall inspector names the waits below
    with waiting("settings check of lb.distribute (Strategy fields)"):
        verify_same_settings(plan.shared_settings)
    with waiting("model check of lb.distribute (parameter names and shapes)"):
        verify_same_model(model)


def _broadcast_initial_state(model: nn.Module, plan: CollectivePlan, comm: Comm) -> None:
    """Rank 0's parameters and buffers to every rank, through the algorithm if it says so."""
    with waiting("broadcast of parameters"):
        broadcast_state(
            [p for _, p in model.named_parameters()] + [b for _, b in model.named_buffers()],
            coalesce=plan.coalesce_broadcast,
            allreduce_fn=comm.fns[0] if comm.plan.broadcast else None,
        )


def _wrap_model(
    model: nn.Module,
    plan: CollectivePlan,
    reducer: Reducer,
    compressors: list,
    amp: Amp | None,
    named: list[tuple[str, nn.Parameter]],
    tuner: AutoTuner | None,
) -> DistributedModel:
    """The module wrapper: gradient merge, local SGD, AMP, auto-tuning around ``reducer``."""
    local_sgd = _local_sgd(plan, [p for _, p in named])
    return DistributedModel(
        model,
        reducer,
        k_steps=plan.k_steps,
        merge_avg=plan.merge.avg if plan.merge is not None else False,
        communicate=local_sgd is None,
        amp=amp,
        compressors=compressors,
        local_sgd=local_sgd,
        tuner=tuner,
        plan=plan,
    )


def _wrap_optimizer(
    optimizer: torch.optim.Optimizer | None,
    plan: CollectivePlan,
    wrapped: DistributedModel,
    named: list[tuple[str, nn.Parameter]],
    scaled: bool,
    sharding: ShardSetup | None = None,
) -> torch.optim.Optimizer | None:
    """The returned optimizer: the user's (or LARS/LAMB), with fused kernels, wrapped in a
    `StagedOptimizer` with the stages the plan asks for (loss scaling, DGC momentum,
    gradient merge, local SGD; their order is `StageKind`'s)."""
    local_sgd = wrapped.local_sgd
    if optimizer is None:
        if local_sgd is not None:
            raise ValueError(
                "local SGD averages parameters after optimizer steps: pass the optimizer"
            )
        return None
    if plan.optimizer.replace_with is not None:  # Fleet's LARS/LAMB meta-optimizers
        optimizer = wrap_optimizer(
            plan.optimizer.replace_with, optimizer, named, dict(plan.optimizer.config)
        )
    if plan.optimizer.fused_kernels and not use_multi_tensor_kernels(optimizer):
        log.warning(
            "fuse_all_optimizer_ops: %s has no multi-tensor implementation; unchanged",
            type(optimizer).__name__,
        )
    stages: list[Stage] = []
    if scaled:
        stages.append(LossScaling(wrapped))
    if COMPRESSORS.entry(plan.compression.name).momentum:  # its momentum replaces the optimizer's
        stages.append(DGCMomentum([c.state for c in wrapped.compressors], optimizer))
    if wrapped.k_steps > 1:
        stages.append(MergeGate(wrapped))
    if local_sgd is not None:
        stages.append(LocalSGDStep(local_sgd, optimizer))
    if sharding is not None:
        if cluster.rank() == 0:
            log.info("%s", sharding.plan.describe(sharding.groups.degree))
        stages.append(ShardedStep(optimizer, wrapped, sharding))
    return StagedOptimizer(optimizer, stages)


def shard_setup(
    named: list[tuple[str, nn.Parameter]],
    plan: CollectivePlan,
    optimizer: torch.optim.Optimizer | None,
    shared: list[AllreduceFn] | None = None,
) -> ShardSetup | None:
    """Sharding's groups (collective) and this rank's layout over the reducer's buckets, built
    once for the reducer and the sharded step; None when sharding is off. ``shared``: the
    allreduce's functions, whose shared memory groups over the same ranks run on."""
    if plan.sharding is None:
        return None
    degree = plan.sharding.degree_in(dist.get_world_size(), dist.get_rank())
    groups = ShardGroups.make(degree, shared or ())
    return ShardSetup.make(
        plan.sharding,
        groups,
        [p for _, p in named],
        bucket_plan(named, plan),
        optimizer,
        wire_dtype=WIRE_DTYPES.get(plan.compression.name),
    )


def bucket_plan(named: list[tuple[str, nn.Parameter]], plan: CollectivePlan) -> BucketPlan:
    """The reducer's buckets for ``named`` as ``plan.comm`` sets them."""
    specs = [
        GradSpec(i, n, p.numel(), p.dtype, p.device, layer_of(n)) for i, (n, p) in enumerate(named)
    ]
    return plan_buckets(
        specs,
        fuse=plan.comm.fuse,
        cap_mb=plan.comm.bucket_mb,
        max_layers=plan.comm.layers_per_bucket,
        last_cap_mb=plan.comm.last_bucket_mb,
    )


def _local_sgd(
    plan: CollectivePlan, params: list[nn.Parameter]
) -> LocalSGD | AdaptiveLocalSGD | None:
    """Local SGD replaces gradient allreduce by parameter averaging every k steps."""
    local = plan.local_sgd
    if local is None:
        return None
    if local.adaptive:
        return AdaptiveLocalSGD(params, init_k_steps=local.k_steps, begin_step=local.begin_step)
    return LocalSGD(params, k_steps=local.k_steps, begin_step=local.begin_step)


def _compressor_config(plan: CollectivePlan, optimizer: torch.optim.Optimizer | None) -> dict:
    """The plan's compressor config ('none' counts bytes); a compressor that declares
    ``momentum`` (DGC) takes the optimizer's momentum and applies it itself."""
    config = dict(plan.compression.config)
    if COMPRESSORS.entry(plan.compression.name).momentum:
        config["momentum"] = dgc_momentum(optimizer)
    return config


def build_reducer(
    named_params: list[tuple[str, nn.Parameter]],
    plan: CollectivePlan,
    optimizer: torch.optim.Optimizer | None,
    buckets: BucketPlan | None = None,
    *,
    communicators: tuple[list[dist.ProcessGroup], list[AllreduceFn]] | None = None,
    check_finite: bool = False,
    sharding: ShardSetup | None = None,
) -> tuple[Reducer, list]:
    """The gradient reducer ``plan`` describes for ``named_params``, and its compressors.

    This is the reducer ``lb.distribute`` installs; facades over the core (``longboat.horovod``)
    build theirs here too, from ``resolve(strategy, live_placement())``. The reducer registers
    its gradient hooks on the parameters at once and from then on averages their gradients
    across ranks during every backward pass (see
    :class:`~longboat.collective.reducer.Reducer`, and :meth:`Reducer.flush
    <longboat.collective.reducer.Reducer.flush>` to reduce outside backward).

    Args:
        named_params: ``(name, parameter)`` pairs that require grad, in model order; the same
            names, shapes and dtypes, in the same order, on every rank.
        plan: the resolved Strategy (`longboat.collective.plan.resolve`): its bucket settings,
            algorithm and communicators, compressor, ``find_unused_parameters``.
        optimizer: read only for DGC's momentum; may be None otherwise.
        buckets: an explicit bucket plan, used instead of the one ``plan.comm`` would make.
        communicators: ``(process groups, allreduce functions)`` already made for
            ``plan.comm``, to share them; by default new ones are made, which is collective:
            every rank must then call this in the same order.
        check_finite: record in ``reducer.last_finite`` whether the reduced gradients are
            free of inf/NaN (AMP loss scaling).
        sharding: sharding as `shard_setup` built it: the reducer takes its buckets, and at
            stage 2 reduce-scatters them into this rank's slices (`ShardSetup.scatter`).

    Returns:
        ``(reducer, compressors)``: one compressor per communicator, the allreduce functions
        the reducer runs (their ``stats`` count the bytes sent).
    """
    if communicators is None:
        communicators = build_comm(plan.comm).pair
    comms, fns = communicators
    explicit = buckets is not None
    if buckets is None:
        buckets = sharding.buckets if sharding is not None else bucket_plan(named_params, plan)
    # pre-divided buckets: half precision cannot overflow the sum
    config = _compressor_config(plan, optimizer)
    name = plan.compression.name
    compressors = [make_compressor(name, fn, g, config) for fn, g in zip(fns, comms, strict=True)]
    fns = list(compressors)
    # a lossy compressor must not touch the used-parameter flags: they go apart, exactly
    flag_fns = [c.exact for c in compressors] if plan.compression.lossy else None
    if plan.comm.serial:
        fns = [SerialAllreduce(fn) for fn in fns]
        if flag_fns is not None:  # the flags join the same chain: one order on every rank
            flag_fns = [functools.partial(s, fn=f) for s, f in zip(fns, flag_fns, strict=True)]
    scatter = sharding.scatter if sharding is not None else None
    collective: BucketCollective = scatter if scatter is not None else Allreduce(fns)
    if cluster.rank() == 0:
        described = (
            f"{plural(len(named_params), 'gradient tensor')} in "
            f"{plural(len(buckets), f'explicit {collective.name} bucket')}"
            if explicit
            else buckets.describe(len(named_params), collective.name)
        )
        log.info(
            "%s over %s%s",
            described,
            plural(len(fns), "communicator"),
            ", one allreduce in flight per communicator"
            if plan.comm.serial and scatter is None
            else "",
        )
    reducer = Reducer(
        named_params,
        buckets,
        fns,
        world_size=dist.get_world_size(),
        find_unused_parameters=plan.find_unused_parameters,
        check_finite=check_finite,
        flag_fns=flag_fns,
        collective=collective,
    )
    for compressor in compressors:
        if hasattr(compressor, "set_layout"):
            for buffer, layout in reducer.bucket_layouts():
                compressor.set_layout(buffer, layout)
    return reducer, compressors


def _candidate_builder(
    named: list[tuple[str, nn.Parameter]],
    plan: CollectivePlan,
    optimizer: torch.optim.Optimizer | None,
    check_finite: bool,
    comm: Comm,
) -> Builder:
    """Strategy(auto=True)'s candidate reducers, through ``build_reducer``; candidates with
    the same algorithm and communicator count share communicators (the plan's ``comm``)."""
    cache = {(comm.plan.algorithm, len(comm.groups)): comm.pair}

    def build(candidate: CommPlan) -> tuple[Reducer, list]:
        key = (candidate.algorithm, candidate.communicators)
        if key not in cache:
            cache[key] = build_comm(candidate).pair
        return build_reducer(
            named,
            dataclasses.replace(plan, comm=candidate),
            optimizer,
            communicators=cache[key],
            check_finite=check_finite,
        )

    return build


def _warn_if_sync_bn_order_may_differ(plan: CollectivePlan, fns: list[AllreduceFn]) -> None:
    """NCCL: every rank must queue its collectives on all communicators in one order. Sync
    BN's allreduces (default group) and the buckets' (their communicators) are queued in the
    autograd graph's order; say where that order may differ between ranks."""
    if not (plan.sync_batch_norm and runs_on_device(dist.get_backend())):
        return
    threaded = any(isinstance(fn, AsyncAllreduce | ThreadedCompressor) for fn in fns)
    causes = [
        "find_unused_parameters=True lets ranks take different branches"
        if plan.find_unused_parameters
        else "",
        f"{plan.comm.algorithm!r} / {plan.compression.name!r} queue bucket collectives from "
        "a worker thread"
        if threaded
        else "",
    ]
    causes = [c for c in causes if c]
    if causes and cluster.rank() == 0:
        log.warning(
            "sync BN on %s: %s, so ranks may queue sync BN's allreduces and the buckets' in "
            "different orders, which NCCL can deadlock on; run the same layers on every rank "
            "and use the native algorithm without DGC/PowerSGD to rule it out "
            "(docs/collective.md, 'Sync BN beside the bucket communicators')",
            dist.get_backend(),
            "; ".join(causes),
        )


def _check_devices(named: list[tuple[str, nn.Parameter]]) -> None:
    backend = dist.get_backend()
    for name, p in named:
        if runs_on_device(backend) and p.device.type != "cuda":
            raise ValueError(
                f"parameter {name!r} is on {p.device} but the backend is NCCL: move the model "
                f"to its GPU first, e.g. model.to('cuda:{cluster.local_rank()}')"
            )
        if backend == "gloo" and p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"parameter {name!r} is on {p.device}, which Gloo cannot reduce")


def _apply_runtime_settings(settings: RuntimeSettings) -> None:
    """The process settings the plan carries; those it leaves None keep PyTorch's own."""
    if settings.num_threads is not None:
        torch.set_num_threads(settings.num_threads)
    if settings.cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = settings.cudnn_benchmark
    if settings.conv_workspace_mb is not None:
        os.environ["CUDNN_CONV_WSCAP_DBG"] = str(settings.conv_workspace_mb)
