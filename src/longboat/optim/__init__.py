"""Optimizers that Fleet's strategy swaps in: LARS (``lars``) and LAMB (``lamb``).

``wrap_optimizer`` does what Fleet's LARS/LAMB meta-optimizers do: it builds the new optimizer
from the user's one, carrying its learning rate and momentum (LARS, from ``torch.optim.SGD``)
or betas and epsilon (LAMB, from ``torch.optim.Adam``/``AdamW``), param group by param group.

``StagedOptimizer`` (`longboat.optim.staged`) is what ``lb.distribute`` returns: the user's
optimizer (or LARS/LAMB) with the step stages the strategy asks for, in `StageKind` order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from longboat.optim.lamb import LAMB
from longboat.optim.lars import LARS
from longboat.optim.staged import Stage, StagedOptimizer, StageKind

__all__ = ["LAMB", "LARS", "Stage", "StageKind", "StagedOptimizer", "wrap_optimizer"]

_CONFIG_KEYS = {
    "lars": ("lars_coeff", "lars_weight_decay", "epsilon", "exclude_from_weight_decay"),
    "lamb": ("lamb_weight_decay", "exclude_from_weight_decay"),
}


def _named_groups(
    kind: str, optimizer: torch.optim.Optimizer, named_params: Iterable[tuple[str, torch.Tensor]]
) -> list[dict[str, Any]]:
    names = {id(p): name for name, p in named_params}
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        params = list(group["params"])
        missing = [i for i, p in enumerate(params) if id(p) not in names]
        if missing:
            shape = tuple(params[missing[0]].shape)
            raise ValueError(
                f"{kind}: param_groups[{g}]['params'][{missing[0]}] (shape {shape}) is not in "
                "named_params; pass the model's named_parameters() for the model the optimizer "
                "was built on"
            )
        new = {
            "params": params,
            "param_names": [names[id(p)] for p in params],
            "lr": float(group["lr"]),
        }
        if "initial_lr" in group:
            new["initial_lr"] = group["initial_lr"]
        groups.append(new)
    return groups


def _lars_from(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    if not isinstance(optimizer, torch.optim.SGD):
        raise TypeError(
            f"lars needs the inner optimizer to be torch.optim.SGD with momentum "
            f"(Fleet: Momentum), got {type(optimizer).__name__}"
        )
    for g, (old, new) in enumerate(zip(optimizer.param_groups, groups, strict=True)):
        problem = (
            "momentum=0 (LARS is a momentum method: set momentum, e.g. 0.9)"
            if old["momentum"] <= 0
            else "nesterov=True (LARS has no Nesterov variant)"
            if old["nesterov"]
            else f"dampening={old['dampening']} (LARS has no dampening)"
            if old["dampening"]
            else f"weight_decay={old['weight_decay']} (LARS decays with "
            "lars_configs.lars_weight_decay; set the SGD's weight_decay to 0)"
            if old["weight_decay"]
            else None
        )
        if problem:
            raise ValueError(f"lars: the SGD's param_groups[{g}] has {problem}")
        new["momentum"] = old["momentum"]


def _lamb_from(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(
            f"lamb needs the inner optimizer to be torch.optim.Adam or AdamW "
            f"(Fleet: Adam), got {type(optimizer).__name__}"
        )
    for g, (old, new) in enumerate(zip(optimizer.param_groups, groups, strict=True)):
        if old.get("amsgrad"):
            raise ValueError(
                f"lamb: the Adam's param_groups[{g}] has amsgrad=True, which LAMB does not have"
            )
        new["betas"] = tuple(float(b) for b in old["betas"])
        new["eps"] = old["eps"]


def wrap_optimizer(
    kind: str,
    optimizer: torch.optim.Optimizer,
    named_params: Iterable[tuple[str, torch.Tensor]],
    configs: Mapping[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """Replace ``optimizer`` by LARS (``kind="lars"``) or LAMB (``kind="lamb"``).

    Per param group, the new optimizer takes the old one's ``lr`` (and ``initial_lr``) and
    ``momentum`` (LARS) or ``betas`` and ``eps`` (LAMB); ``configs`` holds the keys of
    ``lars_configs`` / ``lamb_configs`` (missing keys take their defaults). The old
    optimizer's ``weight_decay`` is not carried: LARS refuses a non-zero one, LAMB uses
    ``lamb_weight_decay`` instead. ``named_params`` (``model.named_parameters()``) supplies
    the names ``exclude_from_weight_decay`` matches. The old optimizer's state is not carried;
    build LR schedulers on the returned optimizer.
    """
    if kind not in _CONFIG_KEYS:
        raise ValueError(f"wrap_optimizer: kind must be 'lars' or 'lamb', got {kind!r}")
    configs = dict(configs or {})
    unknown = sorted(set(configs) - set(_CONFIG_KEYS[kind]))
    if unknown:
        raise ValueError(
            f"{kind}_configs: unknown key(s) {unknown}; known: {list(_CONFIG_KEYS[kind])}"
        )
    if "exclude_from_weight_decay" in configs:
        configs["exclude_from_weight_decay"] = tuple(configs["exclude_from_weight_decay"])
    groups = _named_groups(kind, optimizer, named_params)
    if kind == "lars":
        _lars_from(optimizer, groups)
        return LARS(groups, lr=groups[0]["lr"], momentum=groups[0]["momentum"], **configs)
    _lamb_from(optimizer, groups)
    return LAMB(groups, lr=groups[0]["lr"], **configs)
