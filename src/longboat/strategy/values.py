"""Value types of Strategy fields: validation, parsing from environment text, display."""

from __future__ import annotations

import difflib
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml


class StrategyError(ValueError):
    """A Strategy field, value, file or combination of values is invalid."""


class UnknownFieldError(StrategyError, AttributeError):
    """An unknown field or config key (also an AttributeError, so ``hasattr`` keeps working)."""


class UnknownAttributeError(UnknownFieldError, TypeError):
    """Assignment to an attribute the Strategy does not have (a TypeError, as in Paddle)."""


class StrategyTypeError(StrategyError, TypeError):
    """A value of the wrong type (also a TypeError, as Paddle's ``fp16_allreduce`` raises)."""


class Rejected(Exception):
    """Raised by ``ValueType.check``; the caller turns it into a StrategyError with context."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail


class WrongType(Rejected):
    """``Rejected`` because of the value's type (the caller raises ``StrategyTypeError``)."""


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``name`` (case-insensitive), or None if nothing is close."""
    by_lower = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[match[0]] if match else None


def unknown_name_error(what: str, name: str, candidates: Iterable[str]) -> UnknownFieldError:
    """``unknown <what> 'name'; did you mean 'x'?`` as an error to raise."""
    best = closest(name, candidates)
    hint = f"; did you mean {best!r}?" if best else "; see docs/strategy.md for the valid names"
    return UnknownFieldError(f"unknown {what} {name!r}{hint}")


def show(value: Any) -> str:
    """A value as users write it in Python."""
    return repr(value)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _range_text(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {_num(lo)}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {_num(hi)}"
    return ""


def _in_range(x: float, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> bool:
    if lo is not None and not (x > lo if lo_open else x >= lo):
        return False
    return hi is None or (x < hi if hi_open else x <= hi)


class ValueType:
    """Base of the scalar and list types; subclasses define ``short``, ``check``, ``parse``."""

    lazy: bool = False  # True: its valid values are known only when first checked

    @property
    def short(self) -> str:
        """The value's type in a few words (a field of some subclasses, computed by others)."""
        return "value"

    @property
    def hint(self) -> str:
        """The Python type a read gives, as the typing stub writes it (``typed_fields.pyi``)."""
        return "Any"

    @property
    def input_hint(self) -> str:
        """The Python type an assignment takes, as the typing stub writes it."""
        return self.hint

    def describe(self) -> str:
        """What a valid value is, for error messages."""
        return self.short

    def check(self, value: Any) -> Any:
        """Return the normalised value or raise ``Rejected``."""
        raise NotImplementedError

    def parse(self, text: str) -> Any:
        """Turn environment-variable text into a (not yet checked) value; raise ValueError."""
        return yaml.safe_load(text)

    def plain(self, value: Any) -> Any:
        """A detached plain-Python copy of a stored value."""
        return value


@dataclass(frozen=True)
class Bool(ValueType):
    """A real ``bool``; ``1`` or ``"yes"`` are rejected from code."""

    short: str = "bool"
    hint: str = "bool"
    TRUE = frozenset({"true", "1", "yes"})
    FALSE = frozenset({"false", "0", "no"})

    def describe(self) -> str:
        return "bool (True or False)"

    def check(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise WrongType()
        return value

    def parse(self, text: str) -> bool:
        word = text.strip().lower()
        if word in self.TRUE:
            return True
        if word in self.FALSE:
            return False
        raise ValueError("expected one of true/false/1/0/yes/no")


@dataclass(frozen=True)
class Int(ValueType):
    """An integer (integral floats such as ``2.0`` are accepted), optionally bounded."""

    lo: int | None = None
    hi: int | None = None

    @property
    def short(self) -> str:
        return "int" + _range_text(self.lo, self.hi, False, False)

    @property
    def hint(self) -> str:
        return "int"

    def check(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise WrongType()
        integral = isinstance(value, float) and value.is_integer()
        if not (isinstance(value, numbers.Integral) or integral):
            raise Rejected()
        number = int(value)
        if not _in_range(number, self.lo, self.hi, False, False):
            raise Rejected("out of range")
        return number

    def parse(self, text: str) -> Any:
        for convert in (int, float):
            try:
                return convert(text.strip())
            except ValueError:
                pass
        raise ValueError("not a number")


@dataclass(frozen=True)
class Float(ValueType):
    """A finite real number (ints accepted and stored as float), optionally bounded."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    @property
    def short(self) -> str:
        return "float" + _range_text(self.lo, self.hi, self.lo_open, self.hi_open)

    @property
    def hint(self) -> str:
        return "float"

    def check(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise WrongType()
        number = float(value)
        if not math.isfinite(number):
            raise Rejected("not finite")
        if not _in_range(number, self.lo, self.hi, self.lo_open, self.hi_open):
            raise Rejected("out of range")
        return number

    def parse(self, text: str) -> float:
        try:
            return float(text.strip())
        except ValueError:
            raise ValueError("not a number") from None


@dataclass(frozen=True)
class Choice(ValueType):
    """One string out of a fixed set."""

    choices: tuple[str, ...] = ()

    @property
    def short(self) -> str:
        return "one of " + ", ".join(repr(c) for c in self.choices)

    @property
    def hint(self) -> str:
        return "Literal[" + ", ".join(f'"{c}"' for c in self.choices) + "]"

    def check(self, value: Any) -> str:
        if not isinstance(value, str):
            raise WrongType()
        if value not in self.choices:
            raise Rejected()
        return value

    def parse(self, text: str) -> str:
        return text.strip()


def _no_options() -> Sequence[str]:
    return ()


@dataclass(frozen=True)
class RegistryChoice(ValueType):
    """One name out of a set read when first needed (a registry's names, which may load its
    built-in entries); a near miss is suggested."""

    options: Callable[[], Sequence[str]] = _no_options
    lazy: bool = True
    hint: str = "str"  # the registered names change at run time

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self.options())

    @property
    def short(self) -> str:
        return "one of " + ", ".join(repr(c) for c in self.choices)

    def check(self, value: Any) -> str:
        choices = self.choices
        if not isinstance(value, str) or value not in choices:
            best = closest(value, choices) if isinstance(value, str) else None
            raise Rejected(f"did you mean {best!r}?" if best else "")
        return value

    def parse(self, text: str) -> str:
        return text.strip()


@dataclass(frozen=True)
class OptionalPath(ValueType):
    """A file path (str or os.PathLike, stored as str), or None for off."""

    short: str = "path or None"
    hint: str = "str | None"
    input_hint: str = "str | os.PathLike[str] | None"

    def check(self, value: Any) -> str | None:
        if value is None:
            return None
        value = os.fspath(value) if isinstance(value, os.PathLike) else value
        if not isinstance(value, str) or not value.strip():
            raise Rejected("expected a non-empty path, or None")
        return value

    def parse(self, text: str) -> str | None:
        return text.strip() or None


@dataclass(frozen=True)
class Str(ValueType):
    """Any string (may be empty)."""

    short: str = "str"
    hint: str = "str"

    def check(self, value: Any) -> str:
        if not isinstance(value, str):
            raise WrongType()
        return value

    def parse(self, text: str) -> str:
        return text


@dataclass(frozen=True)
class StrList(ValueType):
    """A list of strings (tuples accepted; a bare string is rejected)."""

    short: str = "list[str]"
    hint: str = "list[str]"
    input_hint: str = "list[str] | tuple[str, ...]"

    def check(self, value: Any) -> list[str]:
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise WrongType()
        return list(value)

    def plain(self, value: Any) -> list[str]:
        return list(value)


@dataclass(frozen=True)
class IntList(ValueType):
    """A list of integers (tuples accepted; may be empty)."""

    short: str = "list[int]"
    hint: str = "list[int]"
    input_hint: str = "list[int] | tuple[int, ...]"

    def check(self, value: Any) -> list[int]:
        if not isinstance(value, list | tuple) or not all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value
        ):
            raise Rejected()
        return [int(v) for v in value]

    def plain(self, value: Any) -> list[int]:
        return list(value)


@dataclass(frozen=True)
class FloatList(ValueType):
    """A non-empty list of numbers, each checked by ``item``."""

    item: Float = Float()
    hint: str = "list[float]"
    input_hint: str = "list[float] | tuple[float, ...]"

    @property
    def short(self) -> str:
        bounds = _range_text(self.item.lo, self.item.hi, self.item.lo_open, self.item.hi_open)
        return f"non-empty list[float], each{bounds}" if bounds else "non-empty list[float]"

    def check(self, value: Any) -> list[float]:
        if not isinstance(value, list | tuple) or not value:
            raise Rejected()
        out = []
        for i, v in enumerate(value):
            try:
                out.append(self.item.check(v))
            except Rejected:
                raise Rejected(f"element {i} ({v!r}) is invalid") from None
        return out

    def plain(self, value: Any) -> list[float]:
        return list(value)


@dataclass(frozen=True)
class KeySpec:
    """One key of a config dict such as ``amp_configs``."""

    name: str
    type: ValueType
    default: Any
    doc: str


@dataclass(frozen=True)
class Config:
    """A dict of typed keys (Fleet's ``*_configs``); assigning a dict merges it over the current."""

    keys: tuple[KeySpec, ...]
    short: str = "dict"
    input_hint: str = "Mapping[str, Any]"  # read: a view of its own (``typed_fields.pyi``)

    def key(self, name: str) -> KeySpec | None:
        """The spec of key ``name``, or None."""
        return next((k for k in self.keys if k.name == name), None)

    def names(self) -> list[str]:
        """The valid key names, in declaration order."""
        return [k.name for k in self.keys]

    def defaults(self) -> dict[str, Any]:
        """A fresh dict of every key's default."""
        return {k.name: k.type.plain(k.default) for k in self.keys}

    def describe(self) -> str:
        return "a mapping with keys " + ", ".join(self.names())

    def parse(self, text: str) -> Any:
        return yaml.safe_load(text)

    def plain(self, value: Mapping[str, Any]) -> dict[str, Any]:
        return {k.name: k.type.plain(value[k.name]) for k in self.keys}


@dataclass(frozen=True)
class SubConfig(ValueType):
    """A config key that is itself a dict of typed keys (Paddle's ``hybrid_configs
    ['mp_configs']``). ``check`` returns only the keys given, checked: the Strategy merges
    them over the current values, as Paddle does."""

    config: Config = Config(())
    hint: str = "SubConfigView"
    input_hint: str = "Mapping[str, Any]"

    @property
    def short(self) -> str:
        return "dict with keys " + ", ".join(self.config.names())

    def check(self, value: Any) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise WrongType()
        out: dict[str, Any] = {}
        for name, item in value.items():
            key = self.config.key(str(name))
            if key is None:
                best = closest(str(name), self.config.names())
                hint = f"did you mean {best!r}? " if best else ""
                raise Rejected(
                    f"unknown key {name!r}; {hint}valid keys: {', '.join(self.config.names())}"
                )
            try:
                out[key.name] = key.type.check(item)
            except Rejected as rejected:
                detail = f" ({rejected.detail})" if rejected.detail else ""
                raise type(rejected)(
                    f"key {key.name!r} must be {key.type.describe()}, got {item!r}{detail}"
                ) from None
        return out

    def plain(self, value: Mapping[str, Any]) -> dict[str, Any]:
        return self.config.plain(value)
