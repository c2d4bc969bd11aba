"""Every benchmark script's imports resolve, those made inside its functions included (a
benchmark is run by hand, rarely: a moved name must fail here, not months later)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).parent.parent / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_every_longboat_import_resolves(path: Path) -> None:
    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("longboat"):
            module = importlib.import_module(node.module)
            missing += [
                f"{node.module}.{a.name} (line {node.lineno})"
                for a in node.names
                if not hasattr(module, a.name) and not _submodule(node.module, a.name)
            ]
    assert not missing, f"{path.name} imports names that do not exist: {missing}"


def _submodule(package: str, name: str) -> bool:
    try:
        importlib.import_module(f"{package}.{name}")
    except ImportError:
        return False
    return True
