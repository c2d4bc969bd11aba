"""``recompute``: activation checkpointing of named submodules (``torch.utils.checkpoint``).

Each submodule named in ``recompute_configs['checkpoints']`` keeps only its inputs in forward;
backward runs its forward again to get the activations. Parameters, names and the state dict
are unchanged: the submodule's ``forward`` is wrapped in place.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from longboat.strategy import StrategyError

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


@dataclass(frozen=True, kw_only=True, slots=True)
class RecomputeConfig:
    """Which submodules recompute their activations in backward."""

    checkpoints: tuple[str, ...]
    """Submodule names as ``model.named_modules()`` gives them."""
    offload: bool = False
    """Keep the saved inputs in CPU memory (``torch.autograd.graph.save_on_cpu``)."""

    @classmethod
    def of(cls, recompute: bool, configs: Mapping[str, Any]) -> RecomputeConfig | None:
        """From the Strategy's ``recompute`` and ``recompute_configs``; None when off."""
        if not recompute:
            return None
        return cls(
            checkpoints=tuple(configs["checkpoints"]), offload=bool(configs["enable_offload"])
        )


def apply_recompute(model: nn.Module, config: RecomputeConfig | None) -> list[str]:
    """Wrap the forward of every submodule ``config.checkpoints`` names; returns the names
    wrapped. StrategyError naming an unknown name and listing the model's submodules."""
    if config is None:
        return []
    modules = dict(model.named_modules())
    modules.pop("", None)
    missing = [n for n in config.checkpoints if n not in modules]
    if missing:
        valid = ", ".join(modules) or "(none: the model has no submodules)"
        raise StrategyError(
            f"Strategy.recompute_configs['checkpoints'] names {missing[0]!r}, which is not a "
            f"submodule of {type(model).__name__}; use names from model.named_modules(): {valid}"
        )
    for name in config.checkpoints:
        module = modules[name]
        if getattr(module, _MARK, False):
            continue
        module.forward = _recomputed(module.forward, config.offload)  # type: ignore[method-assign]
        setattr(module, _MARK, True)
    return list(config.checkpoints)
