"""``lb.distribute``: hand a model and optimizer to the engine of the Strategy's mode."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import longboat.cluster as cluster
from longboat import session
from longboat.optim.staged import ALREADY_DISTRIBUTED, is_distributed
from longboat.ownership import check_optimizer_owns_model_params
from longboat.strategy import Strategy


def distribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strategy: Strategy | None = None,
) -> tuple[nn.Module, Any]:
    """Make ``model`` (and ``optimizer``) distributed as ``strategy`` says: collective
    data-parallel (``longboat.collective.engine``) or parameter-server (``longboat.ps``).

    ``strategy`` defaults to the one ``lb.init`` was given, else ``Strategy()``. An optimizer
    holding parameters that are not in ``model`` is refused (their gradients would never be
    averaged across ranks).
    """
    strategy = strategy or cluster.current_strategy() or Strategy()
    if optimizer is not None and is_distributed(optimizer):  # before any hook or connection
        raise ValueError(f"{ALREADY_DISTRIBUTED}: use the optimizer it returned")
    check_optimizer_owns_model_params(model, optimizer)
    if strategy.mode == "ps":
        from longboat.ps.engine import distribute as ps_distribute

        return ps_distribute(model, optimizer, strategy)
    from longboat.collective.engine import distribute as collective_distribute

    if not cluster.is_initialized():
        session.init(strategy)

    return collective_distribute(model, optimizer, strategy)
