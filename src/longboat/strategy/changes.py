"""What a keyword argument, assignment, file or environment variable asks the Strategy to
change, the validation of each change, and the use-time check of the combination."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from longboat.strategy.configs import HYBRID_DEGREES, MP_CONFIGS
from longboat.strategy.conflicts import CONFLICTS
from longboat.strategy.fields import FIELDS
from longboat.strategy.sparse_tables import PS_FIELDS_REFUSED, fleet_desc
from longboat.strategy.spec import ENV_PREFIX, STATUS_KINDS, FieldSpec, Group, StatusKind
from longboat.strategy.values import (
    Config,
    Rejected,
    StrategyError,
    StrategyTypeError,
    UnknownFieldError,
    ValueType,
    WrongType,
    closest,
    unknown_name_error,
)

logger = logging.getLogger("longboat.strategy")

KNOWN_ENV_VARS: set[str] = {
    "LONGBOAT_ALL_ENDPOINTS",
    "LONGBOAT_BACKEND",
    "LONGBOAT_CONFIG",
    "LONGBOAT_DEVICES",
    "LONGBOAT_ELASTIC_COPY_DIR",
    "LONGBOAT_ELASTIC_DIR",
    "LONGBOAT_EMULATE_BANDWIDTH",
    "LONGBOAT_EMULATE_LATENCY",
    "LONGBOAT_ENDPOINT_PORTS",
    "LONGBOAT_HOST_IP",
    "LONGBOAT_LAUNCH_TIMEOUT",
    "LONGBOAT_LOCAL_RANK",
    "LONGBOAT_LOCAL_SERVERS",
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
    "LONGBOAT_PS_RESTART_WAIT",
    "LONGBOAT_PS_TIMEOUT",
    "LONGBOAT_PS_TOKEN",
    "LONGBOAT_PS_TRAINER_TIMEOUT",
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
ALIASES: dict[str, str] = {
    "fp16_compress": "fp16_allreduce",
    "fleet_desc_configs": "sparse_table_configs",
    "_fuse_grad_size_in_TFLOPS": "fuse_grad_size_in_TFLOPS",
}
"""Other Paddle names of fields: reading or setting one reads or sets the field (Paddle's
``fleet_desc_configs`` setter fills the same tables that ``sparse_table_configs`` reads)."""
ALIAS_VALUES: dict[str, Callable[[Any], Any]] = {"fleet_desc_configs": fleet_desc}
"""How an alias's setter changes the value (Paddle's ``fleet_desc_configs`` fills defaults)."""
KEY_ALIASES: dict[str, tuple[str, ...]] = {
    "hybrid_parallel_order": ("hybrid_configs", "order"),
    "sync_param_name": ("hybrid_configs", "mp_configs", "sync_param_name"),
}
"""Paddle attributes that are a key (or a sub-config's key) of a config field here:
``strategy.hybrid_parallel_order`` is ``strategy.hybrid_configs['order']`` and
``strategy.sync_param_name`` is ``strategy.hybrid_configs['mp_configs']['sync_param_name']``,
as Paddle's ``hybrid_configs`` setter keeps them."""
NESTED_KEY: dict[Group, str] = {
    "BuildStrategy": "build_strategy",
    "ExecutionStrategy": "execution_strategy",
}


class _EnvFields(Mapping[str, str]):
    """``{LONGBOAT_<FIELD>: field}`` for every current field."""

    def _current(self) -> dict[str, str]:
        return {spec.env_var: name for name, spec in FIELDS.items()}

    def __getitem__(self, var: str) -> str:
        return self._current()[var]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())


ENV_FIELDS: Mapping[str, str] = _EnvFields()


def attribute_names() -> list[str]:
    """Every field name and group key: what ``Strategy`` attributes may be called."""
    return [*FIELDS, *ALIASES, *KEY_ALIASES, *GROUP_KEYS]


def fields_by_status(kind: StatusKind) -> tuple[str, ...]:
    """Field names with status ``kind`` (for the base value or for any particular value)."""
    if kind not in STATUS_KINDS:
        raise StrategyError(f"unknown status {kind!r}; choose one of {', '.join(STATUS_KINDS)}")
    return tuple(n for n, s in FIELDS.items() if any(st.kind == kind for st in s.statuses()))


def field_spec(name: str) -> FieldSpec:
    """The spec of field ``name``; StrategyError with a suggestion if there is none."""
    spec = FIELDS.get(name)
    if spec is None:
        raise unknown_field(name)
    return spec


def unknown_field(name: str) -> UnknownFieldError:
    """The error for a name that is no field: why, for Paddle's fields longboat cannot have."""
    if name in PS_FIELDS_REFUSED:
        return UnknownFieldError(f"Paddle's field {name!r} has no counterpart in longboat: "
                                 f"{PS_FIELDS_REFUSED[name]}")  # fmt: skip
    return unknown_name_error("Strategy field", str(name), attribute_names())


@dataclass(frozen=True)
class Change:
    field: str
    key: str | None  # config key; None for a whole scalar field
    value: Any  # as given, not yet validated
    source: str
    where: str  # error context ("" for code)

    @property
    def path(self) -> str:
        return self.field if self.key is None else f"{self.field}.{self.key}"


@contextmanager
def context(where: str) -> Iterator[None]:
    """Prefix StrategyErrors raised inside with ``where`` (a file or an env variable)."""
    try:
        yield
    except StrategyError as error:
        if not where:
            raise
        raise type(error)(f"{where}: {error}") from None


def field_changes(name: str, value: Any, source: str, where: str) -> list[Change]:
    spec = field_spec(name)
    if not isinstance(spec.type, Config):
        return [Change(name, None, value, source, where)]
    if not isinstance(value, Mapping):
        raise StrategyTypeError(
            f"Strategy.{name} must be {spec.type.describe()}, got {value!r} "
            f"({type(value).__name__})"
        )
    return [Change(name, str(k), v, source, where) for k, v in value.items()]


def check_group_member(group: Group, name: str) -> None:
    spec = FIELDS.get(name)
    if spec is None:
        raise unknown_name_error(f"{group} field", str(name), FIELDS)
    if spec.group != group:
        if spec.group in NESTED_KEY:
            how = f"strategy.{NESTED_KEY[spec.group]} = {{{name!r}: ...}}"
        else:
            how = f"strategy.{name} = ..."
        raise StrategyError(f"{name!r} belongs to {spec.group}, not to {group}; set it with {how}")


def flatten(data: Mapping[str, Any]) -> dict[str, Any]:
    """Flat ``{field: value}`` from flat and/or nested (build_strategy, ...) keys."""
    flat: dict[str, Any] = {}
    keyed: list[tuple[str, Any]] = []  # KEY_ALIASES, merged into their field at the end

    def put(name: str, value: Any, via: str) -> None:
        if name in flat:
            raise StrategyError(f"Strategy field {name!r} is given twice ({via})")
        flat[name] = value

    for name, value in data.items():
        if name in KEY_ALIASES:
            keyed.append((name, value))
            continue
        group = GROUP_KEYS.get(name)
        if group is None:
            value = ALIAS_VALUES[name](value) if name in ALIAS_VALUES else value
            name = ALIASES.get(name, name)
            field_spec(name)
            put(name, value, "flat")
            continue
        from_object = not isinstance(value, Mapping)  # Paddle's BuildStrategy() style
        for sub, sub_value in _group_items(name, group, value).items():
            if from_object and _ignored_as_paddle_does(name, group, sub):
                continue
            check_group_member(group, sub)
            put(sub, sub_value, f"flat and under {name}")
    for alias, value in keyed:
        field, key, *inner = KEY_ALIASES[alias]
        current = flat.setdefault(field, {})
        if not isinstance(current, Mapping):
            continue  # refused by field_changes, naming the field
        given = current.get(key, {}) if inner else None
        if key in current and not (inner and isinstance(given, Mapping) and inner[0] not in given):
            where = "".join(f"[{k!r}]" for k in (key, *inner))
            raise StrategyError(
                f"Strategy.{field}{where} is given twice (as that key and as {alias})"
            )
        if inner:  # a sub-config's key: merged over its current keys, as the sub-config is
            value = {**(given or {}), inner[0]: value}
        flat[field] = {**current, key: value}
    return flat


def _group_items(name: str, group: Group, value: Any) -> Mapping[str, Any]:
    """``build_strategy`` / ``execution_strategy`` as ``{field: value}``: a mapping, or an
    object holding the fields as attributes (Paddle's ``BuildStrategy()`` style)."""
    if isinstance(value, Mapping):
        return value
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict) and not isinstance(value, type):
        return {k: v for k, v in attributes.items() if not k.startswith("_")}
    raise StrategyError(
        f"{name} must be a mapping (or an object) of {group} fields, got {value!r} "
        f"({type(value).__name__})"
    )


_warned_ignored: set[str] = set()

# Attributes of Paddle's BuildStrategy / ExecutionStrategy objects that are not fields of the
# group in Paddle's DistributedStrategy (nor DistributedStrategy fields): Paddle's setter copies
# only the group's own fields, so it never reads these.
PADDLE_OBJECT_ONLY: dict[Group, frozenset[str]] = {
    "BuildStrategy": frozenset(
        {
            "trainers_endpoints",
            "num_trainers",
            "trainer_id",
            "bkcl_comm_num",
            "hierarchical_allreduce_exter_nranks",
            "remove_unnecessary_lock",
            "gradient_scale_strategy",
            "is_distribution",
            "async_mode",
            "mkldnn_enabled_op_types",
            "fix_op_run_order",
            "build_cinn_pass",
            "fuse_adamw",
        }
    ),
    "ExecutionStrategy": frozenset({"use_device", "allow_op_delay", "dry_run"}),
}


def _ignored_as_paddle_does(name: str, group: Group, sub: str) -> bool:
    """A DistributedStrategy field carried by a BuildStrategy/ExecutionStrategy object (Paddle's
    own BuildStrategy has ``nccl_comm_num``, ``sync_batch_norm``, ...), or an attribute only
    Paddle's object has (``trainers_endpoints``, ...): Paddle copies only the group's own fields
    on assignment and ignores the rest; so does longboat, warning once which field takes effect.
    A mapping naming such a field is refused instead (longboat's form)."""
    if sub in PADDLE_OBJECT_ONLY.get(group, frozenset()) and sub not in FIELDS:
        if sub not in _warned_ignored:
            _warned_ignored.add(sub)
            logger.warning(
                "%s.%s is ignored, as Paddle ignores it there: Paddle's %s object has it, but "
                "its DistributedStrategy does not copy it; remove it from the object",
                name,
                sub,
                group,
            )
        return True
    spec = FIELDS.get(ALIASES.get(sub, sub))
    if spec is None or spec.group == group or spec.group != "DistributedStrategy":
        return False
    if sub not in _warned_ignored:
        _warned_ignored.add(sub)
        logger.warning(
            "%s.%s is ignored, as Paddle ignores it there: it is a DistributedStrategy field; "
            "set strategy.%s instead",
            name,
            sub,
            spec.name,
        )
    return True


def collect_changes(data: Mapping[str, Any], source: str, where: str = "") -> list[Change]:
    with context(where):
        flat = flatten(data)
        return [c for n, v in flat.items() for c in field_changes(n, v, source, where)]


def parse_env(spec: FieldSpec, text: str) -> Any:
    try:
        return spec.type.parse(text)
    except (ValueError, yaml.YAMLError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise StrategyError(
            f"cannot read {text!r} as {spec.type.describe()} for Strategy.{spec.name} "
            f"({first_line})"
        ) from None


def env_changes(env: Mapping[str, str]) -> list[Change]:
    """Changes asked for by ``LONGBOAT_<FIELD>`` variables; warns about unknown ones."""
    changes: list[Change] = []
    for name, spec in FIELDS.items():
        var = spec.env_var
        if var not in env:
            continue
        where = f"environment variable {var}={env[var]!r}"
        with context(where):
            value = parse_env(spec, env[var])
            changes += field_changes(name, value, ENV_SOURCE + var, where)
    warn_unknown_env(env)
    return changes


def warn_unknown_env(env: Mapping[str, str]) -> None:
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


def check(vtype: ValueType, value: Any, label: str) -> Any:
    try:
        return vtype.check(value)
    except Rejected as rejected:
        detail = f"; {rejected.detail}" if rejected.detail else ""
        error = StrategyTypeError if isinstance(rejected, WrongType) else StrategyError
        raise error(
            f"{label} must be {vtype.describe()}, got {value!r} ({type(value).__name__}){detail}"
        ) from None


def validate(change: Change) -> Any:
    """The normalised value of ``change``; StrategyError if it is invalid or refused."""
    spec = FIELDS[change.field]
    if isinstance(spec.type, Config):
        key = spec.type.key(str(change.key))
        if key is None:
            raise unknown_name_error(
                f"Strategy.{spec.name} key", str(change.key), spec.type.names()
            )
        return check(key.type, change.value, f"Strategy.{spec.name}[{key.name!r}]")
    value = check(spec.type, change.value, f"Strategy.{spec.name}")
    refusal = spec.status.refusal
    if refusal and not spec.at_default(value):
        kind = (
            "has no meaning in longboat" if spec.status.kind == "not applicable" else "is refused"
        )
        raise StrategyError(f"Strategy.{spec.name}={value!r} {kind}: {refusal}")
    return value


def shown(name: str, values: Mapping[str, Any]) -> str:
    """``values[name]`` for messages; configs show only their non-default keys."""
    spec = FIELDS[name]
    value = values[name]
    if spec.is_config:
        value = {k: _changed(v, spec.default[k]) for k, v in value.items() if v != spec.default[k]}
    return repr(value)


def _changed(value: Any, default: Any) -> Any:
    """``value``, or for a nested config only its keys that differ from ``default``."""
    if isinstance(value, dict) and isinstance(default, dict):
        return {k: v for k, v in value.items() if v != default.get(k)}
    return value


_warned_no_effect: set[str] = set()


def warn_no_effect(names: Iterable[str], values: Mapping[str, Any]) -> None:
    """Warn once per process about each of ``names`` set to a value that does nothing."""
    for name in names:
        spec = FIELDS[name]
        why = spec.status.no_effect
        if why and not spec.at_default(values[name]) and name not in _warned_no_effect:
            _warned_no_effect.add(name)
            logger.warning(
                "Strategy.%s=%r is accepted but has no effect in PyTorch: %s",
                name,
                values[name],
                why,
            )


def check_use(values: Mapping[str, Any]) -> None:
    """The checks of a strategy about to be used: the conflict rules, then the fields whose
    values are outside data parallelism. StrategyError naming the fields and the fix."""
    check_conflicts(values)
    for name, spec in FIELDS.items():
        reason = spec.status.use_refusal
        value = values[name]
        if name == "hybrid_configs":
            outside = any(value[k] != 1 for k in HYBRID_DEGREES)
            outside = outside or value["mp_configs"] != MP_CONFIGS.defaults()
        else:
            outside = not spec.at_default(value)
        if reason and outside:
            raise StrategyError(
                f"Strategy.{name}={shown(name, values)} is refused, {reason}; "
                f"set Strategy.{name} back to its default"
            )


def check_conflicts(values: Mapping[str, Any]) -> None:
    """StrategyError for the first conflict rule ``values`` break."""
    for rule in CONFLICTS:
        if rule.when(values):
            a, b = rule.first, rule.second
            raise StrategyError(
                f"conflicting settings: Strategy.{a}={shown(a, values)} and "
                f"Strategy.{b}={shown(b, values)} cannot be combined: {rule.reason}"
            )


def file_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return "yaml"
    if suffix == ".json":
        return "json"
    raise StrategyError(f"{path}: unknown strategy file type {suffix!r}; use .yaml, .yml or .json")


def read_mapping(path: Path) -> Mapping[str, Any]:
    """The fields in a YAML or JSON strategy file."""
    kind = file_format(path)
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


def launcher_file_changes(env: Mapping[str, str]) -> list[Change]:
    """The file ``longboat launch --config`` exported as LONGBOAT_CONFIG, if any."""
    path = env.get("LONGBOAT_CONFIG")
    if not path:
        return []
    return collect_changes(read_mapping(Path(path)), FILE, f"LONGBOAT_CONFIG={path}")
