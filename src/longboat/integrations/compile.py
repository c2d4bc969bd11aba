"""``torch.compile`` for a longboat model that keeps backward/communication overlap.

``model.compile(...)`` (or ``lb.compile(model, ...)``) on the model ``lb.distribute`` returns
compiles the wrapped module with the backend, mode and options given, cut at the reducer's
bucket boundaries (`longboat.integrations.compile_split`): buckets launch while the rest of the
compiled backward runs, as in eager mode. A module compiled before ``lb.distribute`` (or by
``fuse_elewise_add_act_ops`` and friends) is recompiled the same way, with its own backend
(`compiled_with`). The model installs what `cut_at_buckets` returns
(`longboat.collective.model.DistributedModel.compile`).

What loses overlap (a plain ``torch.compile`` of the returned model, compiled autograd) is
checked by the core itself, on every step: `longboat.collective.compile_guard`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from longboat.integrations.compile_split import BucketSplitter, CompilerFn

M = TypeVar("M", bound=nn.Module)


def compile_model(model: M, **torch_compile_kwargs: Any) -> M:
    """``lb.compile(model, ...)``: ``model.compile(...)`` on the model ``lb.distribute``
    returned, with ``torch.compile``'s arguments; returns ``model``."""
    model.compile(**torch_compile_kwargs)
    return model


def cut_at_buckets(
    module: nn.Module,
    bucket_of: Callable[[], dict[int, int]],
    backend: CompilerFn,
    dynamic: bool | None,
    fullgraph: bool,
) -> tuple[Callable[..., Any], BucketSplitter]:
    """``module`` compiled by ``backend``, each graph cut where ``bucket_of()`` (``id(parameter)``
    to its bucket, read at every compilation) allows: ``(the compiled call, the splitter)``."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        module = module._orig_mod  # called directly: the outer compile would override ours
    splitter = BucketSplitter(bucket_of, backend)
    compiled = torch.compile(module, backend=splitter, dynamic=dynamic, fullgraph=fullgraph)
    return compiled.__call__, splitter


def user_backend(
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


def compiled_with(module: nn.Module) -> tuple[CompilerFn, bool | None, bool] | None:
    """(compiler function, dynamic, fullgraph) a ``torch.compile``'d module was made with,
    read where torch's own ``DistributedDataParallel`` support reads it; None if ``module``
    is not compiled, or they cannot be read."""
    if not isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return None
    context = getattr(module, "dynamo_ctx", None)
    convert = getattr(getattr(context, "callback", None), "_torchdynamo_orig_backend", None)
    backend = getattr(convert, "_torchdynamo_orig_backend", None)
    if not callable(backend):
        return None
    return backend, getattr(context, "_dynamic", None), bool(getattr(context, "fullgraph", False))
