"""The Strategy object: flat typed fields, validation on every change, the use-time check of
the combination, sources, env, files (YAML/JSON and Paddle's prototxt)."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from longboat.strategy.changes import (
    ALIASES,
    CODE,
    DEFAULT,
    ENV_FIELDS,
    ENV_SOURCE,
    FILE,
    GROUP_KEYS,
    KEY_ALIASES,
    KNOWN_ENV_VARS,
    NESTED_KEY,
    Change,
    attribute_names,
    check_use,
    collect_changes,
    context,
    env_changes,
    field_spec,
    fields_by_status,
    file_format,
    launcher_file_changes,
    logger,
    read_mapping,
    shown,
    unknown_field,
    validate,
    warn_no_effect,
)
from longboat.strategy.fields import FIELDS
from longboat.strategy.render import Row, text_table
from longboat.strategy.spec import Status
from longboat.strategy.values import (
    Config,
    StrategyError,
    UnknownAttributeError,
    unknown_name_error,
)
from longboat.strategy.views import ConfigView, GroupView, outward

if TYPE_CHECKING:  # the declared fields, typed (generated from the field table)
    from longboat.strategy.typed_fields import DeclaredFields  # pyright: ignore[reportMissingModuleSource]
else:
    DeclaredFields = object

__all__ = [
    "ENV_FIELDS",
    "KNOWN_ENV_VARS",
    "ConfigView",
    "DistributedStrategy",
    "GroupView",
    "Strategy",
    "field_spec",
    "fields_by_status",
]


class _Values(dict):  # type: ignore[type-arg]
    """Field values; a field registered after this Strategy was made reads as its default."""

    def __missing__(self, name: str) -> Any:
        value = self[name] = copy.deepcopy(FIELDS[name].default)
        return value


class Strategy(DeclaredFields):
    """Distributed-training settings, flat and typed, in the style of Fleet's DistributedStrategy.

    Every field of ``longboat.strategy.FIELDS`` is an attribute; ``*_configs`` fields are
    validating dict views; ``build_strategy`` / ``execution_strategy`` group views.
    Values come from defaults, then keyword arguments, then ``LONGBOAT_<FIELD>`` variables of
    ``env`` (default ``os.environ``), which stay in force over later assignments.
    Type checkers and editors read each declared field's type from ``typed_fields.pyi``.
    """

    _values: dict[str, Any]
    _sources: dict[str, str]
    _env_locks: dict[str, str]
    _warned: set[str]

    if not TYPE_CHECKING:  # type checkers read DeclaredFields.__init__: a keyword per field

        def __init__(self, *, env: Mapping[str, str] | None = None, **fields: Any) -> None:
            """Defaults, then the launcher's ``--config`` file (LONGBOAT_CONFIG), then
            ``fields``, then ``LONGBOAT_<FIELD>`` variables."""
            self._init(os.environ if env is None else env, fields)

    def _init(self, env: Mapping[str, str], fields: Mapping[str, Any]) -> None:
        self._reset()
        self._apply(launcher_file_changes(env) + collect_changes(fields, CODE) + env_changes(env))

    def _reset(self) -> None:
        self._values = _Values({n: copy.deepcopy(s.default) for n, s in FIELDS.items()})
        self._sources = {}  # path ("field" or "field.key") -> source, when not "default"
        self._env_locks = {}  # path -> env variable that set it
        self._warned = set()

    @classmethod
    def _create(
        cls, data: Mapping[str, Any], source: str, where: str, env: Mapping[str, str] | None
    ) -> Strategy:
        strategy = cls.__new__(cls)
        strategy._reset()
        changes = collect_changes(data, source, where)
        strategy._apply(changes + env_changes(os.environ if env is None else env))
        return strategy

    # -- the single write path ---------------------------------------------------------------

    def _apply(self, changes: Iterable[Change]) -> None:
        """Validate ``changes``, then commit all of them or none. Combinations of fields are
        checked when the strategy is used (``check``), so fields can be set in any order."""
        values = copy.deepcopy(self._values)
        sources, locks = dict(self._sources), dict(self._env_locks)
        overridden: list[tuple[Change, Any, str]] = []
        changed: list[str] = []
        for change in changes:
            with context(change.where):
                value = validate(change)
            path = change.path
            if change.source.startswith(ENV_SOURCE):
                locks[path] = change.source[len(ENV_SOURCE) :]
            elif path in locks:
                overridden.append((change, value, locks[path]))
                continue
            if change.key is None:
                values[change.field] = value
            else:
                current = values[change.field][change.key]
                if isinstance(current, dict) and isinstance(value, dict):
                    value = {**current, **value}  # a nested config: merged, as Paddle does
                values[change.field][change.key] = value
            sources[path] = change.source
            changed.append(change.field)
        self._values, self._sources, self._env_locks = values, sources, locks
        warn_no_effect(changed, values)
        for change, value, var in overridden:
            self._warn_overridden(change, value, var)

    def _warn_overridden(self, change: Change, value: Any, var: str) -> None:
        current = self._values[change.field]
        current = current if change.key is None else current[change.key]
        if value == current or change.path in self._warned:
            return
        self._warned.add(change.path)
        logger.warning(
            "Strategy.%s=%r is ignored: environment variable %s wins and keeps it at %r",
            change.path,
            value,
            var,
            current,
        )

    # -- attribute access ---------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") and name not in ALIASES:
            raise AttributeError(name)
        if name in GROUP_KEYS:
            return GroupView(self, GROUP_KEYS[name])
        if name in KEY_ALIASES:
            field, *keys = KEY_ALIASES[name]
            value: Any = ConfigView(self, field)
            for key in keys:
                value = value[key]
            return value
        name = ALIASES.get(name, name)
        spec = field_spec(name)
        if spec.is_config:
            return ConfigView(self, name)
        return outward(self._values[name])

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PRIVATE or (name.startswith("__") and name.endswith("__")):
            object.__setattr__(self, name, value)
            return
        known = name in GROUP_KEYS or name in KEY_ALIASES or ALIASES.get(name, name) in FIELDS
        if not known:
            error = unknown_field(name)
            raise UnknownAttributeError(
                f"{name!r} is not an attribute of DistributedStrategy: {error}"
            )
        self._apply(collect_changes({name: value}, CODE))

    def __delattr__(self, name: str) -> None:
        raise StrategyError(f"cannot delete Strategy.{name}; assign its default instead")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *attribute_names()})

    def update(self, data: Mapping[str, Any] | None = None, /, **fields: Any) -> None:
        """Set several fields at once (flat or nested keys); all or nothing."""
        self._apply(collect_changes({**(data or {}), **fields}, CODE))

    # -- inspection ---------------------------------------------------------------------------

    def source(self, name: str) -> str:
        """Where ``name`` ("field" or "config_field.key") got its value: "default", "code",
        "file" or "env:LONGBOAT_X" (a config field joins its keys' sources)."""
        field, _, key = name.partition(".")
        spec = field_spec(field)
        if key:
            keys = spec.type.names() if isinstance(spec.type, Config) else []
            if key not in keys:
                raise unknown_name_error(f"Strategy.{field} key", key, keys)
            return self._sources.get(name, DEFAULT)
        if isinstance(spec.type, Config):
            paths = [f"{field}.{k}" for k in spec.type.names()]
            found = dict.fromkeys(self._sources[p] for p in paths if p in self._sources)
            return ", ".join(found) or DEFAULT
        return self._sources.get(field, DEFAULT)

    def non_default(self) -> dict[str, Any]:
        """``{"field" or "config_field.key": value}`` for every value that differs from its default."""
        out: dict[str, Any] = {}
        for name, spec in FIELDS.items():
            value = self._values[name]
            if isinstance(spec.type, Config):
                for key in spec.type.names():
                    if value[key] != spec.default[key]:
                        out[f"{name}.{key}"] = spec.type.key(key).type.plain(value[key])  # type: ignore[union-attr]
            elif value != spec.default:
                out[name] = value
        return out

    def _default_of(self, path: str) -> Any:
        field, _, key = path.partition(".")
        default = FIELDS[field].default
        return default[key] if key else default

    def rows(self) -> list[Row]:
        """``(field, value, default, source)`` for every non-default value."""
        return [(p, v, self._default_of(p), self.source(p)) for p, v in self.non_default().items()]

    def unimplemented(self) -> list[tuple[str, Status]]:
        """Fields set to a value whose status is "planned", with that status, in table order."""
        found = []
        for name, spec in FIELDS.items():
            value = self._values[name]
            if value != spec.default and spec.status_for(value).kind == "planned":
                found.append((name, spec.status_for(value)))
        return found

    def check(self) -> None:
        """The check of a strategy about to be used (``lb.distribute`` and the fleet calls run
        it): StrategyError for conflicting fields or values outside data parallelism,
        NotImplementedError for a not-yet-implemented value; logs once if ``elastic`` is set
        in a job that was not started elastic."""
        check_use(self._values)
        self._check_planned()
        if self._values["elastic"] and "elastic" not in self._warned:
            from longboat.cluster.env import variable

            if variable("LONGBOAT_ELASTIC_DIR") is None:  # not `longboat launch --nnodes MIN:MAX`
                self._warned.add("elastic")
                logger.warning(
                    "Strategy.elastic=True does not make a job elastic: start it with "
                    "`longboat launch --nnodes MIN:MAX` (see docs/elastic.md)"
                )

    def check_implemented(self) -> None:
        """The same as ``check`` (its older name)."""
        self.check()

    def _check_planned(self) -> None:
        """Raise NotImplementedError naming the first field set to a not-yet-implemented value."""
        missing = self.unimplemented()
        if not missing:
            return
        name, status = missing[0]
        others = f" (also set: {', '.join(n for n, _ in missing[1:])})" if missing[1:] else ""
        raise NotImplementedError(
            f"Strategy.{name}={shown(name, self._values)} needs {status.feature}, which "
            f"longboat does not implement yet (planned: {status.area}){others}"
        )

    def describe(self) -> str:
        """The non-default fields as a text table (field, value, default, source)."""
        return text_table(self.rows())

    __str__ = describe

    def __repr__(self) -> str:
        changed = [
            f"{n}={shown(n, self._values)}"
            for n, s in FIELDS.items()
            if self._values[n] != s.default
        ]
        return f"{type(self).__name__}({', '.join(changed)})"

    # -- comparison and copies ------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Strategy):
            return NotImplemented
        return self._values == other._values

    __hash__ = None  # type: ignore[assignment]

    def copy(self) -> Strategy:
        """An independent copy, with the same values, sources and environment overrides."""
        new = type(self).__new__(type(self))
        new._values = copy.deepcopy(self._values)
        new._sources = dict(self._sources)
        new._env_locks = dict(self._env_locks)
        new._warned = set(self._warned)
        return new

    def __copy__(self) -> Strategy:
        return self.copy()

    def shared_settings(self) -> dict[str, tuple[Any, str]]:
        """Every setting all ranks of a job must agree on (each field but those declared
        ``per_rank``; a config field key by key): ``{"field" or "field.key": (value,
        source)}`` with plain values."""
        values = self.to_dict()
        shared: dict[str, tuple[Any, str]] = {}
        for name, spec in FIELDS.items():
            if spec.per_rank:
                continue
            if spec.is_config:
                for key in values[name]:
                    path = f"{name}.{key}"
                    shared[path] = (values[name][key], self.source(path))
            else:
                shared[name] = (values[name], self.source(name))
        return shared

    def __deepcopy__(self, memo: dict[int, Any]) -> Strategy:
        return self.copy()

    # -- dicts and files ------------------------------------------------------------------------

    def to_dict(self, nested: bool = False) -> dict[str, Any]:
        """Every field as plain Python values; ``nested`` puts group fields under
        ``build_strategy`` / ``execution_strategy`` like Fleet."""
        out: dict[str, Any] = {}
        for name, spec in FIELDS.items():
            value = spec.type.plain(self._values[name])
            if nested and spec.group in NESTED_KEY:
                out.setdefault(NESTED_KEY[spec.group], {})[name] = value
            else:
                out[name] = value
        return out

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        *,
        env: Mapping[str, str] | None = None,
        source: str = CODE,
    ) -> Strategy:
        """A Strategy from flat and/or nested keys; ``env`` overrides apply on top."""
        if not isinstance(data, Mapping):
            raise StrategyError(f"expected a mapping of Strategy fields, got {type(data).__name__}")
        return cls._create(data, source, "", env)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write every field to ``.yaml``/``.yml``/``.json`` (nested groups, Fleet layout)."""
        path = Path(path)
        data = self.to_dict(nested=True)
        if file_format(path) == "yaml":
            text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
        else:
            text = json.dumps(data, indent=2) + "\n"
        path.write_text(text, encoding="utf-8")

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None
    ) -> Strategy:
        """Read a file written by ``save`` or by hand (any subset of fields, flat or nested)."""
        return cls._create(read_mapping(Path(path)), FILE, str(path), env)

    def save_to_prototxt(self, output: str | os.PathLike[str]) -> None:
        """Write the non-default fields as Paddle's DistributedStrategy prototxt."""
        from longboat.strategy.prototxt import dumps

        Path(output).write_text(dumps(self.to_dict()), encoding="utf-8")

    def load_from_prototxt(self, pb_file: str | os.PathLike[str]) -> None:
        """Set the fields a prototxt file (Paddle's text format) lists; all or nothing."""
        from longboat.strategy.prototxt import loads

        where = str(pb_file)
        text = Path(pb_file).read_text(encoding="utf-8")
        self._apply(collect_changes(loads(text, where), FILE, where))


DistributedStrategy = Strategy

_PRIVATE = frozenset(
    name
    for klass in Strategy.__mro__
    for name in vars(klass).get("__annotations__", {})
    if name.startswith("_")
)
"""The private attributes a Strategy keeps its state in: the only ``_`` names it accepts."""

_clash = {s.name for s in FIELDS.static} & set(dir(Strategy))
assert not _clash, f"Strategy fields shadowed by methods: {_clash}"
