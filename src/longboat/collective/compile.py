"""``torch.compile`` for a longboat model that keeps backward/communication overlap.

``model.compile(...)`` (or ``lb.compile(model, ...)``) on the model ``lb.distribute`` returns
compiles the wrapped module with the backend, mode and options given, cut at the reducer's
bucket boundaries (`longboat.collective.compile_split`): buckets launch while the rest of the
compiled backward runs, as in eager mode. A module compiled before ``lb.distribute`` (or by
``fuse_elewise_add_act_ops`` and friends) is recompiled the same way, with its own backend.

What loses overlap is named once: a plain ``torch.compile`` of the returned model (its
backward is one autograd node, so every bucket launches at its end). Compiled autograd is
refused: it traces the whole backward, gradient hooks included, into one graph, so the
reducer's hooks could not launch buckets during it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from longboat.collective.compile_split import BucketSplitter, CompilerFn
from longboat.collective.compiled_autograd import HOW
from longboat.log import get_logger

if TYPE_CHECKING:
    from longboat.collective.model import DistributedModel
    from longboat.collective.reducer import Reducer

log = get_logger("longboat.compile")


_COMPILED_NODE = "CompiledFunctionBackward"  # the autograd node of an AOT-compiled graph
_SEARCH = 32  # autograd nodes looked at, from the output, for a compiled one


def compile_model(
    model: DistributedModel,
    *,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
) -> DistributedModel:
    """Compile ``model``'s module in place, cut at its buckets; returns ``model``.

    The arguments are ``torch.compile``'s. Every piece of the graph produces the gradients of
    whole buckets, so they launch as soon as the backward of their piece is done.
    """
    _install(model, _user_backend(backend, mode, options, dynamic), dynamic, fullgraph)
    return model


def keep_overlap(model: DistributedModel) -> None:
    """``lb.distribute`` of a module compiled with ``torch.compile``: recompile it cut at the
    buckets, with the backend and settings it was compiled with. Where they cannot be read,
    it stays as it is, and its first forward says that overlap is lost."""
    module = model.module
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        found = _compiled_with(module)
        if found is not None:
            _install(model, *found)


def _install(
    model: DistributedModel, backend: CompilerFn, dynamic: bool | None, fullgraph: bool
) -> None:
    target = model.module
    if isinstance(target, torch._dynamo.eval_frame.OptimizedModule):
        target = target._orig_mod  # called directly: the outer compile would override ours
    splitter = BucketSplitter(lambda: bucket_of(model.reducer), backend)
    compiled = torch.compile(target, backend=splitter, dynamic=dynamic, fullgraph=fullgraph)
    model._call_module = compiled.__call__  # a method: not a submodule, names stay as they are
    model.splitter = splitter


def bucket_of(reducer: Reducer) -> dict[int, int]:
    """``id(parameter)`` to the index (launch order) of the reducer's bucket holding it."""
    index = {name: i for i, name in enumerate(reducer.names)}
    return {
        id(reducer.params[index[name]]): b
        for b, names in enumerate(reducer.bucket_members())
        for name in names
    }


def _user_backend(
    backend: str | Callable[..., Any],
    mode: str | None,
    options: dict[str, Any] | None,
    dynamic: bool | None,
) -> CompilerFn:
    """The compiler function ``torch.compile(backend=..., mode=..., options=...)`` runs."""
    if mode is not None and options is not None:
        raise ValueError("pass mode or options, not both (as torch.compile)")
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(mode, options, dynamic)
    return torch._TorchCompileWrapper(backend, mode, options, dynamic)


def _compiled_with(module: nn.Module) -> tuple[CompilerFn, bool | None, bool] | None:
    """(compiler function, dynamic, fullgraph) a ``torch.compile``'d module was made with,
    read where torch's own ``DistributedDataParallel`` support reads it; None if absent."""
    context = getattr(module, "dynamo_ctx", None)
    convert = getattr(getattr(context, "callback", None), "_torchdynamo_orig_backend", None)
    backend = getattr(convert, "_torchdynamo_orig_backend", None)
    if not callable(backend):
        return None
    return backend, getattr(context, "_dynamic", None), bool(getattr(context, "fullgraph", False))


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
