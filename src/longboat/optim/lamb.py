"""LAMB: Adam moments with a layer-wise trust ratio (Fleet's ``lamb`` / ``lamb_configs``).

For every parameter tensor ``w`` with gradient ``g`` at step ``t`` (Paddle's ``lamb`` kernel)::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    u = (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + epsilon) + wd * w
    r = ||w|| / ||u||            if ||w|| > 0 and ||u|| > 0, else 1
    w = w - lr * r * u

``wd`` is ``lamb_weight_decay``, or 0 for a parameter whose name contains one of the
``exclude_from_weight_decay`` substrings (the trust ratio still applies to it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from longboat.optim.layerwise import LayerwiseOptimizer, Norms, Params

__all__ = ["LAMB"]


class LAMB(LayerwiseOptimizer):
    """Layer-wise adaptive moments (LAMB), with Paddle's defaults.

    ``params`` follows :class:`~longboat.optim.LARS`: bare tensors, ``(name, tensor)`` pairs
    or param groups; names are needed only for ``exclude_from_weight_decay``.
    """

    NAME = "LAMB"
    DECAY_KEY = "lamb_weight_decay"

    def __init__(
        self,
        params: Params,
        lr: float = 0.001,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        *,
        lamb_weight_decay: float = 0.01,
        exclude_from_weight_decay: Sequence[str] = (),
    ) -> None:
        if lr < 0:
            raise ValueError(f"LAMB: lr must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"LAMB: betas must be two numbers in [0, 1), got {betas}")
        if eps < 0 or lamb_weight_decay < 0:
            raise ValueError(
                f"LAMB: eps and lamb_weight_decay must be >= 0, got {eps} and {lamb_weight_decay}"
            )
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "lamb_weight_decay": lamb_weight_decay,
            "exclude_from_weight_decay": exclude_from_weight_decay,
        }
        super().__init__(params, defaults)

    def _norm_inputs(
        self, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any], wd: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance the moments; the weight and the update ``u`` set the trust ratio."""
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        t = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        update = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + group["eps"])
        if wd > 0:
            update.add_(p, alpha=wd)
        return p, update

    def _apply(self, p: torch.Tensor, g: torch.Tensor, group: dict, wd: float, n: Norms) -> None:
        w_norm, u_norm = n.norm_a, n.norm_b
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        p.sub_(n.b * (group["lr"] * ratio))
