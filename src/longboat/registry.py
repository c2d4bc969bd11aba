"""Tables of named, declared factories: the single source of the names, config keys, defaults
and traits of pluggable pieces (allreduce algorithms, intra-node stages, gradient compressors).

The Strategy validates its fields against :data:`ALGORITHMS` and :data:`COMPRESSORS`, the
collective engine builds from them and ``docs/strategy.md`` lists them, so adding one is a
module with one ``register`` call. This module imports neither torch nor the Strategy.
"""

from __future__ import annotations

import importlib
import itertools
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
node with several ranks, across nodes with several ranks on a node."""

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
    ``(latency_s, link_s)``, or None where it does not apply; see
    `longboat.comm.algorithms.Network`).
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

    @property
    def label(self) -> str:
        """``title`` or else the name."""
        return self.title or self.name


class Registry(Generic[F]):
    """``register(name, ...)`` decorates a factory; ``get(name)`` returns it or names the choices.

    ``load_builtin`` (optional) imports the modules that register the built-in entries, on
    first lookup, so importing the package stays cheap.
    """

    def __init__(self, kind: str, load_builtin: Callable[[], None] | None = None):
        self.kind = kind
        self._load_builtin = load_builtin
        self._loaded = load_builtin is None
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
        """Every entry, in registration order."""
        self._load()
        return list(self._entries.values())

    def having(self, trait: str) -> list[str]:
        """Names of the entries whose ``trait`` is set (e.g. ``"cost"``), registration order."""
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


def importer(*modules: str) -> Callable[[], None]:
    """A registry's ``load_builtin``: import ``modules``, whose decorators register the
    built-in entries (the one way built-ins are loaded)."""

    def load() -> None:
        for module in modules:
            importlib.import_module(module)

    return load


ALGORITHMS: Registry[Callable] = Registry(
    "allreduce algorithm",
    importer(
        *(
            f"longboat.comm.algorithms.{m}"
            for m in ("native", "ring", "shm", "hierarchical", "auto", "topology")
        )
    ),
)
"""Allreduce algorithms ``make(group) -> AllreduceFn``: ``Strategy.allreduce_algorithm``."""

COMPRESSORS: Registry[Callable] = Registry(
    "gradient compressor",
    importer(*(f"longboat.comm.compress.{m}" for m in ("cast", "powersgd", "dgc"))),
)
"""Gradient compressors ``(inner, group, config) -> AllreduceFn``:
``Strategy.gradient_compression`` (or their ``switch`` field) and ``<name>_configs``."""
