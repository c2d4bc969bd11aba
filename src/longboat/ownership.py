"""The optimizer must update only the model's parameters: a parameter outside the model is
never averaged across ranks, so the replicas would silently drift apart."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from longboat.optim.staged import already_distributed, is_distributed


class ForeignParameterError(ValueError):
    """The optimizer holds parameters that are not in the model given to ``lb.distribute``."""


def admit(
    model: nn.Module | Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    door: str = "lb.distribute",
) -> None:
    """What every engine checks before it touches a model and optimizer, whichever door they
    came through (``lb.distribute``, ``lb.ps.distribute``, the Fleet facade, and with the
    parameters it is given, ``kvstore.Trainer``): an optimizer that a distribute call already
    returned is refused, and so is one holding parameters outside ``model``. Before any hook
    or connection is made. ``door`` names the call in the messages."""
    if optimizer is not None and is_distributed(optimizer):
        advice = (
            "use the optimizer it returned"
            if door == "lb.distribute"
            else f"its gradients are already averaged there; give {door} an optimizer that "
            "no other wrapper distributes"
        )
        raise ValueError(f"{already_distributed(optimizer)}: {advice}")
    check_optimizer_owns_model_params(model, optimizer, door)


def check_optimizer_owns_model_params(
    model: nn.Module | Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    door: str = "lb.distribute",
) -> None:
    """Raise `ForeignParameterError` naming the foreign parameters and the fix.

    A frozen parameter (``requires_grad=False``) is never foreign: it gets no gradient, so
    there is nothing to average (``hvd.DistributedOptimizer`` is given only the trainable
    ones of ``named_parameters``, while the optimizer may hold them all, as Horovod allows).
    """
    if optimizer is None:
        return
    module = isinstance(model, nn.Module)
    owned = {id(p) for p in (model.parameters() if isinstance(model, nn.Module) else model)}
    foreign = [
        (g, i, p)
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(_params(group["params"]))
        if id(p) not in owned and p.requires_grad
    ]
    if not foreign:
        return
    if is_distributed(optimizer):
        raise ForeignParameterError(
            f"this {type(optimizer).__name__} was already passed to lb.distribute with another "
            "model; build a new optimizer from this model's parameters"
        )
    shown = ", ".join(
        f"param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)})" for g, i, p in foreign[:3]
    )
    more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
    given, fix = (
        (
            f"model passed to {door}",
            "Build the optimizer from that model's parameters (optimizer = "
            "SGD(model.parameters(), ...)), or put the module owning them into the model you "
            "distribute (e.g. nn.ModuleDict({'net': net, 'head': head}))",
        )
        if module
        else (
            f"parameters passed to {door}",
            f"Build the optimizer from the parameters you pass to {door}, or pass it those "
            "parameters too",
        )
    )
    raise ForeignParameterError(
        f"{type(optimizer).__name__} holds {len(foreign)} parameter(s) that are not in the "
        f"{given}: {shown}{more}. Their gradients would never be averaged across ranks. {fix}"
    )


def _params(params: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    return [params] if isinstance(params, torch.Tensor) else list(params)
