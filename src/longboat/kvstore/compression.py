"""MXNet's 2-bit gradient compression with error feedback (``set_gradient_compression``).

Per element, with the residual ``r`` this sender kept for the array (zero at first)::

    a = r + g
    q = +t if a >= t, -t if a <= -t, else 0      # what travels (2 bits a value in MXNet)
    r = a - q                                     # carried to the next push

The receiver sums the ``q`` of every sender. Here ``q`` travels as a dense tensor (the
arithmetic, not the wire size, is MXNet's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from longboat.kvstore.errors import InvalidArgumentError

DEFAULT_THRESHOLD = 0.5  # MXNet's default for {'type': '2bit'}


def quantize_2bit(
    grad: torch.Tensor, residual: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``q``, new residual) of ``grad`` given the old ``residual`` (see the module doc)."""
    acc = residual + grad
    q = ((acc >= threshold).to(acc.dtype) - (acc <= -threshold).to(acc.dtype)) * threshold
    return q, acc - q


def parse_params(params: Mapping[str, Any]) -> float:
    """The threshold of MXNet's ``{'type': '2bit', 'threshold': t}``; refuses other types."""
    if not isinstance(params, Mapping) or "type" not in params:
        raise InvalidArgumentError(
            "set_gradient_compression takes a dict with a 'type' key, e.g. "
            "{'type': '2bit', 'threshold': 0.5}"
        )
    kind = str(params["type"]).lower()
    if kind == "none":
        return 0.0
    if kind != "2bit":
        raise InvalidArgumentError(
            f"gradient compression type {params['type']!r} is not supported: only MXNet's "
            "'2bit' is (longboat's collective mode has other compressors: lb.Strategy)"
        )
    unknown = set(params) - {"type", "threshold"}
    if unknown:
        raise InvalidArgumentError(f"2bit compression has no parameter(s) {sorted(unknown)}")
    threshold = float(params.get("threshold", DEFAULT_THRESHOLD))
    if not threshold > 0:
        raise InvalidArgumentError(f"2bit compression needs a threshold > 0, got {threshold}")
    return threshold


class TwoBit:
    """The sender's side: one residual per array it quantizes (a key, or a key and device)."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.residuals: dict[Any, torch.Tensor] = {}

    def __call__(self, where: Any, grad: torch.Tensor) -> torch.Tensor:
        """``q`` of ``grad`` for the array named ``where``; its residual is kept."""
        residual = self.residuals.get(where)
        if residual is None or residual.shape != grad.shape or residual.device != grad.device:
            residual = torch.zeros_like(grad)
        q, self.residuals[where] = quantize_2bit(grad, residual.to(grad.dtype), self.threshold)
        return q


__all__ = ["DEFAULT_THRESHOLD", "TwoBit", "parse_params", "quantize_2bit"]
