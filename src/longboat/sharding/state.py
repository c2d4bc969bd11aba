"""The plain (unsharded) layout of a stage 3 model's and optimizer's state: gathered from the
shards for ``state_dict()``, cut into this rank's shards for ``load_state_dict()``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor


def whole(value: Any) -> Any:
    """A DTensor gathered into a plain CPU tensor (collective over its mesh); anything else
    as it is (a plain tensor moved to the CPU)."""
    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return value


def full_model_state(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with every sharded parameter gathered, one at a time (a rank
    holds the whole state on the CPU, and at most one whole parameter more on its device).
    Collective: every rank calls it, in the same order."""
    return {k: whole(v) for k, v in module.state_dict().items()}


def load_full_model_state(
    module: nn.Module, state: Mapping[str, Any], *, strict: bool = True
) -> Any:
    """Load a whole state dict of the unsharded module into the sharded ``module``: each rank
    keeps its own shards of what it reads (no communication)."""
    return set_model_state_dict(
        module, dict(state), options=StateDictOptions(full_state_dict=True, strict=strict)
    )


def full_optimizer_state(
    sharded: torch.optim.Optimizer, param_groups: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The ``state_dict()`` of the plain optimizer over the unsharded parameters: ``sharded``'s
    state (its parameters are in the user's order) gathered, with ``param_groups`` (the
    user's, as its ``state_dict()`` gives them). Collective."""
    inner = sharded.state_dict()
    state = {
        i: {k: whole(v) for k, v in per_param.items()} for i, per_param in inner["state"].items()
    }
    return {"state": state, "param_groups": [dict(g) for g in param_groups]}


def shard_optimizer_state(
    sharded: torch.optim.Optimizer, state: Mapping[int, Mapping[str, Any]]
) -> dict[int, dict[str, Any]]:
    """``state`` of the plain optimizer (per parameter index, whole tensors) cut into this
    rank's shards of ``sharded``'s parameters (no communication). ValueError on an index or a
    shape that does not match."""
    params = [p for group in sharded.param_groups for p in group["params"]]
    out: dict[int, dict[str, Any]] = {}
    for key, per_param in state.items():
        i = int(key)
        if not 0 <= i < len(params):
            raise ValueError(
                f"optimizer state for parameter {i}, and the optimizer has {len(params)}: "
                "load a state dict of the same model and param groups"
            )
        out[i] = {k: _shard_like(v, params[i], i, k) for k, v in per_param.items()}
    return out


def _shard_like(value: Any, param: torch.Tensor, index: int, key: str) -> Any:
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor):
        return value
    if value.shape != param.shape:
        if value.dim() == 0:  # a scalar (Adam's step): the same on every rank
            return value
        raise ValueError(
            f"optimizer state {key!r} of parameter {index} has shape {tuple(value.shape)}, "
            f"and the parameter {tuple(param.shape)}: load a state dict of the same model"
        )
    local = value.to(device=param.device, dtype=value.dtype)
    return distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
