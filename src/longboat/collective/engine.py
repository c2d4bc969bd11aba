"""Collective ``lb.distribute``: build the communicators, the reducer and the wrappers that make a
model and optimizer data-parallel."""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.distributed as dist
from torch import nn

import longboat.cluster as cluster
from longboat.collective.amp import Amp
from longboat.collective.autotune import AutoTuner, Builder, Candidate, make_tuner
from longboat.collective.buckets import BucketPlan, GradSpec, layer_of, plan_buckets
from longboat.collective.consistency import (
    broadcast_state,
    verify_same_model,
    verify_same_settings,
)
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
from longboat.collective.reducer import Reducer
from longboat.collective.sync_bn import convert_sync_batchnorm
from longboat.comm import algorithms
from longboat.comm.algorithms import AllreduceFn
from longboat.comm.compress import make_compressor
from longboat.comm.groups import make_communicators
from longboat.comm.serial import SerialAllreduce
from longboat.elastic import world as elastic_world
from longboat.log import get_logger
from longboat.optim import wrap_optimizer
from longboat.optim.staged import ALREADY_DISTRIBUTED, Stage, StagedOptimizer, is_distributed
from longboat.recompute import apply_recompute
from longboat.registry import Entry
from longboat.strategy import Strategy
from longboat.strategy.selection import (
    AllreduceChoice,
    allreduce_choice,
    comm_num,
    compressor_config,
    fuse_grad_size_mb,
    selected_compressor,
)
from longboat.trace.stall import waiting, watch_collectives

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
    model and the optimizer (gated for gradient merge when that is on).
    """
    strategy = strategy or cluster.current_strategy() or Strategy()
    if strategy.mode != "collective":
        raise ValueError(f"mode={strategy.mode!r} is not collective: call lb.distribute")
    model, named = _prepare(model, strategy)
    comm = join_world(model, strategy)
    if _wants_compiled_fusion(strategy):
        model = torch.compile(model)  # type: ignore[assignment]
    amp = Amp(strategy.amp_configs, named[0][1].device.type) if strategy.amp else None
    scaled = amp is not None and amp.scaler is not None
    reducer, compressors = build_reducer(
        named, strategy, optimizer, communicators=comm.pair, check_finite=scaled
    )
    tuner = (
        make_tuner(strategy, _candidate_builder(named, strategy, optimizer, scaled, comm))
        if strategy.auto
        else None
    )
    wrapped = _wrap_model(model, strategy, reducer, compressors, amp, named, tuner)
    optimizer = _wrap_optimizer(optimizer, strategy, wrapped, named, scaled)
    from longboat.trace import attach  # timeline and stall inspector, as the strategy asks

    return wrapped, attach(wrapped, optimizer, strategy)


def join_world(model: nn.Module, strategy: Strategy) -> Comm:
    """The collective steps of ``lb.distribute``, in the order every rank runs them: check that
    all ranks run the same Strategy and model, build the communicators, broadcast rank 0's
    parameters. A rank rebuilding after an elastic membership change runs them too, so that
    it meets a rank joining for the first time in the same collectives."""
    _verify_ranks(model, strategy)
    comm = build_comm(strategy)
    if not (elastic_world.is_elastic() and elastic_world.any_survivor()):
        _broadcast_initial_state(model, strategy, comm)  # else State.sync brings the state
    return comm


@dataclasses.dataclass(frozen=True)
class Comm:
    """The selected allreduce algorithm on each of ``nccl_comm_num`` communicators."""

    choice: AllreduceChoice
    groups: list[dist.ProcessGroup]
    fns: list[AllreduceFn]

    @property
    def pair(self) -> tuple[list[dist.ProcessGroup], list[AllreduceFn]]:
        return self.groups, self.fns


def build_comm(strategy: Strategy) -> Comm:
    """Communicators and the selected algorithm on each (collective: every rank, in order)."""
    choice = allreduce_choice(strategy)
    groups = make_communicators(comm_num(strategy))
    return Comm(choice, groups, [algorithms.make(choice.algorithm, g) for g in groups])


def _prepare(
    model: nn.Module, strategy: Strategy
) -> tuple[nn.Module, list[tuple[str, nn.Parameter]]]:
    """Join the cluster, apply per-process settings, convert batch norms; the parameters
    to train, checked against the backend."""
    strategy.check()
    if not cluster.is_initialized():
        cluster.init(strategy)
    if isinstance(model, DistributedModel):
        raise ValueError("this model was already passed to lb.distribute")
    _apply_runtime_settings(strategy)
    if strategy.sync_batch_norm:
        model = convert_sync_batchnorm(model)
    apply_recompute(model, strategy)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no parameters that require grad: nothing to train")
    _check_devices(named)
    return model, named


def _verify_ranks(model: nn.Module, strategy: Strategy) -> None:
    """Every rank runs the same Strategy and built the same model (bounded waits, named)."""
    watch_collectives(strategy)  # the stall inspector names the waits below
    with waiting("settings check of lb.distribute (Strategy fields)"):
        verify_same_settings(strategy)
    with waiting("model check of lb.distribute (parameter names and shapes)"):
        verify_same_model(model)


def _broadcast_initial_state(model: nn.Module, strategy: Strategy, comm: Comm) -> None:
    """Rank 0's parameters and buffers to every rank, through the algorithm if it says so."""
    with waiting("broadcast of parameters"):
        broadcast_state(
            [p for _, p in model.named_parameters()] + [b for _, b in model.named_buffers()],
            coalesce=bool(strategy.fuse_broadcast_ops),
            allreduce_fn=comm.fns[0] if comm.choice.broadcast else None,
        )


def _wrap_model(
    model: nn.Module,
    strategy: Strategy,
    reducer: Reducer,
    compressors: list,
    amp: Amp | None,
    named: list[tuple[str, nn.Parameter]],
    tuner: AutoTuner | None,
) -> DistributedModel:
    """The module wrapper: gradient merge, local SGD, AMP, auto-tuning around ``reducer``."""
    merge = strategy.gradient_merge
    local_sgd = _local_sgd(strategy, [p for _, p in named])
    return DistributedModel(
        model,
        reducer,
        k_steps=int(strategy.gradient_merge_configs["k_steps"]) if merge else 1,
        merge_avg=bool(strategy.gradient_merge_configs["avg"]) if merge else False,
        communicate=local_sgd is None,
        amp=amp,
        compressors=compressors,
        local_sgd=local_sgd,
        tuner=tuner,
        strategy=strategy,
    )


def _wrap_optimizer(
    optimizer: torch.optim.Optimizer | None,
    strategy: Strategy,
    wrapped: DistributedModel,
    named: list[tuple[str, nn.Parameter]],
    scaled: bool,
) -> torch.optim.Optimizer | None:
    """The returned optimizer: the user's (or LARS/LAMB), with fused kernels, wrapped in a
    `StagedOptimizer` with the stages the strategy asks for (loss scaling, DGC momentum,
    gradient merge, local SGD; their order is `StageKind`'s)."""
    local_sgd = wrapped.local_sgd
    if optimizer is None:
        if local_sgd is not None:
            raise ValueError(
                "local SGD averages parameters after optimizer steps: pass the optimizer"
            )
        return None
    if is_distributed(optimizer):
        raise ValueError(f"{ALREADY_DISTRIBUTED}: use the optimizer it returned")
    optimizer = _replace_optimizer(strategy, optimizer, named)
    if strategy.fuse_all_optimizer_ops and not use_multi_tensor_kernels(optimizer):
        log.warning(
            "fuse_all_optimizer_ops: %s has no multi-tensor implementation; unchanged",
            type(optimizer).__name__,
        )
    stages: list[Stage] = []
    if scaled:
        stages.append(LossScaling(wrapped))
    if strategy.dgc:
        stages.append(DGCMomentum([c.state for c in wrapped.compressors], optimizer))
    if wrapped.k_steps > 1:
        stages.append(MergeGate(wrapped))
    if local_sgd is not None:
        stages.append(LocalSGDStep(local_sgd, optimizer))
    return StagedOptimizer(optimizer, stages)


def _replace_optimizer(
    strategy: Strategy, optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]]
) -> torch.optim.Optimizer:
    """Fleet's LARS/LAMB meta-optimizers: the user's SGD/Adam becomes LARS/LAMB (the inner
    optimizer of the returned `StagedOptimizer`)."""
    for kind in ("lars", "lamb"):
        if getattr(strategy, kind):
            return wrap_optimizer(
                kind, optimizer, named, dict(getattr(strategy, f"{kind}_configs"))
            )
    return optimizer


def _local_sgd(
    strategy: Strategy, params: list[nn.Parameter]
) -> LocalSGD | AdaptiveLocalSGD | None:
    """Local SGD replaces gradient allreduce by parameter averaging every k steps."""
    if strategy.localsgd:
        c = strategy.localsgd_configs
        return LocalSGD(params, k_steps=int(c["k_steps"]), begin_step=int(c["begin_step"]))
    if strategy.adaptive_localsgd:
        c = strategy.adaptive_localsgd_configs
        return AdaptiveLocalSGD(
            params, init_k_steps=int(c["init_k_steps"]), begin_step=int(c["begin_step"])
        )
    return None


def _compression(strategy: Strategy, optimizer: torch.optim.Optimizer | None) -> tuple[Entry, dict]:
    """The gradient compressor the strategy selects ('none' counts bytes), and its config."""
    entry = selected_compressor(strategy)
    config = compressor_config(strategy, entry)
    if entry.name == "dgc":  # DGC applies the optimizer's momentum itself
        config["momentum"] = dgc_momentum(optimizer)
    return entry, config


def build_reducer(
    named_params: list[tuple[str, nn.Parameter]],
    strategy: Strategy,
    optimizer: torch.optim.Optimizer | None,
    plan: BucketPlan | None = None,
    *,
    communicators: tuple[list[dist.ProcessGroup], list[AllreduceFn]] | None = None,
    check_finite: bool = False,
) -> tuple[Reducer, list]:
    """The gradient reducer ``strategy`` selects for ``named_params``, and its compressors.

    This is the reducer ``lb.distribute`` installs; facades over the core (``longboat.horovod``)
    build theirs here too. The reducer registers its gradient hooks on the parameters at once
    and from then on averages their gradients across ranks during every backward pass (see
    :class:`~longboat.collective.reducer.Reducer`, and :meth:`Reducer.flush
    <longboat.collective.reducer.Reducer.flush>` to reduce outside backward).

    Args:
        named_params: ``(name, parameter)`` pairs that require grad, in model order; the same
            names, shapes and dtypes, in the same order, on every rank.
        strategy: the bucket plan (``fuse_all_reduce_ops``, ``fuse_grad_size_in_MB``, ...),
            the allreduce algorithm and ``nccl_comm_num``, the gradient compression,
            ``sync_nccl_allreduce`` and ``find_unused_parameters``.
        optimizer: read only for DGC's momentum (``strategy.dgc``); may be None otherwise.
        plan: an explicit bucket plan, used instead of the one the strategy's fusion fields
            would make.
        communicators: ``(process groups, allreduce functions)`` already made for
            ``strategy``'s algorithm and ``nccl_comm_num``, to share them; by default new
            ones are made, which is collective: every rank must then call this in the same
            order.
        check_finite: record in ``reducer.last_finite`` whether the reduced gradients are
            free of inf/NaN (AMP loss scaling).

    Returns:
        ``(reducer, compressors)``: one compressor per communicator, the allreduce functions
        the reducer runs (their ``stats`` count the bytes sent).
    """
    if communicators is None:
        communicators = build_comm(strategy).pair
    comms, fns = communicators
    if plan is None:
        specs = [
            GradSpec(i, n, p.numel(), p.dtype, p.device, layer_of(n))
            for i, (n, p) in enumerate(named_params)
        ]
        plan = plan_buckets(
            specs,
            fuse=strategy.fuse_all_reduce_ops,
            cap_mb=fuse_grad_size_mb(strategy),
            max_layers=int(strategy.fuse_grad_size_in_TFLOPS),
            last_cap_mb=float(strategy.last_comm_group_size_MB),
        )
        described = plan.describe(len(specs))
    else:
        described = f"{len(named_params)} gradient tensors in {len(plan)} explicit buckets"
    # pre-divided buckets: half precision cannot overflow the sum
    entry, config = _compression(strategy, optimizer)
    compressors = [
        make_compressor(entry.name, fn, g, config) for fn, g in zip(fns, comms, strict=True)
    ]
    fns = list(compressors)
    # a lossy compressor must not touch the used-parameter flags: they go apart, exactly
    flag_fns = [c.exact for c in compressors] if entry.lossy else None
    if strategy.sync_nccl_allreduce:
        fns = [SerialAllreduce(fn) for fn in fns]
        if flag_fns is not None:  # the flags join the same chain: one order on every rank
            flag_fns = [functools.partial(s, fn=f) for s, f in zip(fns, flag_fns, strict=True)]
    if cluster.rank() == 0:
        log.info(
            "%s over %d communicator(s)%s",
            described,
            len(fns),
            ", one allreduce in flight per communicator" if strategy.sync_nccl_allreduce else "",
        )
    reducer = Reducer(
        named_params,
        plan,
        fns,
        world_size=dist.get_world_size(),
        find_unused_parameters=strategy.find_unused_parameters,
        check_finite=check_finite,
        flag_fns=flag_fns,
    )
    for compressor in compressors:
        if hasattr(compressor, "set_layout"):
            for buffer, layout in reducer.bucket_layouts():
                compressor.set_layout(buffer, layout)
    return reducer, compressors


def _candidate_builder(
    named: list[tuple[str, nn.Parameter]],
    strategy: Strategy,
    optimizer: torch.optim.Optimizer | None,
    check_finite: bool,
    comm: Comm,
) -> Builder:
    """Strategy(auto=True)'s candidate reducers, through ``build_reducer``; candidates with
    the same algorithm and ``nccl_comm_num`` share communicators (the defaults' ``comm``)."""
    cache = {(comm.choice.algorithm, len(comm.groups)): comm.pair}

    def build(candidate: Candidate) -> tuple[Reducer, list]:
        changed = candidate.apply(strategy)
        key = (candidate.algorithm, candidate.nccl_comm_num)
        if key not in cache:
            cache[key] = build_comm(changed).pair
        return build_reducer(
            named, changed, optimizer, communicators=cache[key], check_finite=check_finite
        )

    return build


def _check_devices(named: list[tuple[str, nn.Parameter]]) -> None:
    backend = dist.get_backend()
    for name, p in named:
        if backend == "nccl" and p.device.type != "cuda":
            raise ValueError(
                f"parameter {name!r} is on {p.device} but the backend is NCCL: move the model "
                f"to its GPU first, e.g. model.to('cuda:{cluster.local_rank()}')"
            )
        if backend == "gloo" and p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"parameter {name!r} is on {p.device}, which Gloo cannot reduce")


def _apply_runtime_settings(strategy: Strategy) -> None:
    """Fleet fields that map onto PyTorch process settings, applied only when set.

    At their defaults PyTorch's own behaviour is left alone.
    """

    def was_set(field: str) -> bool:
        return strategy.source(field) != "default"

    if was_set("num_threads"):
        torch.set_num_threads(int(strategy.num_threads))
    if was_set("cudnn_exhaustive_search"):
        torch.backends.cudnn.benchmark = bool(strategy.cudnn_exhaustive_search)
    if was_set("conv_workspace_size_limit"):
        os.environ["CUDNN_CONV_WSCAP_DBG"] = str(int(strategy.conv_workspace_size_limit))


def _wants_compiled_fusion(strategy: Strategy) -> bool:
    return bool(
        strategy.fuse_elewise_add_act_ops
        or strategy.fuse_bn_act_ops
        or strategy.fuse_relu_depthwise_conv
    )
