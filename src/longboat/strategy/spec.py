"""Declarations behind the Strategy: field specs, field status and conflict rules."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from longboat.strategy.values import Config, Rejected, ValueType

StatusKind = Literal["implemented", "not applicable", "planned"]
STATUS_KINDS: tuple[StatusKind, ...] = ("implemented", "not applicable", "planned")
Group = Literal["DistributedStrategy", "BuildStrategy", "ExecutionStrategy"]
GROUPS: tuple[Group, ...] = ("DistributedStrategy", "BuildStrategy", "ExecutionStrategy")
ENV_PREFIX = "LONGBOAT_"


@dataclass(frozen=True)
class Status:
    """How longboat supports a field; build one with the helpers below."""

    kind: StatusKind
    mapped_to: str = ""  # implemented: the PyTorch mechanism the field drives
    note: str = ""  # implemented: a remark; not applicable: why the field means nothing here
    feature: str = ""  # planned: the missing feature
    area: str = ""  # planned: the longboat area that will provide it
    only_default: str = ""  # implemented: why a non-default value is refused
    # not applicable: "assign" refuses a non-default value when it is set, "use" when the
    # strategy is used (lb.distribute, fleet), "warn" accepts it with a one-time warning
    refused_at: Literal["assign", "use", "warn"] = "assign"

    @property
    def refusal(self) -> str:
        """Why a non-default value is refused when it is set, or "" if it is accepted then."""
        if self.kind == "not applicable":
            return self.note if self.refused_at == "assign" else ""
        return self.only_default

    @property
    def use_refusal(self) -> str:
        """Why a non-default value is refused when the strategy is used, or ""."""
        return self.note if self.kind == "not applicable" and self.refused_at == "use" else ""

    @property
    def no_effect(self) -> str:
        """Why a non-default value is accepted but does nothing (warned once), or ""."""
        return self.note if self.kind == "not applicable" and self.refused_at == "warn" else ""

    def text(self) -> str:
        """One-line status for docs and messages."""
        if self.kind == "planned":
            return f"planned: {self.feature} ({self.area})"
        if self.kind == "not applicable":
            when = {
                "assign": "",
                "use": "refused when used: ",
                "warn": "accepted with a warning, no effect: ",
            }[self.refused_at]
            return f"not applicable: {when}{self.note}"
        parts = [f"mapped to {self.mapped_to}" if self.mapped_to else "implemented"]
        parts += [self.note] if self.note else []
        parts += [f"non-default refused: {self.only_default}"] if self.only_default else []
        return "; ".join(parts)


def implemented(note: str = "", *, only_default: str = "") -> Status:
    """The collective engine uses the field as is."""
    return Status("implemented", note=note, only_default=only_default)


def mapped(to: str, note: str = "") -> Status:
    """Implemented by driving an equivalent PyTorch mechanism ``to``."""
    return Status("implemented", mapped_to=to, note=note)


def not_applicable(reason: str) -> Status:
    """No PyTorch meaning: the default is accepted, anything else refused with ``reason``."""
    return Status("not applicable", note=reason)


def outside_data_parallel(reason: str) -> Status:
    """A Fleet feature that splits the model or optimizer state: refused when used."""
    return Status("not applicable", note=f"outside data parallelism: {reason}", refused_at="use")


def refused_when_used(reason: str) -> Status:
    """No PyTorch meaning, but kept so that scripts and files load: a non-default value is
    refused when the strategy is used, with ``reason``."""
    return Status("not applicable", note=reason, refused_at="use")


def no_effect(reason: str) -> Status:
    """A Paddle graph-pass switch with no PyTorch counterpart: accepted, warned about once."""
    return Status("not applicable", note=reason, refused_at="warn")


def planned(feature: str, area: str) -> Status:
    """Accepted and validated, but ``check_implemented`` refuses a non-default value."""
    return Status("planned", feature=feature, area=area)


@dataclass(frozen=True)
class FieldSpec:
    """One Strategy field; everything else (validation, env, docs, table) derives from it."""

    name: str
    type: ValueType | Config
    default: Any
    doc: str
    status: Status
    group: Group = "DistributedStrategy"
    value_status: tuple[tuple[Any, Status], ...] = ()  # per-value overrides of ``status``
    # True: acts on its own process only and may differ between ranks; every other field
    # shapes what ranks exchange and must agree (checked by lb.distribute)
    per_rank: bool = False
    # other values accepted like the default, never refused nor warned about: Paddle's own
    # defaults where they differ from longboat's (another Paddle version, or the value a
    # Paddle ExecutionStrategy object holds), which Paddle writes into its prototxt files
    paddle_defaults: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.type, Config):
            object.__setattr__(self, "default", self.type.defaults())
            checks = [(f"{self.name}.{k.name}", k.type, k.default) for k in self.type.keys]
        else:
            checks = [(self.name, self.type, self.default)]
        for label, vtype, default in checks:
            if getattr(vtype, "lazy", False):
                continue  # checked on first use, so that importing the table stays cheap
            try:
                vtype.check(default)
            except Rejected:
                raise TypeError(f"bad default for Strategy field {label}: {default!r}") from None

    def at_default(self, value: Any) -> bool:
        """Whether ``value`` is the default or one of Paddle's defaults (``paddle_defaults``)."""
        return value == self.default or any(
            type(value) is type(d) and value == d for d in self.paddle_defaults
        )

    @property
    def env_var(self) -> str:
        """The environment variable that overrides this field."""
        return ENV_PREFIX + self.name.upper()

    @property
    def is_config(self) -> bool:
        return isinstance(self.type, Config)

    def status_for(self, value: Any) -> Status:
        """The status that applies when the field holds ``value``."""
        return next((s for v, s in self.value_status if v == value), self.status)

    def statuses(self) -> list[Status]:
        """The base status and every per-value override."""
        return [self.status, *(s for _, s in self.value_status)]

    def status_text(self) -> str:
        """Status line for docs, including per-value overrides and Paddle's defaults."""
        text = self.status.text()
        if self.value_status:
            extra = "; ".join(f"{v!r}: {s.text()}" for v, s in self.value_status)
            text = f"{self.default!r}: {text}; {extra}"
        if self.paddle_defaults:
            shown = ", ".join(repr(v) for v in self.paddle_defaults)
            text += f" (Paddle's default {shown} is accepted like the default)"
        return text


Values = Mapping[str, Any]


@dataclass(frozen=True)
class Conflict:
    """Two fields that cannot hold these values together, and why."""

    first: str
    second: str
    when: Callable[[Values], bool]
    reason: str
    condition: str = "both True"  # ``when`` in words, for the docs


def both_on(first: str, second: str, reason: str) -> Conflict:
    """A conflict between two bool switches that are both True."""
    return Conflict(first, second, lambda v: v[first] is True and v[second] is True, reason)
