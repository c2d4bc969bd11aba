"""``recompute``: activation checkpointing of named submodules (``torch.utils.checkpoint``).

Each submodule named in ``recompute_configs['checkpoints']`` keeps only its inputs in forward;
backward runs its forward again to get the activations. Parameters, names and the state dict
are unchanged: the submodule's ``forward`` is wrapped in place.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from longboat.strategy import Strategy, StrategyError

_MARK = "_longboat_recompute"


def _recomputed(forward: Callable[..., Any], offload: bool) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)  # evaluation: nothing to recompute
        saving = torch.autograd.graph.save_on_cpu() if offload else contextlib.nullcontext()
        with saving:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_recompute(model: nn.Module, strategy: Strategy) -> list[str]:
    """Wrap the forward of every submodule ``strategy.recompute_configs['checkpoints']``
    names (when ``strategy.recompute``); returns the names wrapped. StrategyError naming an
    unknown name and listing the model's submodules."""
    if not strategy.recompute:
        return []
    names = list(strategy.recompute_configs["checkpoints"])
    modules = dict(model.named_modules())
    modules.pop("", None)
    missing = [n for n in names if n not in modules]
    if missing:
        valid = ", ".join(modules) or "(none: the model has no submodules)"
        raise StrategyError(
            f"Strategy.recompute_configs['checkpoints'] names {missing[0]!r}, which is not a "
            f"submodule of {type(model).__name__}; use names from model.named_modules(): {valid}"
        )
    offload = bool(strategy.recompute_configs["enable_offload"])
    for name in names:
        module = modules[name]
        if getattr(module, _MARK, False):
            continue
        module.forward = _recomputed(module.forward, offload)  # type: ignore[method-assign]
        setattr(module, _MARK, True)
    return names
