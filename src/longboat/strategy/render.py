"""Text renderings derived from the field table and the registries: the printed table, the
markdown reference of docs/strategy.md (what ``fields_*.py`` declare: it changes with a field,
never with a plug-in) and the live listing of the registered plug-ins."""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from typing import Any

from longboat.registry import ALGORITHMS, COMPRESSORS
from longboat.strategy.conflicts import CONFLICTS
from longboat.strategy.fields import FIELDS
from longboat.strategy.registered import COMPRESSION_FIELD
from longboat.strategy.spec import GROUPS, FieldSpec
from longboat.strategy.values import Config, RegistryChoice, SubConfig, ValueType

ALL_DEFAULTS = "all fields at their defaults"
TABLE_WIDTH = 110

Row = tuple[str, Any, Any, str]  # field (or field.key), value, default, source


def text_table(rows: Sequence[Row]) -> str:
    """The non-default fields as a plain-text rich table (ASCII, no ANSI codes)."""
    from rich import box  # imported here so that importing longboat.strategy stays cheap
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if not rows:
        return f"Strategy: {ALL_DEFAULTS}\n"
    table = Table(
        title=f"Strategy: {len(rows)} non-default value(s)",
        title_justify="left",
        box=box.ASCII2,  # plain ASCII: safe in any log file or console encoding
    )
    for column in ("field", "value", "default", "source"):
        table.add_column(column, overflow="fold")
    for name, value, default, source in rows:
        # Text() so that values such as [0.5] are not read as rich markup
        table.add_row(Text(name), Text(repr(value)), Text(repr(default)), Text(source))
    buffer = io.StringIO()
    console = Console(
        file=buffer, width=TABLE_WIDTH, force_terminal=False, color_system=None, no_color=True
    )
    console.print(table)
    return "".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(value: Any) -> str:
    return f"`{value!r}`"


def _md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _type(vtype: ValueType | Config) -> str:
    """A field's type as the reference states it: a registry's names are listed live."""
    return "str (a registered name)" if isinstance(vtype, RegistryChoice) else vtype.short


def field_markdown(specs: Sequence[FieldSpec] = FIELDS.static) -> str:
    """Markdown table of ``specs`` (the declared fields): group, type, default, status,
    meaning, env variable."""
    rows = []
    for group in GROUPS:
        for spec in (s for s in specs if s.group == group):
            default = "see config keys" if spec.is_config else _code(spec.default)
            rows.append(
                (
                    f"`{spec.name}`",
                    group,
                    _type(spec.type),
                    default,
                    spec.status_text(),
                    spec.doc,
                    f"`{spec.env_var}`",
                )
            )
    header = ("Field", "Group", "Type", "Default", "Status", "Meaning", "Environment")
    return "\n".join(_md_table(header, rows)) + "\n"


def config_markdown(specs: Sequence[FieldSpec] = FIELDS.static) -> str:
    """Markdown table of every key of every ``*_configs`` field of ``specs``."""
    rows = []
    for spec in specs:
        if not isinstance(spec.type, Config):
            continue
        for key in spec.type.keys:
            if isinstance(key.type, SubConfig):  # one row per key of the nested config
                rows.append((f"`{spec.name}`", f"`{key.name}`", "dict", "see below", key.doc))
                rows += [
                    (
                        f"`{spec.name}`",
                        f"`{key.name}.{sub.name}`",
                        sub.type.short,
                        _code(sub.default),
                        sub.doc,
                    )
                    for sub in key.type.config.keys
                ]
                continue
            rows.append(
                (f"`{spec.name}`", f"`{key.name}`", _type(key.type), _code(key.default), key.doc)
            )
    return "\n".join(_md_table(("Config", "Key", "Type", "Default", "Meaning"), rows)) + "\n"


def algorithm_markdown() -> str:
    """Markdown table of the registered allreduce algorithms and their declarations."""
    rows = [
        (
            f"`{e.name}`",
            ", ".join(e.topologies) or "never",
            "yes" if e.tune else "no",
            "yes" if e.broadcast else "no",
            e.doc,
        )
        for e in ALGORITHMS.entries()
    ]
    header = ("Algorithm", "Automatic choice on", "Tuned by auto", "Start-up broadcast", "Meaning")
    return "\n".join(_md_table(header, rows)) + "\n"


def compressor_markdown() -> str:
    """Markdown table of the registered gradient compressors and their declarations."""
    rows = [
        (
            f"`{e.name}`",
            f"`{e.switch}=True`" if e.switch else f"`{COMPRESSION_FIELD}={e.name!r}`",
            "yes" if e.lossy else "no",
            f"`{e.name}_configs`" if e.config is not None else "none",
            e.doc,
        )
        for e in COMPRESSORS.entries()
    ]
    header = ("Compressor", "Selected by", "Lossy", "Config", "Meaning")
    return "\n".join(_md_table(header, rows)) + "\n"


def conflict_markdown() -> str:
    """Markdown table of the conflict rules."""
    rows = [(f"`{c.first}`", f"`{c.second}`", c.condition, c.reason) for c in CONFLICTS]
    return "\n".join(_md_table(("Field", "Conflicts with", "When", "Why"), rows)) + "\n"


def agreement_markdown() -> str:
    """Which fields must be the same on every rank (checked by ``lb.distribute``)."""
    local = ", ".join(f"`{s.name}`" for s in FIELDS.static if s.per_rank)
    return (
        "`lb.distribute` compares every field across ranks before any gradient is exchanged "
        "and raises the same error on every rank, naming each field that differs and each "
        f"rank's value and its source. These act on their own process only and may differ: "
        f"{local}.\n"
    )


PLUGINS_TEXT = (
    "Allreduce algorithms (`allreduce_algorithm`), gradient compressors "
    "(`gradient_compression`, or a compressor's own switch such as `dgc`) and the "
    "`<name>_configs` field of each compressor that declares settings (such as `dgc_configs`) "
    "come from the registries, not from the tables above: adding one is a module, and this "
    "page stays as it is. `python -m longboat.strategy --plugins` prints the registered ones "
    "with their declarations, fields and keys; the error on a wrong name lists them. "
    "[algorithms.md](algorithms.md) and [compression.md](compression.md) describe the built-in "
    "ones.\n"
)

BEGIN_MARK = "<!-- BEGIN GENERATED: python -m longboat.strategy --markdown -->"
END_MARK = "<!-- END GENERATED -->"


def reference_markdown() -> str:
    """The generated block of docs/strategy.md, markers included."""
    return "\n".join(
        [
            BEGIN_MARK,
            "",
            "### Fields",
            "",
            field_markdown(),
            "### Config keys",
            "",
            config_markdown(),
            "### Plug-ins",
            "",
            PLUGINS_TEXT,
            "### Conflicts",
            "",
            conflict_markdown(),
            "### Same on every rank",
            "",
            agreement_markdown(),
            END_MARK,
            "",
        ]
    )


def plugins_markdown() -> str:
    """The registered allreduce algorithms and gradient compressors, and the compressors'
    ``<name>_configs`` fields and keys, as registered now (``--plugins``)."""
    added = FIELDS.registered
    return "\n".join(
        [
            "### Allreduce algorithms",
            "",
            algorithm_markdown(),
            "### Gradient compressors",
            "",
            compressor_markdown(),
            "### Compressor settings",
            "",
            field_markdown(added),
            config_markdown(added),
        ]
    )


def replace_generated(document: str) -> str:
    """``document`` with its generated block replaced by the current one."""
    start, end = document.find(BEGIN_MARK), document.find(END_MARK)
    if start < 0 or end < start:
        raise ValueError(f"markers {BEGIN_MARK!r} ... {END_MARK!r} not found")
    return document[:start] + reference_markdown() + document[end + len(END_MARK) + 1 :]
