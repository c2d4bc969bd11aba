"""What the Strategy takes from the registries: the valid algorithm, compressor and
parameter-server mode names, and
one ``<name>_configs`` field per gradient compressor that declares a config.

Nothing here loads a registry's built-in entries at import; they load on first use.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType

from longboat.registry import ALGORITHMS, COMPRESSORS, PS_MODES, Entry
from longboat.strategy.spec import FieldSpec, implemented
from longboat.strategy.values import Config

COMPRESSION_FIELD = "gradient_compression"


def algorithm_names() -> list[str]:
    """The registered allreduce algorithms (valid ``allreduce_algorithm`` values)."""
    return ALGORITHMS.names()


def compressor_names() -> list[str]:
    """Compressors selected by name (valid ``gradient_compression`` values); those with a
    ``switch`` are selected by their own bool field instead."""
    return sorted(e.name for e in COMPRESSORS.entries() if e.switch is None)


def ps_mode_names() -> list[str]:
    """``auto`` and the registered parameter-server modes (``a_sync_configs['mode']``)."""
    return ["auto", *PS_MODES.names()]


def config_field(entry: Entry) -> FieldSpec:
    """The ``<name>_configs`` field of a compressor that declares a config."""
    if not isinstance(entry.config, Config):
        raise TypeError(
            f"{entry.name!r} registers config={entry.config!r}: declare its keys as "
            "longboat.strategy.values.Config(KeySpec(...), ...)"
        )
    selector = f"{entry.switch}=True" if entry.switch else f"{COMPRESSION_FIELD}={entry.name!r}"
    return FieldSpec(
        f"{entry.name}_configs",
        entry.config,
        None,
        f"{entry.label} settings (with {selector})",
        implemented(),
    )


def _table(static: tuple[FieldSpec, ...]) -> MappingProxyType[str, FieldSpec]:
    """``static`` with each compressor's config field after its selecting field (several
    after one field: by compressor name)."""
    after: dict[str, list[FieldSpec]] = {}
    for entry in COMPRESSORS.entries():
        if entry.config is not None:
            after.setdefault(entry.switch or COMPRESSION_FIELD, []).append(config_field(entry))
    table: dict[str, FieldSpec] = {}
    for spec in static:
        for field in [spec, *after.pop(spec.name, [])]:
            if field.name in table:
                raise ValueError(f"Strategy field {field.name!r} is declared twice")
            table[field.name] = field
    if after:
        raise ValueError(f"compressor switch field(s) {sorted(after)} are not Strategy fields")
    return MappingProxyType(table)


class FieldTable(Mapping[str, FieldSpec]):
    """Every field, in table order (the order of docs, printing and ``check_implemented``):
    the static table plus the registered compressors' config fields, rebuilt when the
    compressor registry changes (reading it first loads the built-in compressors)."""

    def __init__(self, static: tuple[FieldSpec, ...]) -> None:
        self.static = static
        self._built: tuple[int, MappingProxyType[str, FieldSpec]] = (0, MappingProxyType({}))

    def _current(self) -> MappingProxyType[str, FieldSpec]:
        version = COMPRESSORS.version
        if self._built[0] != version:
            self._built = (version, _table(self.static))
        return self._built[1]

    def __getitem__(self, name: str) -> FieldSpec:
        return self._current()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def __contains__(self, name: object) -> bool:
        return name in self._current()

    @property
    def registered(self) -> tuple[FieldSpec, ...]:
        """The fields the registries add (each compressor's ``<name>_configs``), table order."""
        declared = {spec.name for spec in self.static}
        return tuple(s for s in self._current().values() if s.name not in declared)
