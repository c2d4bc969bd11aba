"""The optimizer over this rank's slices (sharding stage 1 and 2), and what it knows of them.

The user's optimizer keeps its ``param_groups`` (LR schedulers change them as usual) and never
steps itself: `ShardOptimizer` builds an optimizer of the same class and defaults over one flat
shard parameter per piece of the layout (`longboat.sharding.zero.layout`): a view of the
parameter's own elements, so the step updates them in place and no copy of the parameters is
kept. It has one param group per user group, whose hyper-parameters are copied into it at
every step. Under stage 2 the shard parameters' gradients are views of the slices the
reduce-scatter keeps (`ShardSetup.scatter`), made once. The state dict, the per-rank files and
the elastic resharding read a rank's slices here (`longboat.sharding.zero.held` knows the
shape of the state per piece).
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from longboat.optim.layerwise import LayerwiseOptimizer
from longboat.sharding.zero.layout import flat_view
from longboat.sharding.zero.norms import ShardNormSum
from longboat.sharding.zero.setup import ShardSetup


class ShardOptimizer:
    """The user's optimizer class over this rank's slices of ``params`` (named ``names``, the
    reducer's order), laid out by ``setup``; see the module doc."""

    def __init__(
        self,
        user: torch.optim.Optimizer,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        setup: ShardSetup,
    ) -> None:
        self.user = user
        self.params, self.names = list(params), list(names)
        self.groups = setup.groups
        self.stage = setup.plan.stage
        self.layout = setup.layout
        self.scatter = setup.scatter  # stage 2: the reducer's collective, holding the slices
        self.group_of = setup.group_of
        """The user's param group of each trained parameter (None: not in the optimizer)."""
        self.flat = [flat_view(p.detach()) for p in params]
        """Each parameter's elements as one flat view, in the reducer's memory order."""
        self.pieces = self.layout.stepped()
        self.shard_params = [
            nn.Parameter(self.flat[piece.param][piece.start : piece.stop])
            for _, piece in self.pieces
        ]
        self.optimizer, self.group_map = self._build_optimizer()
        self.norm_sum: ShardNormSum | None = None  # layer-wise optimizers: whole-layer norms
        if isinstance(user, LayerwiseOptimizer):
            self.norm_sum = ShardNormSum(
                {
                    id(p): piece.param
                    for (_, piece), p in zip(self.pieces, self.shard_params, strict=True)
                },
                len(params),
                ShardNormSum.wide_enough(params),
                params[0].device,
                self.groups.shard,
            )
            if isinstance(self.optimizer, LayerwiseOptimizer):
                self.optimizer.norm_sum = self.norm_sum
        if setup.scatter is not None:  # stage 2: views of the slices, made once
            for (s, piece), p in zip(self.pieces, self.shard_params, strict=True):
                p.grad = setup.scatter.slices[s.index][piece.at : piece.at + piece.numel]

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer | None, list[tuple[int, int]]]:
        """The user's class and defaults over the shard parameters, one group per user group
        with shards here; ``(user group, shard group)`` pairs. None when this rank owns none."""
        by_group: dict[int, list[nn.Parameter]] = collections.defaultdict(list)
        for (_, piece), p in zip(self.pieces, self.shard_params, strict=True):
            assert piece.group is not None
            by_group[piece.group].append(p)
        order = sorted(by_group)
        if not order:
            return None, []
        groups = [
            {**_hparams(self.user.param_groups[g]), "params": by_group[g], **self._names(g)}
            for g in order
        ]
        cls = type(self.user)
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in self.user.defaults.items() if k in accepted}
        inner = cls(groups, **defaults)
        inner.defaults = dict(self.user.defaults)
        return inner, [(g, i) for i, g in enumerate(order)]

    def _names(self, user_group: int) -> dict[str, list[str]]:
        """``param_names`` of the shard parameters of a user group that names its parameters
        (LARS/LAMB exclude names from weight decay): each piece takes its parameter's name."""
        group = self.user.param_groups[user_group]
        if group.get("param_names") is None:
            return {}
        name_of = {id(p): n for p, n in zip(group["params"], group["param_names"], strict=True)}
        return {
            "param_names": [
                name_of[id(self.params[piece.param])]
                for _, piece in self.pieces
                if piece.group == user_group
            ]
        }

    def sync_hparams(self) -> None:
        """Copy every user group's hyper-parameters into its shard group."""
        assert self.optimizer is not None
        for user, shard in self.group_map:
            self.optimizer.param_groups[shard].update(_hparams(self.user.param_groups[user]))

    def load_grads(self) -> None:
        """Point each shard parameter's ``.grad`` at its slice of the averaged ``.grad``
        (stage 1; under stage 2 they view the reduce-scattered slices already)."""
        if self.stage == 2:
            return
        for (_, piece), p in zip(self.pieces, self.shard_params, strict=True):
            param = self.params[piece.param]
            grad = param.grad
            if grad is None:  # no gradient this step: zeros, as a flat shard cannot skip
                p.grad = torch.zeros_like(p)
            else:
                p.grad = _flat_grad(grad, param)[piece.start : piece.stop]

    def step(self, **kwargs: Any) -> None:
        """Step this rank's slices with the user's current hyper-parameters."""
        self.load_grads()
        if self.optimizer is not None:
            self.sync_hparams()
            self.optimizer.step(**kwargs)
        elif self.norm_sum is not None:  # no slice here: still join the norms' allreduce
            self.norm_sum([], torch.zeros(0, 2))

    def __repr__(self) -> str:
        return f"ShardOptimizer(stage={self.stage}, degree={self.groups.degree})"


def _hparams(group: dict[str, Any]) -> dict[str, Any]:
    """A group's hyper-parameters (its parameters and their names are the shard group's own)."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _flat_grad(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` flat in ``param``'s memory order."""
    if grad.stride() != param.stride():
        grad = torch.empty_like(param).copy_(grad)
    return flat_view(grad)
