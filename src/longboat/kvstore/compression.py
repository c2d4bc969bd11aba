"""MXNet's 1-bit and 2-bit gradient compression with error feedback (``set_gradient_compression``).

Per element, with the residual ``r`` this sender kept for the array (zero at first)::

    a = r + g
    2bit:  q = +t if a >= t, -t if a <= -t, else 0    # three states, 2 bits a value in MXNet
    1bit:  q = +1 if a > t, else -1                    # two states, 1 bit a value in MXNet
    r = a - q                                         # carried to the next push

The receiver sums the ``q`` of every sender. Here ``q`` travels as a dense tensor (the
arithmetic, not the wire size, is MXNet's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from longboat.kvstore.errors import InvalidArgumentError

DEFAULT_THRESHOLD = 0.5  # MXNet's default threshold for both types

Quantizer = Callable[[torch.Tensor, float], torch.Tensor]  # (a = r + g, t) -> q


def quantize_2bit(
    grad: torch.Tensor, residual: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``q``, new residual) of ``grad`` given the old ``residual``, 2-bit (module doc)."""
    return _with_feedback(_two_bit, grad, residual, threshold)


def quantize_1bit(
    grad: torch.Tensor, residual: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``q``, new residual) of ``grad`` given the old ``residual``, 1-bit (module doc)."""
    return _with_feedback(_one_bit, grad, residual, threshold)


def _two_bit(acc: torch.Tensor, threshold: float) -> torch.Tensor:
    return ((acc >= threshold).to(acc.dtype) - (acc <= -threshold).to(acc.dtype)) * threshold


def _one_bit(acc: torch.Tensor, threshold: float) -> torch.Tensor:
    return (acc > threshold).to(acc.dtype) * 2 - 1


def _with_feedback(
    quantizer: Quantizer, grad: torch.Tensor, residual: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = residual + grad
    q = quantizer(acc, threshold)
    return q, acc - q


#: type -> (quantizer, whether the threshold may be 0)
TYPES: dict[str, tuple[Quantizer, bool]] = {"2bit": (_two_bit, False), "1bit": (_one_bit, True)}


def parse_params(params: Mapping[str, Any]) -> tuple[str, float] | None:
    """``(type, threshold)`` of MXNet's ``{'type': '2bit' | '1bit', 'threshold': t}``, or None
    for ``{'type': 'none'}``; other types and parameters are refused, named."""
    if not isinstance(params, Mapping) or "type" not in params:
        raise InvalidArgumentError(
            "set_gradient_compression takes a dict with a 'type' key, e.g. "
            "{'type': '2bit', 'threshold': 0.5}"
        )
    kind = str(params["type"]).lower()
    if kind == "none":
        return None
    if kind not in TYPES:
        raise InvalidArgumentError(
            f"gradient compression type {params['type']!r} is not supported: MXNet's '2bit' and "
            "'1bit' are (longboat's collective mode has other compressors: lb.Strategy)"
        )
    unknown = set(params) - {"type", "threshold"}
    if unknown:
        raise InvalidArgumentError(f"{kind} compression has no parameter(s) {sorted(unknown)}")
    threshold = float(params.get("threshold", DEFAULT_THRESHOLD))
    zero_ok = TYPES[kind][1]
    if not (threshold >= 0 if zero_ok else threshold > 0):
        bound = ">= 0" if zero_ok else "> 0"
        raise InvalidArgumentError(f"{kind} compression needs a threshold {bound}, got {threshold}")
    return kind, threshold


class Compressor:
    """The sender's side: one residual per array it quantizes (a key, or a key and device)."""

    def __init__(self, kind: str, threshold: float) -> None:
        self.kind = kind
        self.threshold = threshold
        self._quantizer = TYPES[kind][0]
        self.residuals: dict[Any, torch.Tensor] = {}

    def __call__(self, where: Any, grad: torch.Tensor) -> torch.Tensor:
        """``q`` of ``grad`` for the array named ``where``; its residual is kept."""
        residual = self.residuals.get(where)
        if residual is None or residual.shape != grad.shape or residual.device != grad.device:
            residual = torch.zeros_like(grad)
        q, self.residuals[where] = _with_feedback(
            self._quantizer, grad, residual.to(grad.dtype), self.threshold
        )
        return q


__all__ = [
    "DEFAULT_THRESHOLD",
    "Compressor",
    "parse_params",
    "quantize_1bit",
    "quantize_2bit",
]
