"""The ``longboat`` command itself."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_version_names_longboat_torch_and_python() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "longboat", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    package = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert done.stdout.startswith(f"longboat {package} (torch "), done.stdout
    assert f"Python {sys.version.split()[0]}" in done.stdout
