"""What the core checks about ``torch.compile`` on every step: compiled autograd is refused
(at backward), and a graph compiled outside longboat's control is named once (it loses the
overlap). Kept apart from `longboat.integrations.compile`, which compiles a model cut at its
buckets: the reducer and the model run these checks without importing the compile path."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from longboat.log import get_logger

log = get_logger("longboat.compile")

HOW = (
    "compile the model lb.distribute returns with model.compile(...) or lb.compile(model, ...) "
    "(the arguments of torch.compile), which cuts the compiled graph at longboat's bucket "
    "boundaries (docs/compile.md)"
)
"""How to compile a longboat model and keep its overlap (named in every compile message)."""

_COMPILED_NODE = "CompiledFunctionBackward"  # the autograd node of an AOT-compiled graph
_SEARCH = 32  # autograd nodes looked at, from the output, for a compiled one


def refuse_compiled_autograd() -> None:
    """Raise if compiled autograd is on: it traces the whole backward, the reducer's gradient
    hooks included, into one graph, so buckets could not launch during backward."""
    from torch._dynamo import compiled_autograd

    if (
        torch._dynamo.config.compiled_autograd
        or compiled_autograd.compiled_autograd_enabled
        or compiled_autograd.in_compiled_autograd_region
    ):
        raise RuntimeError(
            "compiled autograd (torch._dynamo.config.compiled_autograd or "
            "torch._dynamo.compiled_autograd.enable) is not supported with longboat: it "
            "traces the whole backward, longboat's gradient hooks included, into one graph. "
            f"Turn it off; to compile the model with overlap, {HOW}."
        )


def compiled_elsewhere(output: Any) -> bool:
    """Does ``output``'s autograd history (its first nodes) hold a compiled graph's backward?"""
    stack = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn]
    seen: set[Any] = set()
    while stack and len(seen) < _SEARCH:
        fn = stack.pop()
        if fn in seen:
            continue
        if type(fn).__name__ == _COMPILED_NODE:
            return True
        seen.add(fn)
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return False


def warn_compiled_elsewhere() -> None:
    """Say (once per model) that a compiled graph outside longboat's control loses overlap."""
    log.warning(
        "this model runs a graph compiled by torch.compile: its backward is one autograd "
        "node, so every gradient bucket launches only once all of it has run (no overlap "
        "with backward; results are unchanged). torch.compile cuts the graph at the buckets "
        "of torch's own DistributedDataParallel only. The one-line fix: write "
        "model.compile(...) in place of model = torch.compile(model, ...), with the same "
        "arguments. Otherwise, to keep overlap, %s.",
        HOW,
    )
