"""The typing stub of the Strategy, ``typed_fields.pyi``, generated from the field table.

Type checkers and editors read the declared fields from it: each field's type and meaning as
an attribute and as a keyword of ``Strategy(...)``, each ``*_configs`` field's keys by type.
Only the declared fields (``FIELDS.static``) are in it, so a new plug-in leaves it as it is;
the fields the registries add read as ``Any`` (``Strategy.__getattr__``).
``python -m longboat.strategy --write-docs`` refreshes it with the docs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from longboat.strategy.changes import ALIASES, GROUP_KEYS, KEY_ALIASES
from longboat.strategy.fields import FIELDS
from longboat.strategy.spec import FieldSpec
from longboat.strategy.values import Config, SubConfig, ValueType

STUB_PATH = Path(__file__).with_name("typed_fields.pyi")
COMMAND = "python -m longboat.strategy --write-docs docs/strategy.md"
QUOTES = '"' * 3

HEADER = f"""{QUOTES}The declared Strategy fields, typed, for type checkers and editors.

Generated from the field table by
``{COMMAND}``: do not edit.
{QUOTES}
"""

# a word the stub uses -> its import
IMPORTS = {
    "os": "import os",
    "Mapping": "from collections.abc import Mapping",
    "Any": "from typing import Any",
    "Literal": "from typing import Literal",
    "overload": "from typing import overload",
    "Tables": "from longboat.strategy.table_views import Tables",
    "ConfigView": "from longboat.strategy.views import ConfigView",
    "GroupView": "from longboat.strategy.views import GroupView",
    "SubConfigView": "from longboat.strategy.views import SubConfigView",
}

Attribute = tuple[str, str, str, str]  # name, what a read gives, what an assignment takes, doc


def view_class(spec: FieldSpec) -> str:
    """The name of the typed view of config field ``spec``: ``AmpConfigs``."""
    return "".join(part.capitalize() for part in spec.name.split("_"))


def _attribute(name: str, vtype: ValueType | Config, view: str, doc: str) -> Attribute:
    read = view if isinstance(vtype, Config) else vtype.hint
    return name, read, vtype.input_hint, doc.replace(QUOTES, "'''")


def _key_type(field: str, keys: list[str]) -> ValueType:
    """The type of ``FIELDS[field][keys[0]][keys[1]]...``."""
    vtype: ValueType | Config = FIELDS[field].type
    for key in keys:
        config = vtype.config if isinstance(vtype, SubConfig) else vtype
        found = config.key(key) if isinstance(config, Config) else None
        if found is None:
            raise KeyError(f"{field}{keys} is not a config key")
        vtype = found.type
    assert isinstance(vtype, ValueType)
    return vtype


def attributes() -> Iterator[Attribute]:
    """Every attribute of a Strategy the stub declares, in ``attribute_names`` order: the
    declared fields, Paddle's other names of fields and keys, the group views."""
    for spec in FIELDS.static:
        yield _attribute(spec.name, spec.type, view_class(spec), spec.doc)
    for alias, name in ALIASES.items():
        spec = FIELDS[name]
        yield _attribute(alias, spec.type, view_class(spec), f"Paddle's name of ``{name}``")
    for alias, (field, *keys) in KEY_ALIASES.items():
        path = field + "".join(f"[{key!r}]" for key in keys)
        yield _attribute(alias, _key_type(field, keys), "", f"Paddle's name of ``{path}``")
    for key, group in GROUP_KEYS.items():
        # assigned: a dict of the group's fields, or Paddle's BuildStrategy() object
        yield key, "GroupView", "Any", f"the {group} fields, as a live view"


def _view(spec: FieldSpec, config: Config) -> list[str]:
    """The view of a config field: each key's type by its name, keys grouped by type."""
    by_hint: dict[str, list[str]] = {}
    for key in config.keys:
        by_hint.setdefault(key.type.hint, []).append(f'"{key.name}"')
    lines = [
        f"class {view_class(spec)}(ConfigView):",
        f"    {QUOTES}The keys of ``Strategy.{spec.name}``.{QUOTES}",
    ]
    for hint, names in [*by_hint.items(), ("Any", [])]:
        keys = f"Literal[{', '.join(names)}]" if names else "str"
        lines += ["    @overload", f"    def __getitem__(self, key: {keys}) -> {hint}: ..."]
    return [*lines, ""]


def _fields_class() -> list[str]:
    declared = list(attributes())
    lines = [
        "class DeclaredFields:",
        f"    {QUOTES}The declared fields of ``longboat.Strategy``, typed: its attributes and",
        "    keywords. Other names (the registries' ``<name>_configs``) read and take ``Any``.",
        f"    {QUOTES}",
        "",
        "    def __init__(",
        "        self,",
        "        *,",
        "        env: Mapping[str, str] | None = None,",
        *(f"        {name}: {given} = ...," for name, _, given, _ in declared),
        "        **fields: Any,",
        "    ) -> None: ...",
    ]
    for name, read, given, doc in declared:
        if read == given:
            lines += [f"    {name}: {read}", f"    {QUOTES}{doc}{QUOTES}"]
            continue
        lines += [
            "    @property",
            f"    def {name}(self) -> {read}:",
            f"        {QUOTES}{doc}{QUOTES}",
            f"    @{name}.setter",
            f"    def {name}(self, value: {given}) -> None: ...",
        ]
    return lines


def typing_stub() -> str:
    """The text of ``typed_fields.pyi`` for the current field table."""
    body: list[str] = []
    for spec in FIELDS.static:
        if isinstance(spec.type, Config):
            body += _view(spec, spec.type)
    text = "\n".join(body + _fields_class()) + "\n"
    code = "\n".join(line for line in text.splitlines() if not line.strip().startswith(QUOTES))
    used = [line for word, line in IMPORTS.items() if re.search(rf"\b{word}\b", code)]
    plain = sorted(line for line in used if line.startswith("import "))
    stdlib = sorted(line for line in used if line.startswith("from ") and "longboat" not in line)
    own = sorted(line for line in used if "longboat" in line)
    return "\n".join([HEADER, *_merged(plain + stdlib), "", *_merged(own), "", text])


def _merged(lines: list[str]) -> list[str]:
    """``from m import a`` and ``from m import b`` as ``from m import a, b``, in order."""
    names: dict[str, list[str]] = {}
    for line in lines:
        module, _, name = line.partition(" import ")
        names.setdefault(module, []).append(name)
    return [f"{m} import {', '.join(n)}" if m.startswith("from ") else m for m, n in names.items()]


def write_stub(path: Path | None = None) -> None:
    """Write the current stub to ``path`` (default: the package's ``typed_fields.pyi``)."""
    (path or STUB_PATH).write_text(typing_stub(), encoding="utf-8")
