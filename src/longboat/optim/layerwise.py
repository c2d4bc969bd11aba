"""Shared by LARS and LAMB: layer-wise updates with weight decay that parameter names can exclude."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, overload

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


class Norms(NamedTuple):
    """A parameter's two norm inputs (``_norm_inputs``) and their norms over the whole
    parameter."""

    a: torch.Tensor
    b: torch.Tensor
    norm_a: torch.Tensor
    norm_b: torch.Tensor


NormSum = Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]
"""``(tensors, squares)``: ``squares[i]`` holds the squared norms of ``tensors[i]``'s two norm
inputs; returns those of the whole parameters they are slices of (sharding sums them over the
ranks that hold the other slices)."""


class LayerwiseOptimizer(Optimizer):
    """Steps every parameter with a trust ratio from two norms per parameter.

    A subclass says which two tensors' norms it needs (``_norm_inputs``, which may update
    state) and how it then updates the parameter (``_apply``); ``wd`` is 0 for excluded names.
    With ``norm_sum`` set (sharding: each tensor is a slice of a parameter), the squared norms
    of every tensor are summed by it at once before any update; otherwise each parameter is
    done on its own, holding one parameter's temporaries at a time.
    """

    NAME = ""
    DECAY_KEY = ""
    norm_sum: NormSum | None = None

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
        items = list(self._items())
        for chunk in [items] if self.norm_sum is not None else [[item] for item in items]:
            self._step_chunk(chunk)
        return loss

    def _items(self) -> Iterator[tuple[torch.Tensor, dict[str, Any], float]]:
        """``(parameter, its group, its weight decay)`` of every parameter with a gradient."""
        for group in self.param_groups:
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{self.NAME} does not support sparse gradients")
                name = names[i] if names is not None else None
                excluded = decay_excluded(name, group["exclude_from_weight_decay"])
                yield p, group, 0.0 if excluded else group[self.DECAY_KEY]

    def _step_chunk(self, chunk: list[tuple[torch.Tensor, dict[str, Any], float]]) -> None:
        inputs = [self._norm_inputs(p, p.grad, group, wd) for p, group, wd in chunk]
        squares = [torch.stack([_square_sum(a), _square_sum(b)]) for a, b in inputs]
        if self.norm_sum is not None:
            squares = list(self.norm_sum([p for p, _, _ in chunk], _stacked(squares)))
        for (p, group, wd), (a, b), sq in zip(chunk, inputs, squares, strict=True):
            norm = sq.sqrt()
            self._apply(p, p.grad, group, wd, Norms(a, b, norm[0], norm[1]))

    def _norm_inputs(
        self, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any], wd: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The two tensors whose norms set ``p``'s trust ratio (state may be updated here)."""
        raise NotImplementedError

    def _apply(self, p: torch.Tensor, g: torch.Tensor, group: dict, wd: float, n: Norms) -> None:
        """Update ``p`` from its norm inputs and their norms over the whole parameter."""
        raise NotImplementedError


def _square_sum(t: torch.Tensor) -> torch.Tensor:
    """The squared 2-norm of ``t`` (16-bit tensors summed in float32)."""
    return torch.linalg.vector_norm(t, dtype=norm_dtype(t)).square()


def _stacked(squares: list[torch.Tensor]) -> torch.Tensor:
    """``[n, 2]`` in float64 if any row is, else float32 (``[0, 2]`` when there are none)."""
    if not squares:
        return torch.zeros(0, 2)
    dtype = torch.float64 if any(s.dtype == torch.float64 for s in squares) else torch.float32
    return torch.stack([s.to(dtype) for s in squares])
