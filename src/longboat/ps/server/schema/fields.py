"""Typed reads of a request's JSON meta: ``Fields`` refuses unknown fields and values of the wrong
type or range, each refusal a ``RequestError`` naming the field's path."""

from __future__ import annotations

import math
from typing import Any, NoReturn

from longboat.ps.shared.request import RequestError
from longboat.ps.shared.wire import Message

INT64_MAX = (1 << 63) - 1


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bound(value: int) -> str:
    return "2**63 - 1" if value == INT64_MAX else str(value)


def _fail(path: str, must: str, value: Any) -> NoReturn:
    raise RequestError(f"{path!r} must be {must}, got {_show(value)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _twice(names: list[str]) -> str | None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def _finite(value: Any, path: str, skip: str | None = None) -> None:
    """Refuse NaN and infinities anywhere in ``value`` (``skip``: an opaque field)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(f"{path!r} must be a finite number, got {value}")
    if isinstance(value, dict):
        for k, v in value.items():
            if k != skip:
                _finite(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite(v, f"{path}[{i}]")


class Fields:
    """Typed reads of one JSON object; ``where`` is its path in the meta ("": the meta)."""

    def __init__(self, obj: Any, fields: tuple[str, ...], where: str = "", what: str = "") -> None:
        """``what`` names the object in a refusal of an unknown field (default: ``where``)."""
        self.where = where
        if not isinstance(obj, dict):
            _fail(where or "meta", "an object", obj)
        unknown = sorted(set(obj) - set(fields), key=str)
        if unknown:
            raise RequestError(
                f"unknown field {self.path(unknown[0])!r} ({what or repr(where)} carries "
                f"{', '.join(fields) or 'no fields'})"
            )
        self.obj = obj

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, must: str, value: Any) -> NoReturn:
        _fail(self.path(key), must, value)

    def has(self, key: str) -> bool:
        return key in self.obj

    def integer(self, key: str, default: int | None, lo: int = 0, hi: int = INT64_MAX) -> int:
        """An integer in [lo, hi] (``default`` when absent; None: required)."""
        if key not in self.obj:
            if default is None:
                self.fail(key, f"given (an integer in [{lo}, {_bound(hi)}])", None)
            return default
        value = self.obj[key]
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            self.fail(key, f"an integer in [{lo}, {_bound(hi)}]", value)
        return value

    def optional_integer(self, key: str, lo: int = 0, hi: int = INT64_MAX) -> int | None:
        return self.integer(key, 0, lo, hi) if key in self.obj else None

    def number(
        self, key: str, default: float, lo: float = -math.inf, hi: float = math.inf,
        above: bool = False,
    ) -> float:  # fmt: skip
        """A finite number in [lo, hi] (``above``: (lo, hi])."""
        value = self.obj.get(key, default)
        if not _is_number(value) or not lo <= value <= hi or (above and value == lo):
            bounds = [f"{'>' if above else '>='} {lo:g}"] if lo > -math.inf else []
            bounds += [f"<= {hi:g}"] if hi < math.inf else []
            self.fail(key, " and ".join(["a finite number", *bounds]), value)
        return float(value)

    def string(
        self, key: str, default: str | None, choices: tuple[str, ...] = (), name: bool = False
    ) -> str:
        """A string (one of ``choices``; ``name``: non-empty), ``default`` when absent."""
        if key not in self.obj:
            if default is None:
                self.fail(key, "given" + (f" (one of {list(choices)})" if choices else ""), None)
            return default
        value = self.obj[key]
        if choices and value not in choices:
            self.fail(key, f"one of {list(choices)}", value)
        if not isinstance(value, str) or (name and not value):
            self.fail(key, "a non-empty string" if name else "a string", value)
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.obj.get(key, default)
        if not isinstance(value, bool):
            self.fail(key, "true or false", value)
        return value

    def array(self, key: str) -> list[Any]:
        """A list ([] when absent)."""
        value = self.obj.get(key, [])
        if not isinstance(value, list):
            self.fail(key, "a list", value)
        return value

    def strings(self, key: str) -> list[str]:
        values = self.array(key)
        for i, v in enumerate(values):
            if not isinstance(v, str):
                _fail(f"{self.path(key)}[{i}]", "a string", v)
        return values

    def numbers(self, key: str, lo: float = 0.0) -> list[float]:
        values = self.array(key)
        for i, v in enumerate(values):
            if not _is_number(v) or v < lo:
                _fail(f"{self.path(key)}[{i}]", f"a finite number >= {lo:g}", v)
        return [float(v) for v in values]

    def mapping(self, key: str) -> dict[str, Any] | None:
        """An object (None when absent)."""
        if key not in self.obj:
            return None
        value = self.obj[key]
        if not isinstance(value, dict):
            self.fail(key, "an object", value)
        return value


def _no_tensors(msg: Message, what: str) -> None:
    if msg.tensors:
        name = next(iter(msg.tensors))
        raise RequestError(f"tensor {name!r}: {what} carries no tensors")
