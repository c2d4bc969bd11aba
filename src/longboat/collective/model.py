"""DistributedModel: the module wrapper returned by ``lb.distribute``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from longboat.collective.amp import Amp
from longboat.collective.compile_guard import compiled_elsewhere, warn_compiled_elsewhere
from longboat.collective.consistency import broadcast_state
from longboat.collective.localsgd import AdaptiveLocalSGD, LocalSGD
from longboat.collective.plan import CollectivePlan
from longboat.collective.reducer import Reducer
from longboat.comm.compress import Compressor
from longboat.integrations.compile import compiled_with, cut_at_buckets, user_backend
from longboat.integrations.compile_split import BucketSplitter, CompilerFn

if TYPE_CHECKING:
    from longboat.collective.autotune import AutoTuner


class PendingWrites(Protocol):
    """Parameter values the optimizer's step left to be written later (sharding's gathers)."""

    def finish(self) -> None:
        """Write them all now."""

    def discard(self) -> None:
        """Forget them (the parameters are about to be replaced)."""


class DistributedModel(nn.Module):
    """Wraps a module so that backward averages gradients across ranks.

    Call it like the module. ``model.module`` is the original. Gradient merge
    (``gradient_merge_configs.k_steps = k``) counts training forwards: only every k-th
    backward communicates. ``no_sync()`` turns communication off for the backward passes
    of forwards run inside it; their gradients accumulate locally until the next synced one.
    ``compile(...)`` compiles the module with ``torch.compile``'s arguments, keeping overlap
    (`longboat.integrations.compile`); this wrapper's own forward always runs eagerly.
    """

    def __init__(
        self,
        module: nn.Module,
        reducer: Reducer,
        *,
        k_steps: int,
        merge_avg: bool,
        communicate: bool = True,
        amp: Amp | None = None,
        compressors: Sequence[Compressor] = (),
        local_sgd: LocalSGD | AdaptiveLocalSGD | None = None,
        tuner: AutoTuner | None = None,
        plan: CollectivePlan | None = None,
    ):
        super().__init__()
        self.amp = amp
        self.compressors = tuple(compressors)  # one per communicator, each with ``.stats``
        self.local_sgd = local_sgd  # LocalSGD / AdaptiveLocalSGD when it replaces the reducer
        self.tuner = tuner  # Strategy(auto=True): an AutoTuner that swaps the reducer
        self.plan = plan  # the plan lb.distribute resolved (None for a model built by hand)
        self.communicate = communicate  # False under local SGD: parameters are averaged instead
        self.module = module
        self.reducer = reducer
        self.k_steps = k_steps
        self.merge_avg = merge_avg
        self.micro_step = 0
        self._no_sync = False
        self._index = {id(p): i for i, p in enumerate(reducer.params)}
        self._call_module: Callable[..., Any] = module.__call__  # compile() may point it on
        self.splitter: BucketSplitter | None = None  # set by compile()
        self._compile_warned = False
        self.pending_writes: PendingWrites | None = None  # sharding: gathers written lazily

    def replace_reducer(
        self,
        reducer: Reducer,
        compressors: Sequence[Compressor],
        plan: CollectivePlan | None = None,
        *,
        keep_observer: bool = True,
    ) -> None:
        """Install ``reducer`` (built for ``plan``, running ``compressors``) in place of the
        current one: the one way the tuner and an elastic rebuild swap it.

        The old reducer's gradient hooks are removed. ``keep_observer``: the timeline and
        stall inspector move to the new reducer and watch its buckets from here on (False:
        they belonged to a world that is gone; ``longboat.trace.attach`` installs new ones).
        """
        self.settle_parameters()  # the old world's gathers land before anything is rebuilt
        old = self.reducer
        old.remove_hooks()
        observer = old.observer if keep_observer else None
        reducer.observer = observer
        if observer is not None and observer.watch is not None:
            observer.watch.switch(reducer.bucket_members())
        self.reducer = reducer
        self.compressors = tuple(compressors)
        if plan is not None:
            self.plan = plan
        self._index = {id(p): i for i, p in enumerate(reducer.params)}

    def compile(  # type: ignore[override]
        self,
        *,
        backend: str | Callable[..., Any] = "inductor",
        mode: str | None = None,
        options: dict[str, Any] | None = None,
        dynamic: bool | None = None,
        fullgraph: bool = False,
    ) -> None:
        """``torch.compile`` the module in place (the arguments are ``torch.compile``'s), cut
        at the reducer's buckets so that they launch during the compiled backward, as soon as
        the backward of their piece is done (`longboat.integrations.compile`)."""
        self._cut_at_buckets(user_backend(backend, mode, options, dynamic), dynamic, fullgraph)

    def keep_overlap(self) -> None:
        """``lb.distribute`` of a module compiled with ``torch.compile``: recompile it cut at
        the buckets, with the backend and settings it was compiled with. Where they cannot be
        read, it stays as it is, and its first forward says that overlap is lost."""
        found = compiled_with(self._modules["module"])  # type: ignore[arg-type]
        if found is not None:
            self._cut_at_buckets(*found)

    def _cut_at_buckets(self, backend: CompilerFn, dynamic: bool | None, fullgraph: bool) -> None:
        module = self._modules["module"]
        assert module is not None
        self._call_module, self.splitter = cut_at_buckets(
            module, self._bucket_of, backend, dynamic, fullgraph
        )

    def _bucket_of(self) -> dict[int, int]:
        """``id(parameter)`` to the index (launch order) of the current reducer's bucket
        holding it: read at every compilation, so a swapped reducer's buckets count."""
        reducer = self.reducer
        index = {name: i for i, name in enumerate(reducer.names)}
        return {
            id(reducer.params[index[name]]): b
            for b, names in enumerate(reducer.bucket_members())
            for name in names
        }

    def runs_eagerly(self) -> bool:
        """Whether the module's forward runs eagerly (not compiled here, nor seen compiled)."""
        module = self._modules["module"]
        compiled = isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
        return self.splitter is None and not self._compile_warned and not compiled

    @property
    def module(self) -> nn.Module:
        """The wrapped module, its parameters complete: reading it writes what the last
        optimizer step left pending first (sharding's ``comm_overlap``), as ``parameters()``
        does, so ``model.module`` hands an EMA or an evaluation helper whole weights."""
        self.settle_parameters()
        return self._modules["module"]  # type: ignore[return-value]

    def settle_parameters(self) -> None:
        """Write what the last optimizer step left pending into the parameters (sharding
        gathers them during the next forward): call it before reading parameters some other
        way than through this model's forward, ``state_dict()``, ``parameters()`` or
        ``module`` (the module object you passed to ``lb.distribute``, after the step)."""
        if self.pending_writes is not None:
            self.pending_writes.finish()

    def drop_pending_writes(self) -> None:
        """Forget what the last step left pending, without waiting for it: before the
        parameters are replaced (an elastic rebuild broadcasts rank 0's, then installs the
        committed state), where waiting could hang on a world that lost a rank."""
        if self.pending_writes is not None:
            self.pending_writes.discard()
            self.pending_writes = None

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        self.settle_parameters()
        return super().named_parameters(*args, **kwargs)

    @torch.compiler.disable(recursive=False)  # the module under it may be compiled
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        training = self.training and torch.is_grad_enabled()
        if not training:
            return self._run(args, kwargs)
        if self.plan is not None and self.plan.broadcast_buffers and not self._no_sync:
            self._buffers_from_rank0()
        sync = self._prepare_step()
        observer = self.reducer.observer  # longboat.trace: timeline and stall inspector
        if observer is not None:
            observer.forward_begin()
        output = self._run(args, kwargs)
        if sync:
            self._warn_once_if_compiled_elsewhere(output)
        if observer is not None:
            observer.forward_end(output)
        if self.amp is not None:
            self.amp.scale_gradients_of(output)
        if sync and self.reducer.find_unused:
            self.reducer.mark_unused(self._unreachable(output))
        return output

    def _prepare_step(self) -> bool:
        """Count the micro step and arm the reducer; whether this backward communicates."""
        self.micro_step += 1
        sync = self.communicate and not self._no_sync and self.is_merge_boundary()
        if sync and self.tuner is not None:
            self.tuner.before_step(self)  # may install another reducer: only at step boundaries
        divisor = self.reducer.world_size * (self.k_steps if self.merge_avg else 1)
        if self.amp is not None:
            divisor *= self.amp.scale  # the loss scale is undone on the way into the buckets
        self.reducer.prepare(sync=sync, divisor=float(divisor))
        return sync

    def _warn_once_if_compiled_elsewhere(self, output: Any) -> None:
        """A graph compiled outside ``compile()`` launches every bucket at its end: say so once."""
        if self._compile_warned or self.splitter is not None:
            return
        self._compile_warned = compiled_elsewhere(output)
        if self._compile_warned:
            warn_compiled_elsewhere()

    def _buffers_from_rank0(self) -> None:
        """``broadcast_buffers``: every rank takes rank 0's buffers (one coalesced broadcast
        per dtype on the default group, queued in forward's program order on every rank)."""
        buffers = [b for b in self._modules["module"].buffers() if b is not None]  # unsettled
        if buffers:
            broadcast_state(buffers, coalesce=True)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        if self.amp is None:
            return self._call_module(*args, **kwargs)
        with self.amp.autocast():
            return self._call_module(*args, **kwargs)

    def bytes_sent(self) -> int:
        """Gradient bytes this rank has sent so far (the difference across a step: per step).

        Counted by the compressors with the ring model (``2·S·(N−1)/N`` per allreduce of
        ``S`` bytes; ``(N−1)·S`` for DGC's allgather; ``S·(d−1)/d`` for sharding stage 2's
        reduce-scatter over ``d`` ranks), so compressed, sharded and plain runs compare.
        Call it after the step's backward (the counters are updated as buckets go out).
        """
        sent = sum(c.stats.bytes_sent for c in self.compressors)
        sent += self.reducer.collective.bytes_sent  # sharding stage 2's reduce-scatters
        if self.local_sgd is not None:  # parameter averaging instead of gradient allreduce
            from longboat.comm.compress import ring_bytes

            sent += ring_bytes(self.local_sgd.bytes_communicated, self.reducer.world_size)
        return sent

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the reduced gradients; under sharding stage 2,
        where each rank holds a slice of them, the norm is taken over every rank's slices.
        Call it between backward and ``optimizer.step()``, on every rank."""
        return self.reducer.collective.clip_grad_norm_(self.reducer.params, max_norm, norm_type)

    def is_merge_boundary(self) -> bool:
        """True when the current micro step completes a gradient-merge cycle."""
        return self.micro_step % self.k_steps == 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient communication for forwards (and their backwards) inside this block."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def _unreachable(self, output: Any) -> list[int]:
        """Indices of parameters the autograd graph of ``output`` does not reach."""
        reached: set[int] = set()
        seen: set[Any] = set()
        stack = [
            t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn
        ]
        while stack:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            variable = getattr(fn, "variable", None)
            if variable is not None:
                reached.add(id(variable))
            stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
        return [i for pid, i in self._index.items() if pid not in reached]
