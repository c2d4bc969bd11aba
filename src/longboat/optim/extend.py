"""Extend an object (a user's optimizer) with a mixin's behaviour, in place.

``extend(optimizer, Mixin, name="Traced", observer_attr=value)`` swaps the object's class for a
subclass that puts ``Mixin`` first, so the caller's own reference, LR schedulers and
``isinstance(optimizer, OriginalClass)`` keep working. Extensions stack (each one goes in front
of the previous ones) and are idempotent: extending with a mixin the object already has leaves
its class alone and only sets the collaborators again.

Collaborators are the objects the mixin's methods use (the model, the observer, the reducer).
They are passed to ``extend`` and must be declared as annotated attributes on the mixin, so
every attribute that the extension adds is typed where its methods read it.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

__all__ = ["extend", "is_extended"]

T = TypeVar("T")


def _declared(mixin: type) -> set[str]:
    """The attribute names annotated on ``mixin`` and its bases."""
    names: set[str] = set()
    for klass in mixin.__mro__:
        names.update(vars(klass).get("__annotations__", {}))
    return names


@functools.cache
def _subclass(base: type, mixin: type, name: str) -> type:
    """One class per (base, mixin, name): optimizers extended alike share their class."""
    return type(name, (mixin, base), {"__module__": mixin.__module__, "_lb_extended": True})


def is_extended(obj: object) -> bool:
    """Whether ``obj`` was extended by `extend` (e.g. an optimizer already distributed)."""
    return getattr(type(obj), "_lb_extended", False) is True


def extend(obj: T, mixin: type, name: str | None = None, **collaborators: Any) -> T:
    """Put ``mixin`` in front of ``obj``'s class (in place, once) and set ``collaborators``.

    ``name``: a prefix for the new class's name (``"Traced"`` makes ``TracedSGD`` of an SGD;
    ``""`` keeps the original name); default: the mixin's name. Each keyword must be an
    attribute annotated on ``mixin`` (TypeError otherwise). Returns ``obj``.
    """
    declared = _declared(mixin)
    unknown = sorted(set(collaborators) - declared)
    if unknown:
        raise TypeError(
            f"{mixin.__name__} declares no attribute(s) {unknown}: annotate them on the mixin"
        )
    base = type(obj)
    if not isinstance(obj, mixin):
        prefix = mixin.__name__.lstrip("_") if name is None else name
        obj.__class__ = _subclass(base, mixin, f"{prefix}{base.__name__}")
    for attr, value in collaborators.items():
        setattr(obj, attr, value)
    return obj
