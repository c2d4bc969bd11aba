"""The Strategy object: flat typed fields, validation on every change, sources, env, files."""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml

from longboat.strategy.fields import CONFLICTS, FIELDS
from longboat.strategy.render import Row, text_table
from longboat.strategy.spec import ENV_PREFIX, STATUS_KINDS, FieldSpec, Group, Status, StatusKind
from longboat.strategy.values import (
    Config,
    Rejected,
    StrategyError,
    ValueType,
    closest,
    unknown_name_error,
)

logger = logging.getLogger("longboat.strategy")

KNOWN_ENV_VARS: set[str] = {
    "LONGBOAT_ALL_ENDPOINTS",
    "LONGBOAT_BACKEND",
    "LONGBOAT_CONFIG",
    "LONGBOAT_DEVICES",
    "LONGBOAT_EMULATE_BANDWIDTH",
    "LONGBOAT_EMULATE_LATENCY",
    "LONGBOAT_ENDPOINT_PORTS",
    "LONGBOAT_HOST_IP",
    "LONGBOAT_LAUNCH_TIMEOUT",
    "LONGBOAT_LOCAL_RANK",
    "LONGBOAT_LOCAL_WORLD_SIZE",
    "LONGBOAT_LOG_DIR",
    "LONGBOAT_LOG_FILE",
    "LONGBOAT_LOG_LEVEL",
    "LONGBOAT_MASTER_ADDR",
    "LONGBOAT_MASTER_PORT",
    "LONGBOAT_NNODES",
    "LONGBOAT_NODE_RANK",
    "LONGBOAT_NPROC_PER_NODE",
    "LONGBOAT_NUM_SERVERS",
    "LONGBOAT_PS_CHECKPOINT_DIR",
    "LONGBOAT_PS_CHECKPOINT_EVERY",
    "LONGBOAT_PS_MAX_MESSAGE_MB",
    "LONGBOAT_PS_BODY_TIMEOUT",
    "LONGBOAT_PS_MAX_CALLS",
    "LONGBOAT_PS_MAX_CONNECTIONS",
    "LONGBOAT_PS_MAX_STREAMS",
    "LONGBOAT_PS_TIMEOUT",
    "LONGBOAT_PS_TOKEN",
    "LONGBOAT_PS_TOKEN_FILE",
    "LONGBOAT_RANK",
    "LONGBOAT_ROLE",
    "LONGBOAT_ROLE_RANK",
    "LONGBOAT_RUN_ID",
    "LONGBOAT_SHM_DIR",
    "LONGBOAT_TIMEOUT",
    "LONGBOAT_WORLD_SIZE",
}
"""``LONGBOAT_*`` variables that are not Strategy fields; other modules add theirs here."""

DEFAULT, CODE, FILE = "default", "code", "file"
ENV_SOURCE = "env:"

GROUP_KEYS: dict[str, Group] = {
    "build_strategy": "BuildStrategy",
    "BuildStrategy": "BuildStrategy",
    "execution_strategy": "ExecutionStrategy",
    "ExecutionStrategy": "ExecutionStrategy",
}
"""Nested keys (Fleet's spellings and the group names) that address a group of fields."""
NESTED_KEY: dict[Group, str] = {
    "BuildStrategy": "build_strategy",
    "ExecutionStrategy": "execution_strategy",
}
ENV_FIELDS: dict[str, str] = {spec.env_var: name for name, spec in FIELDS.items()}
_ATTRIBUTE_NAMES = [*FIELDS, *GROUP_KEYS]


def fields_by_status(kind: StatusKind) -> tuple[str, ...]:
    """Field names with status ``kind`` (for the base value or for any particular value)."""
    if kind not in STATUS_KINDS:
        raise StrategyError(f"unknown status {kind!r}; choose one of {', '.join(STATUS_KINDS)}")
    return tuple(n for n, s in FIELDS.items() if any(st.kind == kind for st in s.statuses()))


def field_spec(name: str) -> FieldSpec:
    """The spec of field ``name``; StrategyError with a suggestion if there is none."""
    spec = FIELDS.get(name)
    if spec is None:
        raise unknown_name_error("Strategy field", str(name), _ATTRIBUTE_NAMES)
    return spec


# ---- changes: what a kwarg, assignment, file or env variable asks for ---------------------


@dataclass(frozen=True)
class _Change:
    field: str
    key: str | None  # config key; None for a whole scalar field
    value: Any  # as given, not yet validated
    source: str
    where: str  # error context ("" for code)

    @property
    def path(self) -> str:
        return self.field if self.key is None else f"{self.field}.{self.key}"


@contextmanager
def _context(where: str) -> Iterator[None]:
    """Prefix StrategyErrors raised inside with ``where`` (a file or an env variable)."""
    try:
        yield
    except StrategyError as error:
        if not where:
            raise
        raise type(error)(f"{where}: {error}") from None


def _field_changes(name: str, value: Any, source: str, where: str) -> list[_Change]:
    spec = field_spec(name)
    if not isinstance(spec.type, Config):
        return [_Change(name, None, value, source, where)]
    if not isinstance(value, Mapping):
        raise StrategyError(
            f"Strategy.{name} must be {spec.type.describe()}, got {value!r} "
            f"({type(value).__name__})"
        )
    return [_Change(name, str(k), v, source, where) for k, v in value.items()]


def _check_group_member(group: Group, name: str) -> None:
    spec = FIELDS.get(name)
    if spec is None:
        raise unknown_name_error(f"{group} field", str(name), FIELDS)
    if spec.group != group:
        if spec.group in NESTED_KEY:
            how = f"strategy.{NESTED_KEY[spec.group]} = {{{name!r}: ...}}"
        else:
            how = f"strategy.{name} = ..."
        raise StrategyError(f"{name!r} belongs to {spec.group}, not to {group}; set it with {how}")


def _flatten(data: Mapping[str, Any]) -> dict[str, Any]:
    """Flat ``{field: value}`` from flat and/or nested (build_strategy, ...) keys."""
    flat: dict[str, Any] = {}

    def put(name: str, value: Any, via: str) -> None:
        if name in flat:
            raise StrategyError(f"Strategy field {name!r} is given twice ({via})")
        flat[name] = value

    for name, value in data.items():
        group = GROUP_KEYS.get(name)
        if group is None:
            field_spec(name)
            put(name, value, "flat")
            continue
        if not isinstance(value, Mapping):
            raise StrategyError(
                f"{name} must be a mapping of {group} fields, got {value!r} ({type(value).__name__})"
            )
        for sub, sub_value in value.items():
            _check_group_member(group, sub)
            put(sub, sub_value, f"flat and under {name}")
    return flat


def _changes(data: Mapping[str, Any], source: str, where: str = "") -> list[_Change]:
    with _context(where):
        flat = _flatten(data)
        return [c for n, v in flat.items() for c in _field_changes(n, v, source, where)]


def _parse_env(spec: FieldSpec, text: str) -> Any:
    try:
        return spec.type.parse(text)
    except (ValueError, yaml.YAMLError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise StrategyError(
            f"cannot read {text!r} as {spec.type.describe()} for Strategy.{spec.name} "
            f"({first_line})"
        ) from None


def _env_changes(env: Mapping[str, str]) -> list[_Change]:
    """Changes asked for by ``LONGBOAT_<FIELD>`` variables; warns about unknown ones."""
    changes: list[_Change] = []
    for name, spec in FIELDS.items():
        var = spec.env_var
        if var not in env:
            continue
        where = f"environment variable {var}={env[var]!r}"
        with _context(where):
            value = _parse_env(spec, env[var])
            changes += _field_changes(name, value, ENV_SOURCE + var, where)
    _warn_unknown_env(env)
    return changes


def _warn_unknown_env(env: Mapping[str, str]) -> None:
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in ENV_FIELDS or var in KNOWN_ENV_VARS:
            continue
        best = closest(var, ENV_FIELDS)
        hint = f"; did you mean {best} (Strategy.{ENV_FIELDS[best]})?" if best else ""
        logger.warning(
            "environment variable %s is neither a Strategy field nor a known longboat "
            "variable, so it is ignored%s",
            var,
            hint,
        )


# ---- validation -----------------------------------------------------------------------------


def _check(vtype: ValueType, value: Any, label: str) -> Any:
    try:
        return vtype.check(value)
    except Rejected as rejected:
        detail = f"; {rejected.detail}" if rejected.detail else ""
        raise StrategyError(
            f"{label} must be {vtype.describe()}, got {value!r} ({type(value).__name__}){detail}"
        ) from None


def _validate(change: _Change) -> Any:
    """The normalised value of ``change``; StrategyError if it is invalid or refused."""
    spec = FIELDS[change.field]
    if isinstance(spec.type, Config):
        key = spec.type.key(str(change.key))
        if key is None:
            raise unknown_name_error(
                f"Strategy.{spec.name} key", str(change.key), spec.type.names()
            )
        return _check(key.type, change.value, f"Strategy.{spec.name}[{key.name!r}]")
    value = _check(spec.type, change.value, f"Strategy.{spec.name}")
    refusal = spec.status.refusal
    if refusal and value != spec.default:
        kind = (
            "has no meaning in longboat" if spec.status.kind == "not applicable" else "is refused"
        )
        raise StrategyError(f"Strategy.{spec.name}={value!r} {kind}: {refusal}")
    return value


def _shown(name: str, values: Mapping[str, Any]) -> str:
    """``values[name]`` for messages; configs show only their non-default keys."""
    spec = FIELDS[name]
    value = values[name]
    if spec.is_config:
        value = {k: v for k, v in value.items() if v != spec.default[k]}
    return repr(value)


def _check_conflicts(values: Mapping[str, Any]) -> None:
    for rule in CONFLICTS:
        if rule.when(values):
            a, b = rule.first, rule.second
            raise StrategyError(
                f"conflicting settings: Strategy.{a}={_shown(a, values)} and "
                f"Strategy.{b}={_shown(b, values)} cannot be combined: {rule.reason}"
            )


# ---- views returned for configs and groups ------------------------------------------------


class _ReadOnlyList(list):  # type: ignore[type-arg]
    """A list read from a config; mutate it by assigning a new list to the config key."""

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise StrategyError(
            "lists read from a Strategy config are read-only; assign a new list instead, "
            "e.g. strategy.amp_configs['custom_white_list'] = [...]"
        )

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse  # type: ignore[assignment]
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse  # type: ignore[assignment]


def _outward(value: Any) -> Any:
    return _ReadOnlyList(value) if isinstance(value, list) else value


class ConfigView(MutableMapping[str, Any]):
    """Live, validating view of one ``*_configs`` field; writes go through the Strategy."""

    __slots__ = ("_field", "_strategy")

    def __init__(self, strategy: Strategy, field: str) -> None:
        self._strategy = strategy
        self._field = field

    @property
    def _config(self) -> Config:
        config = FIELDS[self._field].type
        assert isinstance(config, Config)
        return config

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise unknown_name_error(f"Strategy.{self._field} key", str(key), self._config.names())
        return _outward(self._strategy._values[self._field][key])

    def __setitem__(self, key: str, value: Any) -> None:
        self._strategy._apply([_Change(self._field, key, value, CODE, "")])

    def __delitem__(self, key: str) -> NoReturn:
        spec = self._config.key(key)
        hint = f"assign its default ({spec.default!r}) instead" if spec else "it does not exist"
        raise StrategyError(f"cannot delete Strategy.{self._field}[{key!r}]; {hint}")

    def __contains__(self, key: object) -> bool:
        return key in self._config.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._config.names())

    def __len__(self) -> int:
        return len(self._config.keys)

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """Set several keys at once (all or nothing)."""
        merged = dict(other, **kwargs)
        self._strategy._apply(_field_changes(self._field, merged, CODE, ""))

    def __repr__(self) -> str:
        return repr(FIELDS[self._field].type.plain(self._strategy._values[self._field]))


class GroupView(MutableMapping[str, Any]):
    """Live, validating view of the BuildStrategy or ExecutionStrategy fields."""

    __slots__ = ("_group", "_strategy")

    def __init__(self, strategy: Strategy, group: Group) -> None:
        self._strategy = strategy
        self._group = group

    def _names(self) -> list[str]:
        return [n for n, s in FIELDS.items() if s.group == self._group]

    def __getitem__(self, name: str) -> Any:
        _check_group_member(self._group, name)
        return getattr(self._strategy, name)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_group_member(self._group, name)
        setattr(self._strategy, name, value)

    def __delitem__(self, name: str) -> NoReturn:
        raise StrategyError(f"cannot delete {self._group} field {name!r}; assign its default")

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """Set several fields of the group at once (all or nothing)."""
        self._strategy._apply(_changes({NESTED_KEY[self._group]: dict(other, **kwargs)}, CODE))

    def __repr__(self) -> str:
        return repr({n: FIELDS[n].type.plain(self._strategy._values[n]) for n in self._names()})


# ---- the Strategy ---------------------------------------------------------------------------


def _file_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return "yaml"
    if suffix == ".json":
        return "json"
    raise StrategyError(f"{path}: unknown strategy file type {suffix!r}; use .yaml, .yml or .json")


class Strategy:
    """Distributed-training settings, flat and typed, in the style of Fleet's DistributedStrategy.

    Every field of ``longboat.strategy.FIELDS`` is an attribute; ``*_configs`` fields are
    validating dict views; ``build_strategy`` / ``execution_strategy`` group views.
    Values come from defaults, then keyword arguments, then ``LONGBOAT_<FIELD>`` variables of
    ``env`` (default ``os.environ``), which stay in force over later assignments.
    """

    _values: dict[str, Any]
    _sources: dict[str, str]
    _env_locks: dict[str, str]
    _warned: set[str]

    def __init__(self, *, env: Mapping[str, str] | None = None, **fields: Any) -> None:
        """Defaults, then the launcher's ``--config`` file (LONGBOAT_CONFIG), then ``fields``,
        then ``LONGBOAT_<FIELD>`` variables."""
        env = os.environ if env is None else env
        self._reset()
        self._apply(_launcher_file_changes(env) + _changes(fields, CODE) + _env_changes(env))

    def _reset(self) -> None:
        self._values = {name: copy.deepcopy(spec.default) for name, spec in FIELDS.items()}
        self._sources = {}  # path ("field" or "field.key") -> source, when not "default"
        self._env_locks = {}  # path -> env variable that set it
        self._warned = set()

    @classmethod
    def _create(
        cls, data: Mapping[str, Any], source: str, where: str, env: Mapping[str, str] | None
    ) -> Strategy:
        strategy = cls.__new__(cls)
        strategy._reset()
        changes = _changes(data, source, where)
        strategy._apply(changes + _env_changes(os.environ if env is None else env))
        return strategy

    # -- the single write path ---------------------------------------------------------------

    def _apply(self, changes: Iterable[_Change]) -> None:
        """Validate ``changes`` and conflicts, then commit all of them or none."""
        values = copy.deepcopy(self._values)
        sources, locks = dict(self._sources), dict(self._env_locks)
        overridden: list[tuple[_Change, Any, str]] = []
        for change in changes:
            with _context(change.where):
                value = _validate(change)
            path = change.path
            if change.source.startswith(ENV_SOURCE):
                locks[path] = change.source[len(ENV_SOURCE) :]
            elif path in locks:
                overridden.append((change, value, locks[path]))
                continue
            if change.key is None:
                values[change.field] = value
            else:
                values[change.field][change.key] = value
            sources[path] = change.source
        _check_conflicts(values)
        self._values, self._sources, self._env_locks = values, sources, locks
        for change, value, var in overridden:
            self._warn_overridden(change, value, var)

    def _warn_overridden(self, change: _Change, value: Any, var: str) -> None:
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
        if name.startswith("_"):
            raise AttributeError(name)
        if name in GROUP_KEYS:
            return GroupView(self, GROUP_KEYS[name])
        spec = field_spec(name)
        if spec.is_config:
            return ConfigView(self, name)
        return _outward(self._values[name])

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if name not in GROUP_KEYS:
            field_spec(name)
        self._apply(_changes({name: value}, CODE))

    def __delattr__(self, name: str) -> None:
        raise StrategyError(f"cannot delete Strategy.{name}; assign its default instead")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *_ATTRIBUTE_NAMES})

    def update(self, data: Mapping[str, Any] | None = None, /, **fields: Any) -> None:
        """Set several fields at once (flat or nested keys); all or nothing."""
        self._apply(_changes({**(data or {}), **fields}, CODE))

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

    def check_implemented(self) -> None:
        """Raise NotImplementedError naming the first field set to a not-yet-implemented value."""
        missing = self.unimplemented()
        if not missing:
            return
        name, status = missing[0]
        others = f" (also set: {', '.join(n for n, _ in missing[1:])})" if missing[1:] else ""
        raise NotImplementedError(
            f"Strategy.{name}={_shown(name, self._values)} needs {status.feature}, which "
            f"longboat does not implement yet (planned: {status.area}){others}"
        )

    def describe(self) -> str:
        """The non-default fields as a text table (field, value, default, source)."""
        return text_table(self.rows())

    __str__ = describe

    def __repr__(self) -> str:
        changed = [
            f"{n}={_shown(n, self._values)}"
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
        if _file_format(path) == "yaml":
            text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
        else:
            text = json.dumps(data, indent=2) + "\n"
        path.write_text(text, encoding="utf-8")

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None
    ) -> Strategy:
        """Read a file written by ``save`` or by hand (any subset of fields, flat or nested)."""
        return cls._create(_read_mapping(Path(path)), FILE, str(path), env)


def _read_mapping(path: Path) -> Mapping[str, Any]:
    """The fields in a YAML or JSON strategy file."""
    kind = _file_format(path)
    text = path.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text) if kind == "yaml" else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as error:
        raise StrategyError(f"{path}: not valid {kind}: {error}") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise StrategyError(
            f"{path}: expected a mapping of Strategy fields, got {type(data).__name__}"
        )
    return data


def _launcher_file_changes(env: Mapping[str, str]) -> list[_Change]:
    """The file ``longboat launch --config`` exported as LONGBOAT_CONFIG, if any."""
    path = env.get("LONGBOAT_CONFIG")
    if not path:
        return []
    return _changes(_read_mapping(Path(path)), FILE, f"LONGBOAT_CONFIG={path}")


DistributedStrategy = Strategy

_clash = set(FIELDS) & set(dir(Strategy))
assert not _clash, f"Strategy fields shadowed by methods: {_clash}"
