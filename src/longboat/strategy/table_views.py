"""What ``Strategy.sparse_table_configs`` returns: the tables by name, and by position as Paddle
reads its ``downpour_table_param`` list, each table's settings as attributes.

    s.fleet_desc_configs = {"emb": {"sparse_optimizer": "adam"}}
    s.sparse_table_configs["emb"]["accessor.embedx_sgd_param.adam.beta1_decay_rate"]   # 0.9
    s.sparse_table_configs[0].accessor.embedx_sgd_param.adam.beta1_decay_rate          # the same
    s.sparse_table_configs[0].table_name                                               # "emb"

A setting the table does not hold raises ``AttributeError`` saying why: not set (the
``SparseEmbedding``'s own value is used), or a Paddle setting longboat's tables cannot honour.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from longboat.strategy.sparse_tables import PATHS, normalise, refusal
from longboat.strategy.values import Rejected, StrategyError, ValueType


class Tables(dict[Any, Any]):
    """``{table name: {TableParameter path: value}}``; an int index is Paddle's position."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int) and not isinstance(key, bool):
            names = list(self)
            try:
                name = names[key]
            except IndexError:
                raise IndexError(
                    f"sparse_table_configs[{key}]: there are {len(names)} table(s)"
                    f"{' (' + ', '.join(names) + ')' if names else ''}"
                ) from None
            return TableView(name, dict.__getitem__(self, name), "")
        return dict.__getitem__(self, key)


class TableView:
    """Read-only attribute view of one table's settings below ``prefix`` (Paddle's message)."""

    __slots__ = ("_name", "_prefix", "_settings")

    def __init__(self, name: str, settings: Mapping[str, Any], prefix: str) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_settings", settings)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if not self._prefix and attr == "table_name":
            return self._name
        path = self._prefix + attr
        if path in self._settings:
            value = self._settings[path]
            return tuple(value) if isinstance(value, list) else value
        below = path + "."
        if any(p.startswith(below) for p in (*self._settings, *PATHS)):
            return TableView(self._name, self._settings, below)
        where = f"sparse_table_configs[{self._name!r}]"
        if path in PATHS:
            raise AttributeError(
                f"{where} does not set {path}: the table uses its SparseEmbedding's own value"
            )
        why = refusal(path) or "it is not a setting longboat's tables have"
        raise AttributeError(f"{where} has no {path}: {why}")

    def __setattr__(self, attr: str, value: Any) -> NoReturn:
        raise StrategyError(
            f"sparse_table_configs[{self._name!r}] is read-only; assign the tables again, "
            f"e.g. strategy.sparse_table_configs = {{{self._name!r}: {{{self._prefix + attr!r}: "
            "...}}"
        )

    def __repr__(self) -> str:
        shown = {p: v for p, v in self._settings.items() if p.startswith(self._prefix)}
        return f"TableView({self._name!r}, {shown!r})"


__all__ = ["TableView", "Tables"]


@dataclass(frozen=True)
class TableConfigs(ValueType):
    """``{table name: {setting: value}}``, settings normalised to ``TableParameter`` paths."""

    short: str = "dict[str, dict[str, value]] (table name -> settings)"
    hint: str = "Tables"
    input_hint: str = "Mapping[str, Mapping[str, Any]]"

    def check(self, value: Any) -> dict[str, dict[str, Any]]:
        if not isinstance(value, Mapping):
            raise Rejected()
        out = Tables()
        for table, settings in value.items():
            if not isinstance(table, str) or not table or not isinstance(settings, Mapping):
                raise Rejected(f"table {table!r} needs a name and a dict of settings")
            out[table] = normalise(table, settings)
        return out

    def plain(self, value: Any) -> dict[str, dict[str, Any]]:
        return {t: dict(s) for t, s in value.items()}
