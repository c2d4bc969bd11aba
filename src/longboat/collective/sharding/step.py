"""The sharded step: an optimizer over this rank's flat shards replaces the user's, then the
updated parameters are all-gathered (sharding stage 1 and 2), overlapped with the next forward
(`longboat.collective.sharding.gather`).

The user's optimizer keeps its ``param_groups`` (LR schedulers change them as usual) and never
steps itself: `ShardedStep` builds an optimizer of the same class and defaults over one flat
shard parameter per piece of the layout (`longboat.collective.sharding.layout`): a view of the
parameter's own elements, so the step updates them in place and no copy of the parameters is
kept. It has one param group per user group, whose hyper-parameters are copied into it at
every step. Its gradients are views of this rank's slice of the reduced gradients: of
``.grad`` (stage 1) or of the reducer's reduce-scattered slices (stage 2).
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from longboat.collective.model import DistributedModel
from longboat.collective.sharding.gather import ParameterGather
from longboat.collective.sharding.groups import ShardGroups
from longboat.collective.sharding.layout import ShardLayout, flat_view
from longboat.collective.sharding.norms import ShardNormSum
from longboat.optim.layerwise import LayerwiseOptimizer
from longboat.optim.staged import Stage, StageKind, StepRest

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)
"""Optimizers whose update of an element reads only that element's state: a flat slice of
many parameters steps exactly as the parameters would. Layer-wise ones (LARS, LAMB) also
work: the norms of their slices are summed per parameter (`longboat.collective.sharding.norms`)."""


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """ValueError unless ``optimizer`` updates every element on its own (exact class) or is
    one of longboat's layer-wise optimizers."""
    if type(optimizer) not in ELEMENTWISE and not isinstance(optimizer, LayerwiseOptimizer):
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ValueError(
            f"Strategy.sharding=True: {type(optimizer).__name__} is not known to update every "
            "element on its own (matrix factors, a global line search, per-layer norms of its "
            f"own); sharding supports {names}, and longboat's LARS and LAMB: use one of "
            "them, or set sharding=False"
        )


class ShardedStep(Stage):
    """Step an optimizer over this rank's shards, then all-gather the parameters."""

    kind = StageKind.SHARDED_STEP

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: DistributedModel,
        groups: ShardGroups,
        stage: int,
        *,
        overlap: bool = True,
    ) -> None:
        check_elementwise(optimizer)
        self.user = optimizer
        self.model = model
        self.groups = groups
        self.stage = stage
        self.overlap = overlap  # the all-gather during the next forward (eager models only)
        params = model.reducer.params
        self.params = params
        group_of = _group_of(optimizer, params, model.reducer.names)
        index = {n: i for i, n in enumerate(model.reducer.names)}
        buckets = [[index[n] for n in names] for names in model.reducer.bucket_members()]
        self.layout = ShardLayout.build(params, buckets, group_of, groups.degree, groups.index)
        self._flat = [flat_view(p.detach()) for p in params]
        self.pieces = self.layout.stepped()
        self.shard_params = [
            nn.Parameter(self._flat[piece.param][piece.start : piece.stop])
            for _, piece in self.pieces
        ]
        self.optimizer, self.group_map = self._build_optimizer()
        self.norm_sum: ShardNormSum | None = None  # layer-wise optimizers: whole-layer norms
        if isinstance(optimizer, LayerwiseOptimizer):
            self.norm_sum = ShardNormSum(
                {
                    id(p): piece.param
                    for (_, piece), p in zip(self.pieces, self.shard_params, strict=True)
                },
                len(params),
                ShardNormSum.wide_enough(params),
                params[0].device,
                groups.shard,
            )
            if isinstance(self.optimizer, LayerwiseOptimizer):
                self.optimizer.norm_sum = self.norm_sum
        self._grads_of: object = None  # the reducer whose slices the shard grads view
        self.gather = ParameterGather(self.layout.buckets, params, self._flat, groups)
        model.drop_pending_writes()  # a sharded step built anew (elastic) replaces the old one
        model.pending_writes = self.gather

    # -- construction ---------------------------------------------------------------------------

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

    # -- the step -------------------------------------------------------------------------------

    def step(self, rest: StepRest, closure: Any = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self.gather.finish()
            self._load_grads()
            if self.optimizer is not None:
                self.sync_hparams()
                self.optimizer.step(**kwargs)
            elif self.norm_sum is not None:  # no slice here: still join the norms' allreduce
                self.norm_sum([], torch.zeros(0, 2))
        if self.overlap and self.model.runs_eagerly():
            self.gather.watch(self.model.module)  # overlaps from the second step on
        else:
            self.gather.stop_overlap()
        self.gather.after_step()
        # an LR scheduler built on the user's optimizer checks that it stepped (torch sets
        # this flag from the step it wraps, which sharding replaces)
        self.user._opt_called = True  # type: ignore[attr-defined]
        return loss

    def sync_hparams(self) -> None:
        """Copy every user group's hyper-parameters into its shard group."""
        assert self.optimizer is not None
        for user, shard in self.group_map:
            self.optimizer.param_groups[shard].update(_hparams(self.user.param_groups[user]))

    def _load_grads(self) -> None:
        """Point each shard parameter's ``.grad`` at its slice of the reduced gradients."""
        if self.stage == 2:
            reducer = self.model.reducer
            if self._grads_of is not reducer:  # the slices persist: views made once
                for (s, piece), p in zip(self.pieces, self.shard_params, strict=True):
                    p.grad = reducer.grad_shards[s.index][piece.at : piece.at + piece.numel]
                self._grads_of = reducer
            return
        for (_, piece), p in zip(self.pieces, self.shard_params, strict=True):
            param = self.params[piece.param]
            grad = param.grad
            if grad is None:  # no gradient this step: zeros, as a flat shard cannot skip
                p.grad = torch.zeros_like(p)
            else:
                p.grad = _flat_grad(grad, param)[piece.start : piece.stop]

    # -- what else reads the shards --------------------------------------------------------------

    def state_dict(self, rest: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        from longboat.collective.sharding.state import gather_state_dict

        self.gather.finish()  # a checkpoint of both reads complete parameters next
        return gather_state_dict(self)

    def load_state_dict(
        self, rest: Callable[[dict[str, Any]], None], state_dict: dict[str, Any]
    ) -> None:
        from longboat.collective.sharding.state import load_gathered_state_dict

        load_gathered_state_dict(self, state_dict)

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors of the shard optimizer's state."""
        if self.optimizer is None:
            return []
        return [
            t
            for state in self.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        ]

    def __repr__(self) -> str:
        return f"ShardedStep(stage={self.stage}, degree={self.groups.degree})"


def _hparams(group: dict[str, Any]) -> dict[str, Any]:
    """A group's hyper-parameters (its parameters and their names are the shard group's own)."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _flat_grad(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` flat in ``param``'s memory order."""
    if grad.stride() != param.stride():
        grad = torch.empty_like(param).copy_(grad)
    return flat_view(grad)


def _group_of(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], names: list[str]
) -> list[int | None]:
    """The user's param group of each trained parameter (None: not in the optimizer);
    ValueError for an optimizer parameter the model does not train."""
    position = {id(p): i for i, p in enumerate(params)}
    group_of: list[int | None] = [None] * len(params)
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            i = position.get(id(p))
            if i is None:
                raise ValueError(
                    "Strategy.sharding=True: the optimizer holds a parameter of shape "
                    f"{tuple(p.shape)} that is not a trained parameter of the model (frozen, or "
                    "of another module); sharding lays the optimizer out over the model's "
                    "gradient buckets: pass only the model's trainable parameters"
                )
            group_of[i] = g
    return group_of
