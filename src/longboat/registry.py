"""Tables of named, declared factories: the single source of the names, config keys, defaults
and traits of pluggable pieces (allreduce algorithms, intra-node stages, gradient compressors,
parameter-server modes).

The Strategy validates its fields against :data:`ALGORITHMS` and :data:`COMPRESSORS` and the
collective engine builds from them. A registry's built-in entries are the ``register`` calls of
the modules in its package's folder, every one of which it imports on first lookup
(:func:`package_modules`), so a built-in is one module dropped into that folder and nothing
else. This module imports neither torch nor the Strategy.
"""

from __future__ import annotations

import importlib
import itertools
import pkgutil
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

F = TypeVar("F", bound=Callable)


class ConfigKeys(Protocol):
    """The keys of a factory's ``<name>_configs`` (``longboat.strategy.values.Config`` is
    one): their names, defaults, and a checked value as plain data."""

    def names(self) -> list[str]: ...

    def defaults(self) -> dict[str, Any]: ...

    def plain(self, value: Mapping[str, Any]) -> dict[str, Any]: ...


TOPOLOGIES = ("any", "many_ranks", "one_node", "multi_node")
"""Where an algorithm is worth trying automatically: anywhere, on more than two ranks, on one
node with several ranks, across nodes with several ranks on a node. Also the order in which the
automatic choice tries algorithms (:func:`auto_candidates`): the most general first."""

_versions = itertools.count(1)


def suits(topologies: tuple[str, ...], ranks: int, nodes: int) -> bool:
    """Whether any of ``topologies`` describes a group of ``ranks`` ranks on ``nodes`` nodes."""
    checks = {
        "any": True,
        "many_ranks": ranks > 2,
        "one_node": nodes == 1 and ranks > 1,
        "multi_node": nodes > 1 and ranks > nodes,
    }
    return any(checks[t] for t in topologies)


@dataclass(frozen=True)
class Entry(Generic[F]):
    """One registered factory and what the rest of longboat needs to know about it.

    ``config``: the keys of its ``<name>_configs`` Strategy field (None: no config);
    ``lossy``: it changes values beyond rounding (exact flags are sent apart);
    ``topologies``: where the automatic choice may try it (see :data:`TOPOLOGIES`);
    ``broadcast``: the start-up broadcast of rank 0's state goes through it;
    ``tune``: ``Strategy(auto=True)`` may try it; ``switch``: the bool Strategy field that
    selects it instead of the name field; ``title``: its name in prose; ``cost``: its cost
    model for ``longboat sim`` (an allreduce algorithm's ``cost(nbytes, network)`` ->
    ``(latency_s, link_s)``, or None where it does not apply, see
    `longboat.comm.algorithms.Network`; a compressor's ``cost(bucket)`` -> ``Wire``, see
    `longboat.comm.compress.Wire`; a parameter-server mode's, see
    `longboat.ps.trainer.modes.Exchange`).

    What a gradient compressor needs from the engine: ``momentum``: it applies the optimizer's
    momentum itself (momentum correction): it gets the optimizer's momentum as
    ``config["momentum"]``, the optimizer steps without its own, and it cannot run as a DDP
    communication hook (which never sees the optimizer); ``elastic``: its state can start
    afresh in a new world (False: elastic training refuses it); ``state``: what it keeps per
    rank between steps, in prose (set: the autotuner never swaps the reducer holding it).
    """

    name: str
    factory: F
    doc: str = ""
    config: ConfigKeys | None = None
    lossy: bool = False
    topologies: tuple[str, ...] = ()
    broadcast: bool = False
    tune: bool = True
    switch: str | None = None
    title: str = ""
    cost: Callable[..., Any] | None = None
    momentum: bool = False
    elastic: bool = True
    state: str = ""

    @property
    def label(self) -> str:
        """``title`` or else the name."""
        return self.title or self.name


class Registry(Generic[F]):
    """``register(name, ...)`` decorates a factory; ``get(name)`` returns it or names the choices.

    ``package`` (optional): the package whose modules register the built-in entries; the first
    lookup imports every module of its folder (:func:`package_modules`), so importing the
    package stays cheap and a new built-in is a new module there.
    """

    def __init__(self, kind: str, package: str | None = None):
        self.kind = kind
        self.package = package
        self._load_builtin = None if package is None else lambda: _import_all(package)
        self._loaded = package is None
        self._loading = threading.RLock()
        self._entries: dict[str, Entry[F]] = {}
        self._version = next(_versions)

    def register(
        self,
        name: str,
        *,
        doc: str | None = None,
        config: ConfigKeys | None = None,
        lossy: bool = False,
        topologies: tuple[str, ...] = (),
        broadcast: bool = False,
        tune: bool = True,
        switch: str | None = None,
        title: str = "",
        cost: Callable[..., Any] | None = None,
        momentum: bool = False,
        elastic: bool = True,
        state: str = "",
    ) -> Callable[[F], F]:
        """Decorator: declare ``factory`` as ``name`` (``doc``: its docstring's first line)."""
        unknown = sorted(set(topologies) - set(TOPOLOGIES))
        if unknown:
            raise ValueError(f"unknown topologies {unknown}; choose from {', '.join(TOPOLOGIES)}")

        def decorate(factory: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            text = doc if doc is not None else (factory.__doc__ or "").strip().split("\n")[0]
            self._entries[name] = Entry(
                name,
                factory,
                text,
                config,
                lossy,
                tuple(topologies),
                broadcast,
                tune,
                switch,
                title,
                cost,
                momentum,
                elastic,
                state,
            )
            self._version = next(_versions)
            return factory

        return decorate

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests remove what they registered)."""
        self._load()
        if self._entries.pop(name, None) is None:
            raise ValueError(f"{self.kind} {name!r} is not registered")
        self._version = next(_versions)

    @contextmanager
    def scoped(self) -> Iterator[Registry[F]]:
        """Entries registered inside the block are removed when it ends."""
        self._load()
        before = dict(self._entries)
        try:
            yield self
        finally:
            self._entries = before
            self._version = next(_versions)

    @property
    def version(self) -> int:
        """Changes whenever an entry is added or removed (for caches derived from entries)."""
        self._load()
        return self._version

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def entries(self) -> list[Entry[F]]:
        """Every entry, by name (never by the order in which modules happened to import)."""
        self._load()
        return [self._entries[name] for name in sorted(self._entries)]

    def having(self, trait: str) -> list[str]:
        """Names of the entries whose ``trait`` is set (e.g. ``"cost"``), by name."""
        return [e.name for e in self.entries() if getattr(e, trait)]

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def entry(self, name: str) -> Entry[F]:
        """The declaration of ``name``; ValueError naming the choices if there is none."""
        self._load()
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}"
            ) from None

    def get(self, name: str) -> F:
        return self.entry(name).factory

    def _load(self) -> None:
        """Import the built-in entries once. Other threads wait until that has finished (a
        lookup must never see a half-filled registry); the loading thread itself, re-entering
        from a module it imports, sees what is registered so far."""
        if self._loaded:
            return
        with self._loading:
            load, self._load_builtin = self._load_builtin, None
            if load is not None:
                try:
                    load()
                finally:
                    self._loaded = True


def package_modules(package: str) -> list[str]:
    """Every module of ``package``'s folder (sub-packages included), by name: what a registry
    of that package imports for its built-in entries."""
    path = importlib.import_module(package).__path__
    return [f"{package}.{name}" for name in sorted(m.name for m in pkgutil.iter_modules(path))]


def _import_all(package: str) -> None:
    for module in package_modules(package):
        importlib.import_module(module)


ALGORITHMS: Registry[Callable] = Registry("allreduce algorithm", "longboat.comm.algorithms")
"""Allreduce algorithms ``make(group) -> AllreduceFn``: ``Strategy.allreduce_algorithm``."""

COMPRESSORS: Registry[Callable] = Registry("gradient compressor", "longboat.comm.compress")
"""Gradient compressors ``(inner, group, config) -> AllreduceFn``:
``Strategy.gradient_compression`` (or their ``switch`` field) and ``<name>_configs``."""

PS_MODES: Registry[type] = Registry("parameter-server mode", "longboat.ps.trainer.modes")
"""Parameter-server modes (`longboat.ps.trainer.modes.Mode` classes): ``a_sync_configs['mode']``."""


def auto_candidates(ranks: int, nodes: int) -> list[Entry[Callable]]:
    """The allreduce algorithms the automatic choice tries on ``ranks`` ranks over ``nodes``
    nodes (the ``auto`` algorithm, ``Strategy(auto=True)``, ``longboat sim``): those whose
    declared topologies suit the group, ordered by the earliest of :data:`TOPOLOGIES` each
    declares, then by name. A tie keeps the first, so the more general algorithm wins it
    ("native", declared for "any", comes first)."""

    def rank(entry: Entry[Callable]) -> tuple[int, str]:
        return min(TOPOLOGIES.index(t) for t in entry.topologies), entry.name

    suited = [e for e in ALGORITHMS.entries() if suits(e.topologies, ranks, nodes)]
    return sorted(suited, key=rank)
