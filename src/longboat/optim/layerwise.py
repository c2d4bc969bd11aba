"""Shared by LARS and LAMB: layer-wise updates with weight decay that parameter names can exclude."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, overload

import torch
from torch.optim import Optimizer

Params = Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]]


def decay_excluded(name: str | None, patterns: Sequence[str]) -> bool:
    """Whether a parameter called ``name`` is exempt from weight decay (substring match)."""
    return name is not None and any(pattern in name for pattern in patterns)


def check_named_group(opt_name: str, group: dict[str, Any]) -> None:
    """Refuse a group that has exclusion patterns but no parameter names to match them to."""
    patterns = group["exclude_from_weight_decay"]
    if isinstance(patterns, str):
        raise TypeError(
            f"{opt_name}: exclude_from_weight_decay must be a list of name "
            f"substrings, got the string {patterns!r}"
        )
    group["exclude_from_weight_decay"] = tuple(patterns)
    names = group.get("param_names")
    if names is not None and len(names) != len(group["params"]):
        raise ValueError(
            f"{opt_name}: a param group has {len(group['params'])} params but "
            f"{len(names)} param_names"
        )
    if patterns and names is None:
        raise ValueError(
            f"{opt_name}: exclude_from_weight_decay={list(patterns)} needs parameter names; pass "
            "model.named_parameters() (or groups whose 'params' are (name, tensor) pairs, or "
            "that carry a 'param_names' list) instead of bare tensors"
        )


def norm_dtype(p: torch.Tensor) -> torch.dtype | None:
    """Norms of 16-bit tensors are taken in float32."""
    return torch.float32 if p.is_floating_point() and p.element_size() < 4 else None


class LayerwiseOptimizer(Optimizer):
    """Runs ``_update(p, grad, group, wd)`` per parameter; ``wd`` is 0 for excluded names."""

    NAME = ""
    DECAY_KEY = ""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        check_named_group(self.NAME, self.param_groups[-1])

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{self.NAME} does not support sparse gradients")
                name = names[i] if names is not None else None
                excluded = decay_excluded(name, group["exclude_from_weight_decay"])
                wd = 0.0 if excluded else group[self.DECAY_KEY]
                self._update(p, p.grad, group, wd)
        return loss

    def _update(self, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any], wd: float) -> None:
        raise NotImplementedError
