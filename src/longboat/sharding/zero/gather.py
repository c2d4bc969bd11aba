"""The all-gather of updated parameters after a sharded step, overlapped with the next forward.

After the sharded step each rank holds the new values of its own slice of every bucket only.
`ParameterGather` all-gathers the slices bucket by bucket (at most ``window`` buckets in flight)
and writes the other ranks' slices into the parameters. Through shared memory (ranks of one
CPU node) the slices go from the parameters to the segments and from the segments into the
parameters, with no buffer; elsewhere each bucket in flight needs a full-bucket buffer, whose
other ranks' slices are copied into the parameters.

Once `watch` has learnt from one forward of an eager module who reads which parameter
(`longboat.sharding.zero.readers`), ``after_step`` only launches the first gathers. A
bucket is waited for and written just before the first module of the next forward that reads
one of its parameters (a forward pre-hook), which launches the next one, so the gathers run
while the forward computes. Whatever is still pending is written when the forward ends, and by
``finish()``: the next step, the model's ``state_dict()``, ``load_state_dict()``,
``parameters()`` and ``named_parameters()`` call it first. Until then, and after `stop_overlap`, ``after_step``
gathers and writes every bucket before it returns.

While a parameter waits for the other ranks' slices it is hidden, as FSDP hides a sharded
one: its ``.data`` is one NaN element expanded to its shape (shape and ``numel`` are right,
every value read is NaN, an in-place write raises), never the stale values of the last step,
so code that reads it some other way fails visibly instead of training on old weights.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from longboat.comm.handles import wait_for
from longboat.comm.placed import Placed, PlacedSlices
from longboat.sharding.zero.groups import ShardGroups
from longboat.sharding.zero.layout import BucketShard
from longboat.sharding.zero.readers import ReadersProfile

GATHER_WINDOW = 2
"""Buckets whose all-gather is in flight at once (each needs a full-bucket buffer)."""


class ParameterGather:
    """All-gather the buckets' updated slices into ``params`` (their flat views ``flat``);
    see the module doc."""

    def __init__(
        self,
        buckets: Sequence[BucketShard],
        params: Sequence[torch.Tensor],
        flat: Sequence[torch.Tensor],
        groups: ShardGroups,
        *,
        window: int = GATHER_WINDOW,
    ) -> None:
        self.buckets, self.params, self.flat = buckets, params, flat
        self.groups, self.window = groups, window
        self._bucket_of = {i: s.index for s in buckets for i, _ in s.members}
        self.order: list[int] = [s.index for s in buckets]  # forward order, once profiled
        self._queue: collections.deque[int] = collections.deque()  # not launched yet
        self._flight: dict[int, tuple[torch.Tensor | None, Any, Any]] = {}  # not written
        self._gate = WriteGate()  # closed (and replaced) when the pending gathers are dropped
        # each bucket's slices as pieces of the parameters (None: gathered through buffers)
        self._placed: dict[int, PlacedSlices | None] = {s.index: self._place(s) for s in buckets}
        self._hooks: list[RemovableHandle] = []
        self._root: nn.Module | None = None
        self._profile: ReadersProfile | None = None
        self._hidden: dict[int, torch.Tensor] = {}  # parameter -> its real .data, while hidden
        self._partial = {  # parameters with elements other ranks update
            i
            for s in buckets
            for i, off in s.members
            if _outside(off, off + flat[i].numel(), s.lo, s.hi)
        }
        self._nan: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    @property
    def overlapping(self) -> bool:
        """Whether the gathers are left to the next forward (the readers are known)."""
        return bool(self._hooks)

    @property
    def pending(self) -> bool:
        """Whether some bucket's gathered slices are not written into the parameters yet."""
        return bool(self._queue or self._flight)

    # -- after the step -------------------------------------------------------------------------

    def after_step(self) -> None:
        """Launch this step's gathers; write them all now unless overlapping."""
        self.finish()  # a step before the next forward: write the previous ones first
        self._queue.extend(self.order)
        self._top_up()
        if not self.overlapping:
            self.finish()
            return
        for b in self.order:
            self._hide(self.buckets[b])

    def finish(self) -> None:
        """Write every pending bucket (launching those not launched yet)."""
        while self.pending:
            self._ready(self._queue[0] if not self._flight else next(iter(self._flight)))

    def watch(self, root: nn.Module) -> None:
        """Learn from ``root``'s next forward (an eager one) who reads what; overlap after."""
        if self._root is None:
            self._root = root
            self._profile = ReadersProfile(root, self.params, self._install)

    def discard(self) -> None:
        """Forget the pending gathers without waiting for them (their world is gone: the
        parameters are about to be replaced) and remove the hooks; hidden parameters get
        their own storage back, whose other ranks' slices hold the last step's values."""
        self._gate.close()  # a gather still running writes nothing into the parameters now
        self._gate = WriteGate()
        self._queue.clear()
        self._flight.clear()
        for i, data in self._hidden.items():
            self.params[i].data = data
        self._hidden.clear()
        self._remove_hooks()

    def stop_overlap(self) -> None:
        """Gather inside the step from now on (a compiled forward would not run the hooks
        where they belong)."""
        self.finish()
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        if self._profile is not None:
            self._profile.cancel()
            self._profile = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    # -- in the forward -------------------------------------------------------------------------

    def _install(self, profile: ReadersProfile) -> None:
        """Order the gathers by first read and hook every module that reads a parameter."""
        self._profile = None
        first = dict.fromkeys(
            self._bucket_of[i] for i in profile.first_read if i in self._bucket_of
        )
        self.order = [*first, *(s.index for s in self.buckets if s.index not in first)]
        index = {id(p): i for i, p in enumerate(self.params)}
        assert self._root is not None
        for module in self._root.modules():
            wanted = set(profile.readers.get(module, ()))
            wanted.update(index.get(id(p), -1) for p in module.parameters(recurse=False))
            needs = sorted({self._bucket_of[i] for i in wanted if i in self._bucket_of})
            if needs:
                self._hooks.append(module.register_forward_pre_hook(self._before(needs)))
        self._hooks.append(self._root.register_forward_hook(self._at_end, always_call=True))
        self._hooks.append(self._root.register_state_dict_pre_hook(self._before_state_dict))
        self._hooks.append(self._root.register_load_state_dict_pre_hook(self._before_load))

    def _before(self, needs: list[int]) -> Any:
        @torch.compiler.disable  # under a compiled caller: run here, eagerly
        def hook(module: nn.Module, args: Any) -> None:
            if self.pending:
                for b in needs:
                    self._ready(b)

        return hook

    @torch.compiler.disable
    def _at_end(self, module: nn.Module, args: Any, output: Any) -> None:
        self.finish()

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.finish()

    def _before_load(self, module: nn.Module, *args: Any) -> None:
        self.finish()  # a hidden parameter cannot be written into (and a partial load keeps
        # the parameters it does not name, complete)

    # -- launching and writing ------------------------------------------------------------------

    def _top_up(self) -> None:
        while self._queue and len(self._flight) < self.window:
            b = self._queue.popleft()
            self._flight[b] = self._launch(self.buckets[b])

    def _ready(self, b: int) -> None:
        """Bucket ``b`` written into the parameters (launching up to it if needed)."""
        while b in self._queue:
            nxt = self._queue.popleft()
            self._flight[nxt] = self._launch(self.buckets[nxt])
        if b in self._flight:
            full, _, handle = self._flight.pop(b)
            self._write(self.buckets[b], full, handle)
        self._top_up()

    def _launch(self, s: BucketShard) -> tuple[torch.Tensor | None, Any, Any]:
        """Start gathering bucket ``s``'s slices: ``(full buffer, this rank's slice,
        handle)``, the buffers kept alive until written; none when the slices go straight
        between the parameters and shared memory."""
        placed = self._placed[s.index]
        if placed is not None:
            handle = self.groups.all_gather_placed(
                dataclasses.replace(placed, gate=self._gate.writing)
            )
            if handle is not None:
                return None, None, handle
            self._placed[s.index] = None  # shm does not take these tensors: buffers from now
        with _plain_tensors():
            mine = torch.empty(s.shard_numel, dtype=s.dtype, device=s.device)
            mine[s.hi - s.lo :].zero_()
            if s.pieces:
                torch._foreach_copy_(
                    [mine[p.at : p.at + p.numel] for p in s.pieces],
                    [self.flat[p.param][p.start : p.stop] for p in s.pieces],
                )
            full = torch.empty(s.shard_numel * self.groups.degree, dtype=s.dtype, device=s.device)
        return full, mine, self.groups.all_gather(full, mine)

    def _place(self, s: BucketShard) -> PlacedSlices | None:
        """Bucket ``s``'s slices as pieces of the parameters: this rank's, and where each
        rank's go (none of this rank's: they are in place). None without shared memory."""
        if self.groups.shard_shm is None:
            return None
        size, me = s.shard_numel, self.groups.index
        rows: list[list[Placed]] = []
        for r in range(self.groups.degree):
            lo, row = r * size, []
            for i, off in s.members:
                a, b = max(lo, off), min(lo + size, off + self.flat[i].numel())
                if a < b and r != me:
                    row.append((a - lo, self.flat[i][a - off : b - off]))
            rows.append(row)
        mine = [(p.at, self.flat[p.param][p.start : p.stop]) for p in s.pieces]
        return PlacedSlices(size, mine, rows)

    def _hide(self, s: BucketShard) -> None:
        """Hide the parameters of ``s`` that other ranks' slices update (see the module doc)."""
        for i, _ in s.members:
            if i in self._partial and i not in self._hidden:
                p = self.params[i]
                key = (p.dtype, p.device)
                if key not in self._nan:
                    with _plain_tensors():
                        nan = torch.full((1,), float("nan"), dtype=p.dtype, device=p.device)
                    self._nan[key] = nan
                self._hidden[i] = p.data
                p.data = self._nan[key].reshape([1] * p.dim()).expand(p.shape)

    def _write(self, shard: BucketShard, full: torch.Tensor | None, handle: Any) -> None:
        """The other ranks' slices into the parameters (this rank's are there already; with
        no buffer, the gather wrote them)."""
        wait_for(handle)  # the copies below (or the parameters, unhidden) read what it wrote
        for i, _ in shard.members:
            if i in self._hidden:
                self.params[i].data = self._hidden.pop(i)
        if full is None:
            return
        dst, src = [], []
        for i, off in shard.members:
            numel = self.flat[i].numel()
            for lo, hi in _outside(off, off + numel, shard.lo, shard.hi):
                dst.append(self.flat[i][lo - off : hi - off])
                src.append(full[lo:hi])
        if dst:
            with _plain_tensors():
                torch._foreach_copy_(dst, src)


class WriteGate:
    """Lets the collective's thread write gathered slices into the parameters until closed;
    `close` waits for a write under way, so none lands after it returns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True

    @contextlib.contextmanager
    def writing(self) -> Iterator[bool]:
        """Held around one write; yields whether to write."""
        with self._lock:
            yield self._open

    def close(self) -> None:
        with self._lock:
            self._open = False


def _plain_tensors() -> contextlib.ExitStack:
    """No autograd, and normal tensors even inside an ``inference_mode`` forward: the gather
    buffers outlive it, and the collective's thread writes into them."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def _outside(start: int, stop: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of ``[start, stop)`` outside ``[lo, hi)``."""
    parts = [(start, min(stop, lo)), (max(start, hi), stop)]
    return [(a, b) for a, b in parts if a < b]
