"""The Strategy's typing stub (``typed_fields.pyi``): current, complete, true to run time."""

from __future__ import annotations

import ast
import importlib
import shutil
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest

import longboat
from longboat.strategy import FIELDS, Strategy, stub
from longboat.strategy.__main__ import main as strategy_main
from longboat.strategy.changes import ALIASES, attribute_names
from longboat.strategy.table_views import Tables
from longboat.strategy.values import Config
from longboat.strategy.views import ConfigView, GroupView, SubConfigView

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_TYPES: dict[str, type] = {
    "bool": bool,
    "int": int,
    "float": float,
    "str": str,
    "None": type(None),
    "Tables": Tables,
    "SubConfigView": SubConfigView,
    "GroupView": GroupView,
}


def conforms(value: Any, hint: str) -> bool:
    """Whether ``value`` is of ``hint``, a type as the stub writes it."""
    if " | " in hint:
        return any(conforms(value, part) for part in hint.split(" | "))
    if hint.startswith("Literal["):
        return value in ast.literal_eval(hint.removeprefix("Literal"))
    if hint.startswith("list["):
        return isinstance(value, list) and all(conforms(v, hint[5:-1]) for v in value)
    assert hint in RUNTIME_TYPES, f"{hint!r}: declare the hint of this value type"
    kind = RUNTIME_TYPES[hint]
    return isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))


def stub_tree() -> dict[str, ast.ClassDef]:
    tree = ast.parse(stub.STUB_PATH.read_text(encoding="utf-8"))
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def test_the_committed_stub_is_current() -> None:
    assert stub.STUB_PATH.read_text(encoding="utf-8") == stub.typing_stub(), (
        f"{stub.STUB_PATH.name} is stale: run {stub.COMMAND}"
    )


def test_the_stub_declares_every_attribute_and_keyword_but_the_registries() -> None:
    registered = {spec.name for spec in FIELDS.registered}
    expected = [name for name in attribute_names() if name not in registered]
    fields = stub_tree()["DeclaredFields"]
    init = next(n for n in fields.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert [a.arg for a in init.args.kwonlyargs] == ["env", *expected]
    assert init.args.kwarg is not None  # the registries' fields are keywords too
    declared = [n.target.id for n in fields.body if isinstance(n, ast.AnnAssign)]  # type: ignore[union-attr]
    declared += [
        n.name
        for n in fields.body
        if isinstance(n, ast.FunctionDef) and any(
            isinstance(d, ast.Name) and d.id == "property" for d in n.decorator_list
        )
    ]
    assert sorted(declared) == sorted(expected)


def test_each_config_view_types_every_key() -> None:
    classes = stub_tree()
    for spec in FIELDS.static:
        if not isinstance(spec.type, Config):
            continue
        view = classes[stub.view_class(spec)]
        keys: list[str] = []
        for node in view.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getitem__":
                annotation = node.args.args[1].annotation
                if isinstance(annotation, ast.Subscript):  # Literal["a", "b"]
                    elts = getattr(annotation.slice, "elts", [annotation.slice])
                    keys += [e.value for e in elts]  # type: ignore[attr-defined]
        assert sorted(keys) == sorted(spec.type.names()), spec.name


def test_the_declared_types_are_what_a_strategy_returns() -> None:
    """Every attribute and config key reads as the type the stub gives it, given values of the
    accepted kinds (an int for a float, a path object for a path)."""
    strategy = Strategy(
        env={}, fuse_grad_size_in_MB=16, nccl_comm_num=2.0, timeline=Path("timeline.json")
    )
    checked = 0
    for name, read, _, _ in stub.attributes():
        value = getattr(strategy, name)
        spec = FIELDS.get(ALIASES.get(name, name))
        if spec is not None and isinstance(spec.type, Config):
            assert type(value) is ConfigView and read == stub.view_class(spec)
            for key in spec.type.keys:
                assert conforms(value[key.name], key.type.hint), (name, key.name, key.type.hint)
                checked += 1
        else:
            assert conforms(value, read), (name, value, read)
        checked += 1
    assert checked > len(FIELDS.static)
    assert isinstance(strategy.fuse_grad_size_in_MB, float) and strategy.timeline == "timeline.json"


def test_write_docs_refreshes_the_stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = tmp_path / "strategy.md"
    shutil.copy(ROOT / "docs" / "strategy.md", docs)
    monkeypatch.setattr(stub, "STUB_PATH", tmp_path / "typed_fields.pyi")
    assert strategy_main(["--write-docs", str(docs)]) == 0
    assert (tmp_path / "typed_fields.pyi").read_text(encoding="utf-8") == stub.typing_stub()


def test_the_stub_ships_in_the_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = config["tool"]["setuptools"]["package-data"]["longboat"]
    relative = stub.STUB_PATH.relative_to(ROOT / "src" / "longboat").as_posix()
    assert any(fnmatch(relative, pattern) for pattern in patterns), patterns


def test_type_checkers_see_the_names_longboat_imports_on_first_use() -> None:
    """The ``if TYPE_CHECKING`` imports of ``longboat/__init__.py`` are the lazy exports."""
    tree = ast.parse(Path(longboat.__file__).read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n))
    imports = [n for n in block.body if isinstance(n, ast.ImportFrom)]
    names = [(n.module, a.name) for n in imports for a in n.names]
    assert ("longboat.strategy", "Strategy") in names
    for module, name in names:
        assert getattr(importlib.import_module(str(module)), name) is getattr(longboat, name)
