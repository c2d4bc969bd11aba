"""What the shard optimizer holds per piece, read and written only here: its state entries
are *shaped* (a tensor over the piece's elements: Adam's moments) or *scalar* (``step``, a
0-d tensor or a number)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from longboat.sharding.zero.shard_optimizer import ShardOptimizer


def over_elements(value: Any) -> bool:
    """Whether a state entry is shaped (over the elements) rather than a scalar."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def state_of(step: ShardOptimizer, k: int) -> Mapping[str, Any]:
    """Piece ``k``'s state (empty before its first step, or where this rank steps nothing)."""
    if step.optimizer is None:
        return {}
    return step.optimizer.state.get(step.shard_params[k], {})


def shaped_state(step: ShardOptimizer, k: int) -> dict[str, torch.Tensor]:
    """Piece ``k``'s shaped state: the optimizer's own flat tensors, not copies."""
    return {key: v for key, v in state_of(step, k).items() if over_elements(v)}


def state_tensors(step: ShardOptimizer) -> list[torch.Tensor]:
    """Every tensor of the shard optimizer's state (shaped and scalar)."""
    return [
        v
        for k in range(len(step.shard_params))
        for v in state_of(step, k).values()
        if isinstance(v, torch.Tensor)
    ]


def put(step: ShardOptimizer, k: int, shaped: Mapping[str, torch.Tensor], scalars: dict) -> None:
    """The state of piece ``k``: ``shaped`` (flat over the piece's elements; copied, floating
    values cast to the parameter's dtype as torch's ``load_state_dict`` casts) and
    ``scalars`` (cloned: optimizers step them in place). Nothing when both are empty (a piece
    not yet stepped)."""
    assert step.optimizer is not None
    param = step.shard_params[k]
    entry: dict[str, Any] = {}
    for key, value in shaped.items():
        dtype = param.dtype if value.is_floating_point() else value.dtype
        entry[key] = value.to(device=param.device, dtype=dtype, copy=True)
    entry.update({key: v.clone() if torch.is_tensor(v) else v for key, v in scalars.items()})
    if entry:
        step.optimizer.state[param] = entry
