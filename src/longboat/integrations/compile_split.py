"""Split a dynamo graph at longboat's bucket boundaries, so a compiled backward keeps overlap.

A compiled forward graph becomes one autograd node: its backward produces every gradient at
once, at its end, and no bucket can be launched before then. Cut into pieces, each piece's
backward is a node of its own: the autograd engine runs them last piece first, and the
gradients of each piece are final (their post-accumulate-grad hooks fire, buckets launch) while
the earlier pieces still compute.

The cuts come from the reducer's bucket plan, not from a byte count of its own: a cut is made
only where the parameters used before it and after it fall in disjoint sets of buckets, so
every piece produces the gradients of whole buckets, and at every such place (the finest split
that keeps buckets whole). Each piece is compiled by the backend the user asked for, through
torch's own piece compiler (the one ``DistributedDataParallel`` under ``torch.compile`` uses).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx

from longboat.log import get_logger

log = get_logger("longboat.compile")

CompilerFn = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]

_BOUNDARY_OPS = ("placeholder", "get_attr", "output")


def _leaf_buckets(
    gm: fx.GraphModule, example_inputs: Sequence[Any], bucket_of: dict[int, int]
) -> dict[fx.Node, int]:
    """The bucket of each graph input or attribute that is a parameter the reducer owns."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values: list[tuple[fx.Node, Any]] = []
    if len(placeholders) == len(example_inputs):  # dynamo's graphs: one value per input
        values += zip(placeholders, example_inputs, strict=True)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                values.append((node, operator.attrgetter(str(node.target))(gm)))
            except AttributeError:
                continue
    return {node: bucket_of[id(v)] for node, v in values if id(v) in bucket_of}


def _node_buckets(
    gm: fx.GraphModule, leaves: dict[fx.Node, int], bucket_of: dict[int, int]
) -> dict[fx.Node, set[int]]:
    """Buckets whose parameters each operation reads, directly or through parameter-only ops.

    ``w.t()`` feeding ``mm(x, t)``: the transpose reads only ``w``, so ``mm`` counts as reading
    ``w`` too, and no cut falls between them (``w``'s gradient comes out of ``mm``'s backward).
    A call to a submodule reads that submodule's parameters.
    """
    pure: dict[fx.Node, set[int]] = {n: {b} for n, b in leaves.items()}  # parameter-only values
    reads: dict[fx.Node, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op in _BOUNDARY_OPS:
            continue
        inputs = node.all_input_nodes
        buckets = set().union(*(pure[i] for i in inputs if i in pure))
        if node.op == "call_module":
            owned = gm.get_submodule(str(node.target)).parameters()
            buckets |= {bucket_of[id(p)] for p in owned if id(p) in bucket_of}
        reads[node] = buckets
        if inputs and buckets and all(i in pure for i in inputs):
            pure[node] = buckets
    return reads


@dataclass(frozen=True)
class Split:
    """Where a graph is cut: each operation's piece (0 runs first in forward), and the
    buckets whose parameters each piece reads."""

    pieces: dict[fx.Node, int]
    buckets: tuple[frozenset[int], ...]

    def __len__(self) -> int:
        return len(self.buckets)


def plan_split(
    gm: fx.GraphModule, example_inputs: Sequence[Any], bucket_of: dict[int, int]
) -> Split:
    """Cut ``gm`` into pieces that each read the parameters of whole buckets, finest first.

    ``bucket_of`` maps ``id(parameter)`` to its bucket. A cut before operation ``c`` is
    allowed when no bucket is read both before ``c`` and from ``c`` on; it is made right
    before an operation that reads a parameter (activations and the like stay with the layer
    before) and only with parameters read on both sides. No allowed cut: one piece.
    """
    reads = _node_buckets(gm, _leaf_buckets(gm, example_inputs, bucket_of), bucket_of)
    ops = list(reads)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for pos, node in enumerate(ops):
        for b in reads[node]:
            first.setdefault(b, pos)
            last[b] = pos
    opened = [0] * (len(ops) + 1)  # +1 where a bucket starts spanning cut positions, -1 ends
    for b, f in first.items():
        opened[f + 1] += 1
        opened[last[b] + 1] -= 1
    pieces: dict[fx.Node, int] = {}
    buckets: list[set[int]] = [set()]
    spanning = 0
    for pos, node in enumerate(ops):
        spanning += opened[pos]
        if reads[node] and buckets[-1] and spanning == 0:
            buckets.append(set())
        buckets[-1] |= reads[node]
        pieces[node] = len(buckets) - 1
    return Split(pieces, tuple(frozenset(b) for b in buckets))


class BucketSplitter:
    """A dynamo backend: cut each graph at the reducer's bucket boundaries (`plan_split`) and
    compile every piece with ``inner``, the backend the user asked for.

    ``bucket_of()`` is read at every compilation (the reducer in use then). ``splits`` keeps
    each compiled graph's per-piece buckets, last piece first: the order their gradients
    come out of backward.
    """

    def __init__(self, bucket_of: Callable[[], dict[int, int]], inner: CompilerFn):
        self.bucket_of = bucket_of
        self.inner = inner
        self.splits: list[tuple[frozenset[int], ...]] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> BucketSplitter:
        """Itself: a backend is called, never copied. Lightning replaces ``torch.compile``
        with a wrapper that deep-copies its arguments, and ``bucket_of`` reads a live model."""
        return self

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        split = plan_split(gm, example_inputs, self.bucket_of())
        self.splits.append(tuple(reversed(split.buckets)))
        log.debug("compiled graph cut into %d piece(s), buckets %s", len(split), split.buckets)
        if len(split) == 1:
            return self.inner(gm, example_inputs)
        return _compile_pieces(gm, example_inputs, split, self.inner)


def _compile_pieces(
    gm: fx.GraphModule, example_inputs: list[Any], split: Split, inner: CompilerFn
) -> Callable[..., Any]:
    """``gm`` split into ``split``'s pieces, each compiled by ``inner`` (torch's piece compiler
    threads fake tensors and per-piece metadata from one piece to the next)."""
    from torch._dynamo.backends.distributed import (
        SubmodCompiler,
        propagate_dynamo_source,
        propagate_metadata,
    )
    from torch._dynamo.utils import _disable_saved_tensors_hooks_during_tracing, detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.split_module import split_module

    split_gm = split_module(gm, None, lambda node: split.pieces[node])  # type: ignore[arg-type]
    propagate_dynamo_source(gm, split_gm)
    propagate_metadata(gm, split_gm)
    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode()
    with _disable_saved_tensors_hooks_during_tracing():
        SubmodCompiler(split_gm, inner, fake_mode).run(*example_inputs)
    split_gm.recompile()
    return split_gm
