"""Paddle's prototxt of a DistributedStrategy: protobuf text format, written and read here.

The layout is that of Paddle's ``DistributedStrategy`` message: ``name: value`` lines, a
``*_configs { key: value }`` block per config field, ``build_strategy { }`` and
``execution_strategy { }`` blocks for the two groups, ``mode: COLLECTIVE`` / ``PS`` as an enum,
strings quoted, bools lowercase, a list as one line per element, and the sparse tables as
repeated ``downpour_table_param { table_name: "..." ... }`` blocks. Only the parts of the text
format such files use are read (no ``<...>`` messages, no extensions, no ``Any``).

Paddle writes every field that was ever assigned, defaults included (its ``build_strategy`` and
``execution_strategy`` setters copy a whole Paddle object). Fields longboat does not have are
read when they hold Paddle's default (``PADDLE_ONLY``) and ignored; any other value of them is
refused, naming the field and its line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from longboat.strategy.changes import ALIASES, GROUP_KEYS, NESTED_KEY
from longboat.strategy.fields import FIELDS
from longboat.strategy.values import (
    Config,
    FloatList,
    IntList,
    StrategyError,
    StrList,
    SubConfig,
    closest,
)

TABLES_FIELD, TABLES_BLOCK = "sparse_table_configs", "downpour_table_param"
_MODES = {"COLLECTIVE": "collective", "PS": "ps"}
_LIST_TYPES = (StrList, IntList, FloatList)

PADDLE_ONLY: dict[str, Any] = {
    "without_graph_optimization": False,
    "fuse_grad_size_in_num": 8,
    "calc_comm_same_stream": False,
    "asp": False,
    "fuse_grad_merge": False,
    "semi_auto": False,
    "adam_d2sum": True,
    "auto_search": False,
    "heter_ccl_mode": False,
    "gradient_scale_configs": {"scale_strategy": "avg", "scale_gradient": False},
    "build_strategy": {
        "fix_op_run_order": False,
        "allow_cuda_graph_capture": False,
        "reduce_strategy": 0,  # AllReduce, what longboat does
    },
    # 0: Paddle picks the thread count, i.e. torch's own default: nothing to set
    "execution_strategy": {"num_threads": 0},
}
"""Paddle's ``DistributedStrategy`` fields that longboat does not have (or, in the group
blocks, values it cannot hold), with the default value a prototxt written by Paddle holds
when they were never changed: read and ignored at that value."""

# ---- writing -------------------------------------------------------------------------------


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _lines(name: str, value: Any, indent: str) -> list[str]:
    if isinstance(value, list):
        return [f"{indent}{name}: {_scalar(v)}" for v in value]
    return [f"{indent}{name}: {_scalar(value)}"]


def _block(name: str, items: list[str], indent: str) -> list[str]:
    return [f"{indent}{name} {{", *items, f"{indent}}}"] if items else []


def _table_lines(table: str, settings: Mapping[str, Any], indent: str) -> list[str]:
    """One ``downpour_table_param`` block, its dotted paths as nested blocks."""
    tree: dict[str, Any] = {}
    for path, value in settings.items():
        *parents, leaf = path.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def emit(node: dict[str, Any], pad: str) -> list[str]:
        out: list[str] = []
        for key, value in node.items():
            if isinstance(value, dict):
                out += _block(key, emit(value, pad + "  "), pad)
            else:
                out += _lines(key, value, pad)
        return out

    body = [f"{indent}  table_name: {json.dumps(table)}", *emit(tree, indent + "  ")]
    return _block(TABLES_BLOCK, body, indent)


def _config_lines(value: Mapping[str, Any], default: Mapping[str, Any], indent: str) -> list[str]:
    """The keys of a config that differ from ``default``; nested configs as blocks."""
    out: list[str] = []
    for key, item in value.items():
        if item == default[key]:
            continue
        if isinstance(item, dict):
            out += _block(key, _config_lines(item, default[key], indent + "  "), indent)
        else:
            out += _lines(key, item, indent)
    return out


def dumps(values: Mapping[str, Any]) -> str:
    """``values`` (``Strategy.to_dict()``) as prototxt; only what differs from the defaults."""
    top: list[str] = []
    groups: dict[str, list[str]] = {}
    for name, spec in FIELDS.items():
        value = values[name]
        if spec.is_config:
            top += _block(name, _config_lines(value, spec.default, "  "), "")
        elif value == spec.default:
            continue
        elif name == "mode":
            top.append(f"mode: {value.upper()}")
        elif name == TABLES_FIELD:
            for table, settings in value.items():
                top += _table_lines(table, settings, "")
        elif spec.group in NESTED_KEY:
            groups.setdefault(NESTED_KEY[spec.group], []).extend(_lines(name, value, "  "))
        elif value is not None:
            top += _lines(name, value, "")
    for key, items in groups.items():
        top += _block(key, items, "")
    return "\n".join(top) + ("\n" if top else "")


# ---- reading -------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s+|\#[^\n]*
    |(?P<str>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
    |(?P<num>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|inf|nan)[fF]?)
    |(?P<name>[A-Za-z_][A-Za-z0-9_.]*)
    |(?P<sym>[:{}\[\],;])""",
    re.VERBOSE,
)


@dataclass(frozen=True)
class _Tok:
    kind: str
    text: str
    line: int


@dataclass
class _Entry:
    name: str
    value: Any  # a scalar, a list of scalars, or a list of _Entry (a message)
    line: int


def _tokens(text: str, where: str) -> Iterator[_Tok]:
    pos, line = 0, 1
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise StrategyError(f"{where}:{line}: cannot read {text[pos : pos + 20]!r}")
        kind = match.lastgroup
        if kind is not None:
            yield _Tok(kind, match.group(), line)
        line += match.group().count("\n")
        pos = match.end()


class _Parser:
    def __init__(self, text: str, where: str) -> None:
        self.toks = list(_tokens(text, where))
        self.i = 0
        self.where = where

    def error(self, message: str, tok: _Tok | None = None) -> StrategyError:
        line = (tok or self.peek() or (self.toks[-1] if self.toks else _Tok("", "", 1))).line
        return StrategyError(f"{self.where}:{line}: {message}")

    def peek(self) -> _Tok | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def at(self, *texts: str) -> bool:
        """Whether the next token is one of ``texts`` (False at the end)."""
        tok = self.peek()
        return tok is not None and tok.text in texts

    def take(self, text: str | None = None) -> _Tok:
        tok = self.peek()
        if tok is None or (text is not None and tok.text != text):
            want = repr(text) if text else "more input"
            raise self.error(f"expected {want}, found {tok.text if tok else 'the end'!r}")
        self.i += 1
        return tok

    def message(self, closing: str | None) -> list[_Entry]:
        entries: list[_Entry] = []
        while True:
            tok = self.peek()
            if tok is None or (closing is not None and tok.text == closing):
                if tok is None and closing is not None:
                    raise self.error(f"missing {closing!r}")
                return entries
            name = self.take()
            if name.kind != "name":
                raise self.error(f"expected a field name, found {name.text!r}", name)
            colon = self.at(":")
            if colon:
                self.take(":")
            nxt = self.peek()
            if nxt is not None and nxt.text == "{":
                self.take("{")
                entries.append(_Entry(name.text, self.message("}"), name.line))
                self.take("}")
            elif not colon:
                raise self.error(f"expected ':' or '{{' after {name.text!r}", nxt)
            elif nxt is not None and nxt.text == "[":
                entries.append(_Entry(name.text, self.list(), name.line))
            else:
                entries.append(_Entry(name.text, self.scalar(), name.line))
            if self.at(",", ";"):
                self.take()

    def list(self) -> list[Any]:
        self.take("[")
        items: list[Any] = []
        while self.peek() is not None and not self.at("]"):
            items.append(self.scalar())
            if self.at(","):
                self.take(",")
        self.take("]")
        return items

    def scalar(self) -> Any:
        tok = self.take()
        if tok.kind == "str":
            return _unquote(tok.text)
        if tok.kind == "num":
            text = tok.text.rstrip("fF") if not tok.text.endswith(("inf", "nan")) else tok.text
            if re.fullmatch(r"[-+]?\d+", text):
                return int(text)
            return float(text)
        if tok.kind == "name":
            lowered = {"true": True, "t": True, "false": False, "f": False}
            return lowered.get(tok.text.lower(), _Enum(tok.text))
        raise self.error(f"expected a value, found {tok.text!r}", tok)


class _Enum(str):
    """An enum value name (unquoted identifier)."""


def _unquote(text: str) -> str:
    body = text[1:-1]
    return body.encode("latin-1", "backslashreplace").decode("unicode_escape")


def _merge(entries: list[_Entry], lists: tuple[str, ...] = ()) -> dict[str, tuple[Any, int]]:
    """``{name: (value, line)}``; a repeated name (or one in ``lists``) becomes a list."""
    out: dict[str, tuple[Any, int]] = {}
    for e in entries:
        if isinstance(e.value, list) and e.value and isinstance(e.value[0], _Entry):
            out[e.name] = (e.value, e.line)
            continue
        items = e.value if isinstance(e.value, list) else [e.value]
        if e.name in out:
            out[e.name] = (out[e.name][0] + items, out[e.name][1])
        elif e.name in lists or len(items) != 1:
            out[e.name] = (list(items), e.line)
        else:
            out[e.name] = (items[0], e.line)
    for name, (value, line) in out.items():
        if isinstance(value, list) and name not in lists and not _is_message(value):
            raise StrategyError(f"line {line}: {name!r} is given more than once")
    return out


def _is_message(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], _Entry)


def _plain(value: Any) -> Any:
    if isinstance(value, _Enum):
        return str(value)
    return value


def _config(name: str, entries: list[_Entry]) -> dict[str, Any]:
    config = FIELDS[name].type
    assert isinstance(config, Config)
    return _config_of(config, entries)


def _config_of(config: Config, entries: list[_Entry]) -> dict[str, Any]:
    """A config block's keys; a nested config (``mp_configs { }``) as a dict."""
    lists = tuple(k.name for k in config.keys if isinstance(k.type, _LIST_TYPES))
    out: dict[str, Any] = {}
    for k, (v, _) in _merge(entries, lists).items():
        key = config.key(k)
        if key is not None and isinstance(key.type, SubConfig) and (_is_message(v) or v == []):
            out[k] = _config_of(key.type.config, v)
        else:
            out[k] = _plain(v)
    return out


def _paddle_default(name: str, value: Any, defaults: Mapping[str, Any]) -> bool:
    """Whether ``name: value`` is a Paddle-only field at Paddle's default (``PADDLE_ONLY``)."""
    if name not in defaults:
        return False
    default = defaults[name]
    if isinstance(default, dict):
        if not _is_message(value):
            return False
        given = {k: _plain(v) for k, (v, _) in _merge(value).items()}
        return all(k in default and v == default[k] for k, v in given.items())
    return type(_plain(value)) is type(default) and _plain(value) == default


def _group(key: str, entries: list[_Entry], where: str) -> dict[str, Any]:
    """A ``build_strategy`` / ``execution_strategy`` block, less Paddle's own defaults."""
    skip = PADDLE_ONLY.get(NESTED_KEY.get(GROUP_KEYS[key], key), {})
    out: dict[str, Any] = {}
    for k, (v, line) in _merge(entries).items():
        if _paddle_default(k, v, skip):
            continue
        if k in skip and k not in FIELDS:
            raise StrategyError(
                f"{where}:{line}: {key} field {k!r}: {v!r} is Paddle's, which longboat does not "
                f"have; only its default ({_scalar(skip[k])}) is accepted (and ignored)"
            )
        out[k] = _plain(v)
    return out


def _table(entries: list[_Entry], where: str) -> tuple[str, dict[str, Any]]:
    """A ``downpour_table_param`` block: its table name and its settings by dotted path."""
    settings: dict[str, Any] = {}
    name = None

    def walk(items: list[_Entry], prefix: str) -> None:
        nonlocal name
        for e in items:
            if not prefix and e.name == "table_name":
                name = e.value
            elif _is_message(e.value):
                walk(e.value, f"{prefix}{e.name}.")
            else:
                settings[prefix + e.name] = _plain(e.value)

    walk(entries, "")
    if not isinstance(name, str):
        raise StrategyError(f"{where}: a {TABLES_BLOCK} block has no table_name")
    return name, settings


def _unknown(name: str, line: int, where: str, known: list[str]) -> StrategyError:
    if name in PADDLE_ONLY:
        default = PADDLE_ONLY[name]
        shown = _scalar(default) if not isinstance(default, dict) else "its defaults"
        return StrategyError(
            f"{where}:{line}: unknown DistributedStrategy field {name!r}: a Paddle field that "
            f"longboat does not have; only Paddle's default ({shown}) is accepted (and "
            "ignored), remove it from the file"
        )
    best = closest(name, known)
    hint = f"; did you mean {best!r}?" if best else ""
    return StrategyError(
        f"{where}:{line}: unknown DistributedStrategy field {name!r}{hint} (longboat's fields "
        "are listed in docs/strategy.md; remove it from the file)"
    )


def loads(text: str, where: str = "prototxt") -> dict[str, Any]:
    """The fields a prototxt sets, as a mapping for ``Strategy.update`` (nested groups)."""
    entries = _Parser(text, where).message(None)
    known = [*FIELDS, *ALIASES, *NESTED_KEY.values(), TABLES_BLOCK]
    out: dict[str, Any] = {}
    for e in entries:
        if e.name == TABLES_BLOCK:
            table, settings = _table(e.value if _is_message(e.value) else [], where)
            out.setdefault(TABLES_FIELD, {})[table] = settings
            continue
        if e.name in out:
            raise StrategyError(f"{where}:{e.line}: {e.name!r} is given more than once")
        if e.name in GROUP_KEYS:
            out[e.name] = _group(e.name, e.value if _is_message(e.value) else [], where)
            continue
        name = ALIASES.get(e.name, e.name)
        spec = FIELDS.get(name)
        if spec is None and _paddle_default(e.name, e.value, PADDLE_ONLY):
            continue
        if spec is None:
            raise _unknown(e.name, e.line, where, known)
        if spec.is_config:
            out[e.name] = _config(name, e.value if _is_message(e.value) else [])
        elif name == "mode":
            mode = str(e.value)
            if mode not in _MODES:
                raise StrategyError(
                    f"{where}:{e.line}: mode: {mode} is outside data parallelism; longboat "
                    "runs COLLECTIVE and PS"
                )
            out[e.name] = _MODES[mode]
        else:
            out[e.name] = _plain(e.value)
    return out
