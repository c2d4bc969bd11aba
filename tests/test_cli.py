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


def test_help_speaks_to_users() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "longboat", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "its own module" not in done.stdout and "sub-command" not in done.stdout
    assert "COMMAND --help" in done.stdout


def test_piping_into_head_ends_quietly() -> None:
    """The reader closes the pipe after one line: no BrokenPipeError traceback."""
    done = subprocess.run(
        f"{sys.executable} -m longboat doctor --json | head -c 10",
        shell=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
