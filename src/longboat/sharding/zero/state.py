"""The sharded optimizer's state in torch's standard, unsharded layout, and back.

``optimizer.state_dict()`` under sharding gathers every rank's shards into the ``state_dict``
the plain optimizer would have (state per parameter index, shaped like the parameter; the
user's param groups), on every rank: it loads into the plain optimizer, and into a sharded
run at any world size and ``sharding_degree``, whose ``load_state_dict`` keeps only the
slices its rank owns. Gathering is collective: every rank of the job calls it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from longboat.comm.exchange import allgather_bytes
from longboat.comm.handles import wait_for
from longboat.sharding.zero.held import over_elements, put, shaped_state, state_of
from longboat.sharding.zero.layout import flat_view

if TYPE_CHECKING:
    from longboat.sharding.zero.shard_optimizer import ShardOptimizer


def describe(step: ShardOptimizer) -> dict[str, dict[str, Any]]:
    """Per user group with state here (keys: the group's index as text), JSON-safe:
    ``{key: {"dtype": name}}`` for shaped state, ``{key: {"scalar": value, "dtype": name}}``
    for a scalar tensor (the same on every shard of the group), ``{key: {"value": v}}`` for
    a Python number."""
    out: dict[str, dict[str, Any]] = {}
    for k, (_, piece) in enumerate(step.pieces):
        state = state_of(step, k)
        if state and str(piece.group) not in out:
            out[str(piece.group)] = {key: _entry(key, v) for key, v in state.items()}
    return out


def _entry(key: str, value: Any) -> dict[str, Any]:
    if over_elements(value):
        return {"dtype": str(value.dtype).removeprefix("torch.")}
    if torch.is_tensor(value):
        return {"scalar": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if value is None or isinstance(value, bool | int | float):
        return {"value": value}
    raise TypeError(
        f"sharding cannot gather optimizer state {key!r} of type {type(value).__name__}: only "
        "tensors and numbers travel between ranks (nothing is pickled)"
    )


def descriptions(step: ShardOptimizer) -> dict[int, dict[str, dict[str, Any]]]:
    """Every shard rank's `describe`, merged: user group -> key -> entry (JSON over the
    shard group; nothing that crosses the network is unpickled)."""
    mine = json.dumps(describe(step)).encode()
    keys: dict[int, dict[str, dict[str, Any]]] = {}
    for raw in allgather_bytes(mine, group=step.groups.shard):
        for g, info in json.loads(raw).items():
            keys.setdefault(int(g), info)
    return keys


def is_shaped(entry: dict[str, Any] | None) -> bool:
    return entry is not None and set(entry) == {"dtype"}


def _gathered_shaped(
    step: ShardOptimizer, keys: dict[int, dict[str, dict[str, Any]]]
) -> dict[int, dict[str, torch.Tensor]]:
    """Parameter index -> shaped state, all-gathered bucket by bucket from the shards."""
    dtypes = {k: e["dtype"] for info in keys.values() for k, e in info.items() if is_shaped(e)}
    pieces: dict[int, list[tuple[int, dict[str, torch.Tensor]]]] = {}
    for k, (s, _) in enumerate(step.pieces):
        pieces.setdefault(s.index, []).append((k, shaped_state(step, k)))
    full_state: dict[int, dict[str, torch.Tensor]] = {}
    for s in step.layout.buckets:
        for key in sorted(dtypes):
            dtype = getattr(torch, dtypes[key])
            local = torch.zeros(s.shard_numel, dtype=dtype, device=s.device)
            for k, state in pieces.get(s.index, []):
                piece = step.pieces[k][1]
                if key in state:
                    local[piece.at : piece.at + piece.numel].copy_(state[key])
            full = torch.empty(s.shard_numel * step.groups.degree, dtype=dtype, device=s.device)
            wait_for(step.groups.all_gather(full, local))
            for i, off in s.members:
                g = step.group_of[i]
                if g is None or not is_shaped(keys.get(g, {}).get(key)):
                    continue
                param = step.params[i]
                value = torch.empty_like(param, dtype=dtype)
                flat_view(value).copy_(full[off : off + param.numel()])
                full_state.setdefault(i, {})[key] = value
    return full_state


def scalars(info: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A group's scalar state, rebuilt from its JSON entries (scalar tensors on the CPU)."""
    out: dict[str, Any] = {}
    for key, entry in info.items():
        if "scalar" in entry:
            out[key] = torch.tensor(entry["scalar"], dtype=getattr(torch, entry["dtype"]))
        elif "value" in entry:
            out[key] = entry["value"]
    return out


def gather_state_dict(step: ShardOptimizer) -> dict[str, Any]:
    """The full ``state_dict`` of the user's optimizer class (collective over the job)."""
    keys = descriptions(step)
    full_state: dict[int, dict[str, Any]] = _gathered_shaped(step, keys)
    for i, g in enumerate(step.group_of):
        if g is not None and g in keys:
            full_state.setdefault(i, {}).update(scalars(keys[g]))
    plain = step.user.state_dict()  # the user's param groups, numbered as torch numbers them
    index = _torch_index(step)
    plain["state"] = {
        index[i]: {k: state[k] for k in sorted(state)} for i, state in sorted(full_state.items())
    }
    return plain


def load_gathered_state_dict(step: ShardOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a full ``state_dict`` (this one's or the plain optimizer's): the hyper-parameters
    into the user's param groups, this rank's slices of the state into the shard optimizer."""
    saved_groups = state_dict["param_groups"]
    load_param_groups(step, saved_groups)
    position = {id(p): i for i, p in enumerate(step.params)}
    saved_of: dict[int, Any] = {}
    for s_group, u_group in zip(saved_groups, step.user.param_groups, strict=True):
        for pid, p in zip(s_group["params"], u_group["params"], strict=True):
            saved_of[position[id(p)]] = state_dict["state"].get(pid) or {}
    if step.optimizer is None:
        return
    step.optimizer.state.clear()
    for k, (_, piece) in enumerate(step.pieces):
        saved = saved_of[piece.param]
        param = step.params[piece.param]
        shaped = {
            key: _flat_like(v, param)[piece.start : piece.stop]
            for key, v in saved.items()
            if over_elements(v)
        }
        put(step, k, shaped, {key: v for key, v in saved.items() if not over_elements(v)})


def load_param_groups(step: ShardOptimizer, saved_groups: list[dict[str, Any]]) -> None:
    """Copy the hyper-parameters of ``saved_groups`` (a ``state_dict``'s ``param_groups``)
    into the user's param groups; ValueError when their number or sizes differ."""
    user = step.user
    if len(saved_groups) != len(user.param_groups) or any(
        len(s["params"]) != len(u["params"])
        for s, u in zip(saved_groups, user.param_groups, strict=True)
    ):
        raise ValueError(
            "loaded state dict has param groups that do not match the optimizer's (their "
            "number or sizes differ): load a state_dict of the same model and param groups"
        )
    for s_group, u_group in zip(saved_groups, user.param_groups, strict=True):
        u_group.update({k: v for k, v in s_group.items() if k != "params"})


def _flat_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (shaped like ``param``) flat in ``param``'s memory order."""
    if value.shape != param.shape:
        raise ValueError(
            f"loaded optimizer state of shape {tuple(value.shape)} for a parameter of shape "
            f"{tuple(param.shape)}: load a state_dict of the same model"
        )
    if value.stride() != param.stride():
        value = torch.empty_like(param, dtype=value.dtype).copy_(value)
    return flat_view(value)


def _torch_index(step: ShardOptimizer) -> dict[int, int]:
    """Trained-parameter index -> the index torch's ``state_dict`` gives it."""
    position = {id(p): i for i, p in enumerate(step.params)}
    ordered = [p for group in step.user.param_groups for p in group["params"]]
    return {position[id(p)]: n for n, p in enumerate(ordered)}
