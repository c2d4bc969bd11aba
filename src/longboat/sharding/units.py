"""Which modules become FSDP units (each all-gathers its parameters as one message).

The user's list (``sharding_configs['units']``: module class names or module names, as an
auto-wrap policy by block class) or, by default, the plan's grouping: from the root down, a
module whose parameters fit ``fuse_grad_size_in_MB`` is a unit candidate, consecutive candidate
siblings are packed into one unit up to that size and ``fuse_grad_size_in_TFLOPS`` layers, and
what is left (the root's own parameters, the parameters of modules too large to be one unit
that cannot be split: torch's own layers are split only if they are containers) belongs to the
root. A parameter shared by modules (a tied embedding
and head) stays with the smallest module holding every use of it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import nn

MB = 1 << 20

Unit = list[nn.Module]
"""One FSDP unit: the modules ``fully_shard`` is called on together."""


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _shared(model: nn.Module) -> dict[int, list[str]]:
    """Parameters reached by more than one module name: id -> every owning module's name."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name.rpartition(".")[0])
    return {pid: names for pid, names in owners.items() if len(names) > 1}


def _callable(module: nn.Module) -> bool:
    """A module with a forward of its own (not a ModuleList/ModuleDict, whose children are
    called one by one): FSDP2 gathers a unit's parameters in its forward pre-hook."""
    return type(module).forward is not nn.Module.forward


def _opens(module: nn.Module) -> bool:
    """Whether the planner may make units of ``module``'s children: containers and your own
    classes, not torch's layers (``nn.MultiheadAttention`` reads ``out_proj.weight`` without
    calling ``out_proj``)."""
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    return isinstance(module, containers) or not type(module).__module__.startswith("torch.")


def _holds_all_uses(name: str, shared: dict[int, list[str]], module: nn.Module) -> bool:
    """``module`` (named ``name``) holds every use of each shared parameter it holds."""
    prefix = f"{name}." if name else ""
    for p in module.parameters():
        owners = shared.get(id(p))
        if owners and not all(o == name or o.startswith(prefix) for o in owners):
            return False
    return True


def named_units(model: nn.Module, names: Sequence[str]) -> list[Unit]:
    """The user's units: every module whose class name or module name is in ``names``,
    innermost first. ValueError naming an entry that matches nothing, or a unit that holds one
    use of a shared parameter but not the other."""
    wanted = set(names)
    shared = _shared(model)
    found: list[tuple[str, nn.Module]] = []
    matched: set[str] = set()
    for name, module in model.named_modules():
        hit = {type(module).__name__, name} & wanted
        if not hit or module is model:
            continue
        if not _callable(module):
            raise ValueError(
                f"sharding_configs['units']: module {name!r} ({type(module).__name__}) has no "
                "forward of its own (its children are called one by one): name its children"
            )
        matched |= hit
        if not _holds_all_uses(name, shared, module):
            raise ValueError(
                f"sharding_configs['units']: module {name!r} ({type(module).__name__}) holds a "
                "parameter another module shares (a tied weight): name a module that holds "
                "both, or leave it to the root"
            )
        found.append((name, module))
    missing = sorted(wanted - matched)
    if missing:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"sharding_configs['units'] names {missing[0]!r}, which is neither a module class "
            f"of the model ({', '.join(classes)}) nor a name from model.named_modules()"
        )
    found.sort(key=lambda item: -item[0].count("."))  # innermost first: FSDP2's order
    return [[m] for _, m in found]


def planned_units(model: nn.Module, cap_mb: float, max_layers: int) -> list[Unit]:
    """The default units of ``model``: candidate subtrees of at most ``cap_mb`` MB, packed in
    order into units of at most ``cap_mb`` MB and ``max_layers`` modules."""
    cap = max(1, int(cap_mb * MB))
    shared = _shared(model)
    return list(_pack(model, "", cap, max(1, max_layers), shared))


def _pack(
    module: nn.Module, name: str, cap: int, max_layers: int, shared: dict[int, list[str]]
) -> Iterator[Unit]:
    """Units under ``module`` (not ``module`` itself), children in registration order."""
    unit: Unit = []
    size = 0
    for child_name, child in module.named_children():
        full = f"{name}.{child_name}" if name else child_name
        nbytes = _param_bytes(child)
        if nbytes == 0:
            continue
        fits = nbytes <= cap and _callable(child) and _holds_all_uses(full, shared, child)
        if not fits:
            if unit:
                yield unit
                unit, size = [], 0
            if _opens(child):
                yield from _pack(child, full, cap, max_layers, shared)
            continue
        if unit and (size + nbytes > cap or len(unit) >= max_layers):
            yield unit
            unit, size = [], 0
        unit.append(child)
        size += nbytes
    if unit:
        yield unit


def describe(model: nn.Module, units: Sequence[Unit]) -> str:
    """``"N units: a, b+c, ..."``, names as in ``model.named_modules()``."""
    names = {id(m): n for n, m in model.named_modules()}
    shown = ["+".join(names[id(m)] for m in unit) for unit in units]
    more = f", ... ({len(shown) - 6} more)" if len(shown) > 8 else ""
    listed = ", ".join(shown if not more else shown[:6])
    return f"{len(units)} unit(s) and the root: {listed or '(the root only)'}{more}"
