"""``hvd.DistributedOptimizer``: Horovod's optimizer wrapper on longboat's gradient reducer.

Gradients are averaged by the same :class:`~longboat.collective.reducer.Reducer` that
``lb.distribute`` installs, built through the same door (``longboat.dispatch.enter_reducer``):
per-parameter hooks fill
fused buckets (``fuse_grad_size_in_MB``, or ``HOROVOD_FUSION_THRESHOLD`` bytes; 0 turns fusion
off) that are allreduced asynchronously while backward goes on, on ``nccl_comm_num``
communicators, optionally as float16 (``compression=hvd.Compression.fp16``: the core's fp16
compressor). Bucket order is fixed by the parameter list, which is checked to be the same on
every rank when the optimizer is built, so no per-step negotiation is needed.

``backward_passes_per_step=k``: the first k-1 backward passes accumulate locally; the k-th
reduces the accumulated sum. ``step()`` (unless inside ``skip_synchronize()``) first calls
``synchronize()``, which, after fewer than k passes, reduces what has accumulated so far (as
Horovod does). ``gradient_predivide_factor`` is accepted: the core always divides by the world
size before summing, the overflow-safe end of Horovod's range, with the same average.

``sparse_as_dense=True``: a sparse gradient is densified for the allreduce and turned back
into a sparse tensor (its own sparse dimensions) by ``synchronize()``, as Horovod does, so
``torch.optim.SparseAdam`` still gets the sparse gradient it needs.
``optimizer._parameter_names`` maps each parameter to its name, as in Horovod.

``optimizer.rebuild()`` moves the averaging to the current process group after an elastic
membership change (``hvd.elastic.run`` calls it for every live DistributedOptimizer).

As in Horovod, ``hvd.DistributedOptimizer(opt)`` returns a new object whose class is a subclass
of ``type(opt)`` (same name) with ``_DistributedOptimizer`` in front, so the returned optimizer
is still an instance of the user's class (``broadcast_optimizer_state`` relies on that). It
shares ``opt``'s param groups, state and defaults; ``opt`` itself is left unchanged: use the
returned optimizer. (``lb.distribute`` wraps optimizers its own way: `longboat.optim.staged`.)
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import nn

from longboat.collective.buckets import BucketPlan
from longboat.collective.reducer import Reducer
from longboat.comm import algorithms
from longboat.dispatch import enter_reducer
from longboat.horovod.torch import basics
from longboat.horovod.torch.compression import Compression, Compressor
from longboat.horovod.torch.negotiation import MB, ReduceOp, env_float
from longboat.horovod.torch.ops import (
    Average,
    ProcessSet,
    Sum,
    global_process_set,
    set_size,
    synchronize,
)
from longboat.horovod.torch.optimizer_checks import (
    all_named,
    check_same_everywhere,
    checked_arguments,
    parameter_names,
    trainable_named,
)
from longboat.horovod.torch.sparse import sparse_allreduce_async
from longboat.optim.staged import claim
from longboat.strategy import Strategy

_MORE_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
_ZERO_GRAD_RACE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
# every DistributedOptimizer made in this process, in order
_live: list[weakref.ref[_DistributedOptimizer]] = []
M = TypeVar("M", bound=torch.optim.Optimizer)


class _DistributedOptimizer(torch.optim.Optimizer):
    """Put in front of the user's optimizer class by `DistributedOptimizer` (see the module
    docstring); never instantiated on its own."""

    _hvd_reducer: Reducer
    _hvd_compressors: list[Any]
    _hvd_hooks: list[Any]  # the per-parameter hook handles, registered before the reducer's
    _hvd_passes: int
    _hvd_in_pass: bool
    _hvd_divisor: float
    _hvd_should_sync: bool
    _hvd_synchronized: bool
    _hvd_named: list[tuple[str, nn.Parameter]]
    _hvd_strategy: Strategy
    _hvd_plan: BucketPlan | None
    _hvd_average: bool
    _hvd_process_set: ProcessSet
    _hvd_sparse: dict[str, tuple[torch.Tensor, Any]]  # sparse gradients in flight, by name
    _hvd_densified: dict[str, tuple[torch.Tensor, int]]  # sparse_as_dense: param, sparse dims
    _parameter_names: dict[torch.Tensor, str]  # Horovod's attribute: parameter -> name
    backward_passes_per_step: int

    def _hvd_hook(self, name: str, sparse_as_dense: bool, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is not None and grad.is_sparse:
            if sparse_as_dense:
                self._hvd_densified.setdefault(name, (param, grad.sparse_dim()))
                param.grad = grad.to_dense()
            else:
                self._hvd_sparse_grad(name, param, grad)
        if self._hvd_in_pass:
            return
        if self._hvd_passes >= self.backward_passes_per_step:
            raise AssertionError(_MORE_PASSES)
        self._hvd_in_pass = True
        torch.autograd.Variable._execution_engine.queue_callback(self._hvd_end_pass)
        last = self._hvd_passes + 1 == self.backward_passes_per_step
        self._hvd_reducer.prepare(sync=last, divisor=self._hvd_divisor)

    def _hvd_sparse_grad(self, name: str, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Horovod's sparse path: allgather the indices and values (``sparse_allreduce_async``);
        the fused bucket carries zeros in this parameter's slot meanwhile."""
        if self.backward_passes_per_step > 1:
            raise NotImplementedError(
                f"parameter {name!r} has a sparse gradient: with backward_passes_per_step > 1 "
                "longboat.horovod needs hvd.DistributedOptimizer(..., sparse_as_dense=True)"
            )
        if name in self._hvd_sparse:
            raise AssertionError(_MORE_PASSES)
        op = Average if self._hvd_average else Sum
        handle = sparse_allreduce_async(grad, name, op, self._hvd_process_set)
        self._hvd_sparse[name] = (param, handle)
        param.grad = torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)

    def _hvd_end_pass(self) -> None:
        self._hvd_passes += 1
        self._hvd_in_pass = False

    def synchronize(self) -> None:
        """Finish gradient averaging now; after fewer than k passes, reduce what accumulated."""
        if 0 < self._hvd_passes < self.backward_passes_per_step:
            reducer = self._hvd_reducer
            reducer.prepare(sync=True, divisor=self._hvd_divisor)
            reducer.flush()
        self._hvd_passes = 0
        self._hvd_synchronized = True
        pending, self._hvd_sparse = self._hvd_sparse, {}
        for param, handle in pending.values():
            param.grad = synchronize(handle)
        densified, self._hvd_densified = self._hvd_densified, {}
        for param, sparse_dims in densified.values():  # back to sparse, as Horovod
            if param.grad is not None and not param.grad.is_sparse:
                param.grad = param.grad.to_sparse(sparse_dims)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._hvd_should_sync = False
        try:
            yield
        finally:
            self._hvd_should_sync = True

    def rebuild(self) -> None:
        """Average over the current process group from now on (elastic training).

        Collective, after a new world formed (every rank, live optimizers in creation order):
        the same collectives as building a DistributedOptimizer, so a rank that joined late
        meets them in its own ``hvd.DistributedOptimizer(...)``. The old reducer's gradient
        hooks are removed, the divisor follows the new ``hvd.size()`` and a half-done
        accumulation is dropped (the state is restored or synced after this).
        """
        self._hvd_reducer.remove_hooks()
        reducer, compressors, world = _reducer(
            self._hvd_named,
            self._hvd_strategy,
            self,
            self._hvd_plan,
            self._hvd_process_set,
            again=True,
        )
        self._hvd_reducer, self._hvd_compressors = reducer, compressors
        self._hvd_divisor = float(world if self._hvd_average else 1)
        self._hvd_sparse = {}
        self._hvd_densified = {}
        self._hvd_passes = 0
        self._hvd_in_pass = False
        self._hvd_synchronized = False

    def step(self, closure: Any = None) -> Any:
        if self._hvd_should_sync:
            if self._hvd_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_passes > 0:
            raise AssertionError(_ZERO_GRAD_RACE)
        super().zero_grad(set_to_none)


class _OutsideSet(torch.optim.Optimizer):
    """A DistributedOptimizer on a rank outside its process set: as in Horovod, nothing is
    reduced there (no hooks); ``step()`` is the wrapped optimizer's own."""

    backward_passes_per_step: int
    _parameter_names: dict[torch.Tensor, str]  # Horovod's attribute: parameter -> name

    def synchronize(self) -> None:
        """Nothing to wait for outside the process set."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        yield

    def rebuild(self) -> None:
        """Nothing to move: this rank reduces no gradients."""


def local_step(optimizer: torch.optim.Optimizer) -> Any:
    """The wrapped optimizer's own ``step`` (no synchronize), or ``optimizer.step``."""
    if isinstance(optimizer, _DistributedOptimizer):
        return super(_DistributedOptimizer, optimizer).step
    return optimizer.step


_classes: dict[tuple[type, type], type] = {}  # (user's class, mixin) -> the wrapper class


def _subclass(base: type, mixin: type[M]) -> type[M]:
    """Horovod's wrapper class: ``mixin`` in front of ``base``, under ``base``'s name (one class
    per pair, so optimizers wrapped alike share it)."""
    key = (base, mixin)
    if key not in _classes:
        _classes[key] = type(base.__name__, (mixin, base), {"__module__": mixin.__module__})
    return _classes[key]


def _new_like(optimizer: torch.optim.Optimizer, mixin: type[M]) -> M:
    """A new object of ``type(optimizer)`` with ``mixin`` in front, holding ``optimizer``'s
    attributes (its param groups, state, defaults and hooks: the same objects). A method the
    object carries itself (an LR scheduler's ``step`` patch) is bound to ``optimizer``, so it
    is left behind."""
    if isinstance(optimizer, _DistributedOptimizer | _OutsideSet):
        raise ValueError("this optimizer is already a hvd.DistributedOptimizer")
    klass = _subclass(type(optimizer), mixin)
    new = cast(M, object.__new__(klass))
    new.__dict__.update(
        (k, v) for k, v in vars(optimizer).items() if not callable(getattr(klass, k, None))
    )
    return new


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, nn.Parameter]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """A new optimizer, an instance of ``type(optimizer)`` sharing its param groups and state,
    whose ``step`` averages gradients across ranks first (see the module docstring)."""
    basics.size()  # ValueError before hvd.init(), as Horovod
    outside = process_set is not None and process_set is not global_process_set
    if outside and process_set.included() is False:
        lone = _new_like(optimizer, _OutsideSet)
        lone.backward_passes_per_step = int(backward_passes_per_step)
        lone._parameter_names = parameter_names(all_named(optimizer, named_parameters))
        return lone
    set_size(process_set)  # ValueError for a set that is not registered
    op = checked_arguments(
        optimizer, op, gradient_predivide_factor, backward_passes_per_step, compression
    )
    dopt = _new_like(optimizer, _DistributedOptimizer)
    if num_groups:
        warnings.warn("num_groups is deprecated; use groups", DeprecationWarning, stacklevel=2)
        groups = groups or num_groups
    every_named = all_named(optimizer, named_parameters)
    named = trainable_named(optimizer, every_named)
    strategy = _strategy(compression)
    plan = _explicit_plan(named, groups) if groups else None
    if plan is not None:  # Horovod's groups have always run without the one-in-flight chain
        strategy.sync_nccl_allreduce = False
    hooks = [  # before the reducer's hooks: they must run first
        p.register_post_accumulate_grad_hook(
            functools.partial(_on_grad, dopt, name, sparse_as_dense)
        )
        for name, p in named
    ]
    # the core's reducer and its compressors; with Horovod's ``groups``, over that plan
    try:
        reducer, compressors, world = _reducer(named, strategy, optimizer, plan, process_set)
    except BaseException:
        for hook in hooks:
            hook.remove()
        raise
    dopt.backward_passes_per_step = int(backward_passes_per_step)
    dopt._hvd_passes, dopt._hvd_in_pass = 0, False
    dopt._hvd_should_sync, dopt._hvd_synchronized = True, False
    dopt._hvd_divisor = float(world if op == Average else 1)
    dopt._hvd_hooks = hooks
    dopt._hvd_reducer, dopt._hvd_compressors = reducer, compressors
    dopt._hvd_named, dopt._hvd_strategy, dopt._hvd_plan = named, strategy, plan
    dopt._hvd_average, dopt._hvd_process_set = op == Average, process_set
    dopt._hvd_sparse, dopt._hvd_densified = {}, {}
    dopt._parameter_names = parameter_names(every_named)
    _live[:] = [ref for ref in _live if ref() is not None]
    _live.append(weakref.ref(dopt))
    claim(dopt, "hvd.DistributedOptimizer")  # lb.distribute would average its grads again
    return dopt


def live_optimizers() -> list[_DistributedOptimizer]:
    """The DistributedOptimizers of this process still in use, in the order they were made."""
    return [opt for opt in (ref() for ref in _live) if opt is not None]


def _on_grad(optimizer: Any, name: str, sparse_as_dense: bool, param: torch.Tensor) -> None:
    """A parameter's gradient is accumulated: the new optimizer counts it (its hooks go on
    before the reducer's; its fields are set once the reducer is built)."""
    optimizer._hvd_hook(name, sparse_as_dense, param)


def _reducer(
    named: list[tuple[str, nn.Parameter]],
    strategy: Strategy,
    optimizer: Any,
    plan: BucketPlan | None,
    process_set: ProcessSet | None,
    *,
    again: bool = False,
) -> tuple[Reducer, list[Any], int]:
    """The core reducer over every rank, or over ``process_set``'s gradient group; with the
    number of ranks it averages over. The parameters are checked first. ``again``: an
    elastic rebuild of ``optimizer``'s own reducer."""
    door = "hvd.DistributedOptimizer"
    if process_set is None or process_set is global_process_set:
        check_same_everywhere(named)
        reducer, compressors = enter_reducer(
            named, optimizer, strategy, door, again=again, buckets=plan
        )
        return reducer, compressors, basics.size()
    group = process_set.groups[2]
    check_same_everywhere(named, group)
    comms = ([group], [algorithms.make("native", group)])
    reducer, compressors = enter_reducer(
        named, optimizer, strategy, door, again=again, buckets=plan, communicators=comms
    )
    world = set_size(process_set)
    reducer.world_size = world  # the core sizes it from the job; the set is smaller
    return reducer, compressors, world


def _strategy(compression: type[Compressor]) -> Strategy:
    strategy = Strategy(find_unused_parameters=True)  # Horovod reduces missing grads as zeros
    threshold = env_float("HOROVOD_FUSION_THRESHOLD", -1)
    if threshold == 0:
        strategy.fuse_all_reduce_ops = False
    elif threshold > 0:
        strategy.fuse_grad_size_in_MB = threshold / MB
    if compression is Compression.fp16:
        strategy.fp16_allreduce = True
    return strategy


def _explicit_plan(
    named: list[tuple[str, nn.Parameter]], groups: int | Sequence[Sequence[torch.Tensor]]
) -> BucketPlan:
    """Horovod's ``groups``: N groups of consecutive parameters, or explicit lists."""
    index = {id(p): i for i, (_, p) in enumerate(named)}
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups must be a non-negative int or a list of lists, got {groups}")
        order = list(reversed(range(len(named))))  # backward produces the last layers first
        size = -(-len(order) // groups)
        chunks = [order[i : i + size] for i in range(0, len(order), size)]
    else:
        chunks, placed = [], set()
        for g, group in enumerate(groups):
            members = []
            for t in group:
                i = index.get(id(t))
                if i is None:
                    raise ValueError(
                        f"groups[{g}] holds a tensor that this optimizer does not train"
                    )
                if i in placed:
                    raise ValueError(f"parameter {named[i][0]!r} is in more than one group")
                placed.add(i)
                members.append(i)
            chunks.append(members)
        chunks += [[i] for i in range(len(named)) if i not in placed]  # the rest: one each
        chunks.sort(key=lambda c: -max(c))  # ready first: the group whose last grad comes first
    buckets: list[tuple[int, ...]] = []
    for chunk in chunks:
        by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i in chunk:
            p = named[i][1]
            by_kind.setdefault((p.dtype, p.device), []).append(i)
        buckets += [tuple(members) for members in by_kind.values() if members]
    return BucketPlan(tuple(buckets), cap_bytes=0, max_layers=0, fused=True)
