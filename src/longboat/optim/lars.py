"""LARS: momentum SGD with a layer-wise trust ratio (Fleet's ``lars`` / ``lars_configs``).

For every parameter tensor ``w`` with gradient ``g`` (Paddle's ``lars_momentum`` kernel)::

    local_lr = lr * lars_coeff * ||w|| / (||g|| + wd * ||w|| + epsilon)
                                      if wd > 0 and ||w|| > 0 and ||g|| > 0, else lr
    v = momentum * v + local_lr * (g + wd * w)
    w = w - v

``wd`` is ``lars_weight_decay``, or 0 for a parameter whose name contains one of the
``exclude_from_weight_decay`` substrings. As in Fleet, a parameter with ``wd == 0`` therefore
takes a plain momentum step at ``lr`` (no trust ratio).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from longboat.optim.layerwise import LayerwiseOptimizer, Norms, Params

__all__ = ["LARS"]


class LARS(LayerwiseOptimizer):
    """Layer-wise adaptive rate scaling over momentum SGD, with Fleet's defaults.

    ``params`` may be bare tensors, ``(name, tensor)`` pairs such as
    ``model.named_parameters()``, or param-group dicts (torch's own convention: names come
    from pairs or a ``param_names`` list). Names are needed only for
    ``exclude_from_weight_decay``. Every hyper-parameter may be set per group.
    """

    NAME = "LARS"
    DECAY_KEY = "lars_weight_decay"

    def __init__(
        self,
        params: Params,
        lr: float,
        momentum: float,
        *,
        lars_coeff: float = 0.001,
        lars_weight_decay: float = 0.0005,
        epsilon: float = 0.0,
        exclude_from_weight_decay: Sequence[str] = (),
    ) -> None:
        if lr < 0:
            raise ValueError(f"LARS: lr must be >= 0, got {lr}")
        if momentum < 0:
            raise ValueError(f"LARS: momentum must be >= 0, got {momentum}")
        if lars_coeff <= 0:
            raise ValueError(f"LARS: lars_coeff must be > 0, got {lars_coeff}")
        if lars_weight_decay < 0 or epsilon < 0:
            raise ValueError(
                f"LARS: lars_weight_decay and epsilon must be >= 0, got "
                f"{lars_weight_decay} and {epsilon}"
            )
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "lars_coeff": lars_coeff,
            "lars_weight_decay": lars_weight_decay,
            "epsilon": epsilon,
            "exclude_from_weight_decay": exclude_from_weight_decay,
        }
        super().__init__(params, defaults)

    def _norm_inputs(
        self, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any], wd: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight and the gradient set the local learning rate."""
        return p, g

    def _apply(self, p: torch.Tensor, g: torch.Tensor, group: dict, wd: float, n: Norms) -> None:
        lr = group["lr"]
        local_lr: float | torch.Tensor = lr
        if wd > 0:
            w_norm, g_norm = n.norm_a, n.norm_b
            trust = lr * group["lars_coeff"] * w_norm / (g_norm + wd * w_norm + group["epsilon"])
            local_lr = torch.where((w_norm > 0) & (g_norm > 0), trust, torch.full_like(trust, lr))
        buf = self.state[p].get("momentum_buffer")
        if buf is None:
            buf = self.state[p]["momentum_buffer"] = torch.zeros_like(
                p, memory_format=torch.preserve_format
            )
        direction = g.add(p, alpha=wd) if wd > 0 else g
        buf.mul_(group["momentum"]).add_(direction * local_lr)
        p.sub_(buf)
