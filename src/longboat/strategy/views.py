"""Live, validating views the Strategy returns for ``*_configs`` fields and field groups."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any, NoReturn

from longboat.strategy.changes import (
    CODE,
    NESTED_KEY,
    Change,
    check_group_member,
    collect_changes,
    field_changes,
)
from longboat.strategy.fields import FIELDS
from longboat.strategy.spec import Group
from longboat.strategy.values import (
    Config,
    StrategyError,
    SubConfig,
    UnknownAttributeError,
    unknown_name_error,
)

if TYPE_CHECKING:
    from longboat.strategy.core import Strategy


class ReadOnlyList(list[Any]):
    """A list read from a config; mutate it by assigning a new list to the config key."""

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise StrategyError(
            "lists read from a Strategy config are read-only; assign a new list instead, "
            "e.g. strategy.amp_configs['custom_white_list'] = [...]"
        )

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse


def outward(value: Any) -> Any:
    return ReadOnlyList(value) if isinstance(value, list) else value


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
        spec = self._config.key(key)
        if spec is not None and isinstance(spec.type, SubConfig):
            return SubConfigView(self._strategy, self._field, key, spec.type)
        return outward(self._strategy._values[self._field][key])

    def __setitem__(self, key: str, value: Any) -> None:
        self._strategy._apply([Change(self._field, key, value, CODE, "")])

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
        self._strategy._apply(field_changes(self._field, merged, CODE, ""))

    def __repr__(self) -> str:
        return repr(FIELDS[self._field].type.plain(self._strategy._values[self._field]))


class SubConfigView(MutableMapping[str, Any]):
    """Live, validating view of a config key that is itself a config (``hybrid_configs
    ['mp_configs']``); keys read and write as items or, as on Paddle's message, attributes."""

    __slots__ = ("_field", "_key", "_strategy", "_type")

    def __init__(self, strategy: Strategy, field: str, key: str, vtype: SubConfig) -> None:
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "_field", field)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_type", vtype)

    def _label(self) -> str:
        return f"Strategy.{self._field}[{self._key!r}] key"

    def __getitem__(self, name: str) -> Any:
        if name not in self:
            raise unknown_name_error(self._label(), str(name), self._type.config.names())
        return outward(self._strategy._values[self._field][self._key][name])

    def __setitem__(self, name: str, value: Any) -> None:
        self._strategy._apply([Change(self._field, self._key, {name: value}, CODE, "")])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self:
            error = unknown_name_error(self._label(), name, self._type.config.names())
            raise UnknownAttributeError(f"{name!r} is not an attribute of {self._key}: {error}")
        self[name] = value

    def __delitem__(self, name: str) -> NoReturn:
        raise StrategyError(f"cannot delete {self._label()} {name!r}; assign its default instead")

    def __contains__(self, name: object) -> bool:
        return name in self._type.config.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._type.config.names())

    def __len__(self) -> int:
        return len(self._type.config.keys)

    def __eq__(self, other: object) -> bool:
        return dict(self) == other if isinstance(other, dict | SubConfigView) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._type.plain(self._strategy._values[self._field][self._key]))


class GroupView(MutableMapping[str, Any]):
    """Live, validating view of the BuildStrategy or ExecutionStrategy fields."""

    __slots__ = ("_group", "_strategy")

    def __init__(self, strategy: Strategy, group: Group) -> None:
        self._strategy = strategy
        self._group = group

    def _names(self) -> list[str]:
        return [n for n, s in FIELDS.items() if s.group == self._group]

    def __getitem__(self, name: str) -> Any:
        check_group_member(self._group, name)
        return getattr(self._strategy, name)

    def __setitem__(self, name: str, value: Any) -> None:
        check_group_member(self._group, name)
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
        self._strategy._apply(
            collect_changes({NESTED_KEY[self._group]: dict(other, **kwargs)}, CODE)
        )

    def __repr__(self) -> str:
        return repr({n: FIELDS[n].type.plain(self._strategy._values[n]) for n in self._names()})
