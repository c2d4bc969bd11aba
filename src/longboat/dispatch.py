"""``lb.distribute``: hand a model and optimizer to the engine of the Strategy's mode."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import longboat.cluster as cluster
from longboat import session
from longboat.ownership import admit
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
    return enter(model, optimizer, strategy)


def enter(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strategy: Strategy | None,
    **ps_options: Any,
) -> tuple[nn.Module, Any]:
    """The one door of the facades to the engines (`distribute` is it without options):
    ``ps_options`` are the parameter-server engine's (where the servers are, the job's
    token), which Fleet's workers pass."""
    strategy = strategy or cluster.current_strategy() or Strategy()
    admit(model, optimizer)  # the engines check again: a direct call gets the same refusals
    if strategy.mode == "ps":
        from longboat.ps.trainer.engine import distribute as ps_distribute

        return ps_distribute(model, optimizer, strategy, **ps_options)
    if ps_options:
        raise TypeError(f"{sorted(ps_options)}: parameter-server options, and mode is collective")
    from longboat.collective.engine import distribute as collective_distribute

    if not cluster.is_initialized():
        session.init(strategy)

    return collective_distribute(model, optimizer, strategy)


def enter_reducer(
    named: list[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    strategy: Strategy,
    door: str,
    *,
    again: bool = False,
    **reducer_options: Any,
) -> tuple[Any, list[Any]]:
    """The door of an optimizer-only facade (``hvd.DistributedOptimizer``: no model, only the
    parameters it names): `enter`'s checks (an optimizer already distributed, or holding
    parameters outside ``named``, is refused; collective mode only; the cluster started), then
    the collective engine's reducer over ``named`` and its compressors
    (`longboat.collective.engine.build_reducer`, which takes ``reducer_options``). ``again``:
    the facade's own optimizer moves to a new world (elastic): it was admitted when built."""
    if not again:
        admit([p for _, p in named], optimizer, door)
    if strategy.mode == "ps":
        raise ValueError(f"{door} averages gradients collectively: use Strategy(mode='collective')")
    if not cluster.is_initialized():
        session.init(strategy)
    from longboat.collective.engine import build_reducer
    from longboat.collective.live import live_placement
    from longboat.collective.plan import resolve

    plan = resolve(strategy, live_placement())
    return build_reducer(named, plan, optimizer, **reducer_options)
