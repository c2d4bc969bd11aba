"""Sharding stage 3's units for the simulator: the profile's module tree rebuilt on the meta
device and planned by the engine's own planner (`longboat.sharding.fsdp.plan_units`).

A profile records each submodule's class name, the class's Python module, the container it
derives from and whether it has a forward of its own (`module_tree`): exactly what the planner
reads to choose units (a callable module may be a unit; containers and your own classes are
opened, torch's layers are not; ``sharding_configs['units']`` matches class or module names).
A profile without that record (measured before it existed) gets a tree guessed from the
parameter names: modules that hold parameters directly are torch layers, the others your own
classes. A tied weight is one parameter of the profile, registered again under each other
owner (so it stays with the root, as in the engine).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from longboat.collective.plan import CollectivePlan
from longboat.sim.profile import Profile

_CONTAINERS: dict[str, type[nn.Module]] = {
    "Sequential": nn.Sequential,
    "ModuleList": nn.ModuleList,
    "ModuleDict": nn.ModuleDict,
}
_GUESSED_LAYER = ["Layer", "torch.nn.modules", "", True]
_GUESSED_BLOCK = ["Module", "longboat.sim.profile", "", True]


def module_tree(model: nn.Module) -> dict[str, list[Any]]:
    """``{name: [class name, class module, container base or "", has own forward, ties]}`` for
    every submodule of ``model``, in ``named_modules`` order (what `Profile.modules` records);
    ``ties`` maps the module's own parameters that another module registered first (a tied
    head) to that first name, the one the profile's parameter list holds."""
    first = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, list[Any]] = {}
    for name, module in model.named_modules():
        if not name:
            continue
        cls = type(module)
        base = next((k for k, c in _CONTAINERS.items() if isinstance(module, c)), "")
        ties = {
            leaf: first[id(p)]
            for leaf, p in module.named_parameters(recurse=False)
            if id(p) in first and first[id(p)] != f"{name}.{leaf}"
        }
        out[name] = [cls.__name__, cls.__module__, base, cls.forward is not nn.Module.forward, ties]
    return out


def _never_called(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a simulator skeleton module is planned on, never run")


@functools.cache
def _skeleton_class(name: str, module: str, base: str, own_forward: bool) -> type[nn.Module]:
    parent = _CONTAINERS.get(base, nn.Module)
    body: dict[str, Any] = {"__module__": module}
    if own_forward and parent is not nn.Sequential:
        body["forward"] = _never_called
    return type(name, (parent,), body)


def _guessed(profile: Profile) -> dict[str, list[Any]]:
    """A tree from the parameter names alone: parameter holders are layers, the rest blocks."""
    owners = [p.name.rpartition(".")[0] for p in profile.params]
    tree: dict[str, list[Any]] = {}
    for owner in owners:
        parts = owner.split(".") if owner else []
        for depth in range(1, len(parts) + 1):
            tree.setdefault(".".join(parts[:depth]), _GUESSED_BLOCK)
    parents = {name.rpartition(".")[0] for name in tree}
    return {n: (_GUESSED_BLOCK if n in parents else _GUESSED_LAYER) for n in tree}


def skeleton(profile: Profile) -> tuple[nn.Module, list[nn.Parameter]]:
    """The profile's model on the meta device (no memory), and its parameters in the
    profile's order."""
    root = nn.Module()
    tree = profile.modules or _guessed(profile)
    for name, (cls, module, base, own_forward, *_) in tree.items():
        parent, _, child = name.rpartition(".")
        holder = root.get_submodule(parent) if parent else root
        holder.add_module(
            child, _skeleton_class(str(cls), str(module), str(base), bool(own_forward))()
        )
    params = {}
    for p in profile.params:
        owner, _, leaf = p.name.rpartition(".")
        param = nn.Parameter(torch.empty(p.shape, dtype=getattr(torch, p.dtype), device="meta"))
        (root.get_submodule(owner) if owner else root).register_parameter(leaf, param)
        params[p.name] = param
    for name, (*_, ties) in ((n, v) for n, v in tree.items() if len(v) > 4):
        for leaf, first in dict(ties).items():
            if first in params:
                root.get_submodule(name).register_parameter(leaf, params[first])
    return root, list(params.values())


def _key(profile: Profile) -> tuple[Any, ...]:
    params = tuple((p.name, p.shape, p.dtype) for p in profile.params)
    return params, repr(sorted(profile.modules.items()))


_PLANNED: dict[tuple[Any, ...], tuple[list[list[int]], list[int]]] = {}


def unit_params(profile: Profile, plan: CollectivePlan) -> tuple[list[list[int]], list[int]]:
    """Indices into ``profile.params`` of each unit, in forward (registration) order, and of
    the root's parameters (those in no unit), as ``lb.distribute`` would shard the model.
    Cached by the profile's shapes and the settings that choose units (a recommendation
    prices many Strategies on one profile)."""
    assert plan.sharding is not None
    key = (_key(profile), plan.sharding.units, plan.comm.bucket_mb, plan.comm.layers_per_bucket)
    if key not in _PLANNED:
        if len(_PLANNED) >= 64:
            _PLANNED.clear()
        _PLANNED[key] = _plan(profile, plan)
    units, root = _PLANNED[key]
    return [list(u) for u in units], list(root)


def _plan(profile: Profile, plan: CollectivePlan) -> tuple[list[list[int]], list[int]]:
    from longboat.sharding.fsdp import plan_units

    model, params = skeleton(profile)
    index = {id(p): i for i, p in enumerate(params)}
    try:
        units = plan_units(model, plan)
    except ValueError as exc:
        if profile.modules:
            raise
        raise ValueError(
            f"{exc} (this profile records no module classes: measure it again with "
            "`longboat sim profile` to name units by class)"
        ) from None
    groups = [sorted({index[id(p)] for m in unit for p in m.parameters()}) for unit in units]
    groups = sorted((g for g in groups if g), key=lambda g: g[0])
    taken = {i for g in groups for i in g}
    return groups, [i for i in range(len(params)) if i not in taken]
