"""The user's optimizer at sharding stage 3: rebuilt over the sharded (DTensor) parameters with
the same class, defaults and param groups, and stepped by a `StagedOptimizer` stage that copies
the user's hyper-parameters in at every step (LR schedulers keep working on the user's object)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from longboat.optim.staged import Stage, StagedOptimizer, StageKind, StepRest, ZeroGradRest
from longboat.sharding.state import full_optimizer_state, shard_optimizer_state

REFUSED: Mapping[str, str] = {
    "LBFGS": "its line search reads the whole flattened gradient",
}
"""Optimizer classes that cannot step shards, with why."""


def _hparams(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def rebuild(
    user: torch.optim.Optimizer, replaced: Mapping[int, nn.Parameter]
) -> torch.optim.Optimizer:
    """An optimizer of ``user``'s class and defaults over the parameters that replaced
    ``user``'s (``replaced``: id of the old parameter -> the sharded one), one group per user
    group with its hyper-parameters. The user's groups are pointed at the new parameters too,
    so the whole old ones are freed. ValueError for a class that cannot step shards, one whose
    constructor does not take its defaults, or an optimizer that has already stepped."""
    name = type(user).__name__
    if name in REFUSED:
        raise ValueError(f"sharding stage 3 cannot step {name}: {REFUSED[name]}; use stage 1")
    if any(user.state.values()):
        raise ValueError(
            "sharding stage 3: the optimizer already holds state; pass it to lb.distribute "
            "before its first step, and load a checkpoint into the optimizer lb.distribute "
            "returns"
        )
    for group in user.param_groups:
        group["params"][:] = [replaced[id(p)] for p in group["params"]]  # same list object
    groups = [{**_hparams(g), "params": list(g["params"])} for g in user.param_groups]
    cls = type(user)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in user.defaults.items() if k in accepted}
    try:
        sharded = cls(groups, **defaults)
    except TypeError as error:
        raise ValueError(
            f"sharding stage 3 rebuilds {name} over the sharded parameters as "
            f"{name}(param_groups, **defaults), which failed ({error}): give its constructor "
            "its defaults as keyword arguments"
        ) from error
    sharded.defaults = dict(user.defaults)
    return sharded


class FullyShardedStep(Stage):
    """Steps the rebuilt optimizer instead of the user's; ``state_dict`` in the plain layout."""

    kind = StageKind.SHARDED_STEP

    def __init__(
        self,
        user: torch.optim.Optimizer,
        sharded: torch.optim.Optimizer,
        model: nn.Module,
        degree: int,
        divide_by: int = 1,
    ) -> None:
        self.user = user
        self.optimizer = sharded
        self.model = model  # the root FSDP module (checkpoints read its shards)
        self.degree = degree
        self.divide_by = divide_by  # gradient merge with avg: the merged sum over k_steps

    def sync_hparams(self) -> None:
        """Copy every user group's hyper-parameters into the rebuilt optimizer's."""
        for mine, theirs in zip(self.optimizer.param_groups, self.user.param_groups, strict=True):
            mine.update(_hparams(theirs))

    def step(self, rest: StepRest, closure: Any = None, **kwargs: Any) -> Any:
        self.sync_hparams()
        if self.divide_by > 1:
            grads = [p.grad for g in self.optimizer.param_groups for p in g["params"]]
            present = [g for g in grads if g is not None]
            if present:
                torch._foreach_div_(present, float(self.divide_by))
        result = self.optimizer.step(closure, **kwargs)
        self.user._opt_called = True  # type: ignore[attr-defined]  # LR schedulers' check
        return result

    def zero_grad(self, rest: ZeroGradRest, set_to_none: bool) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self, rest: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        self.sync_hparams()
        return full_optimizer_state(self.optimizer, rest()["param_groups"])

    def load_state_dict(
        self, rest: Callable[[dict[str, Any]], None], state_dict: dict[str, Any]
    ) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.user.param_groups):
            raise ValueError(
                f"the state dict has {len(groups)} param groups and the optimizer "
                f"{len(self.user.param_groups)}: load one of the same param groups"
            )
        for mine, saved in zip(self.user.param_groups, groups, strict=True):
            mine.update(_hparams(saved))
        self.sync_hparams()
        self.optimizer.load_state_dict(
            {
                "state": shard_optimizer_state(self.optimizer, state_dict["state"]),
                "param_groups": self.optimizer.state_dict()["param_groups"],
            }
        )

    def __repr__(self) -> str:
        return f"FullyShardedStep({type(self.optimizer).__name__})"


def stage3_step(optimizer: object) -> FullyShardedStep | None:
    """The stage 3 step of an optimizer ``lb.distribute`` returned, or None."""
    if not isinstance(optimizer, StagedOptimizer):
        return None
    step = optimizer.stage(StageKind.SHARDED_STEP)
    return step if isinstance(step, FullyShardedStep) else None


def clip_sharded_grad_norm_(
    params: list[nn.Parameter], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over sharded gradients: the norm of the whole
    gradients (reduced over the shards, the same on every rank), then every shard scaled."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
