"""The README's commands are the ones CI runs, and its tour runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests._cli import env_with_bin, longboat_argv

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_exactly_two_setup_commands_and_ci_runs_the_test_one():
    commands = [b.strip() for b in _blocks("bash")]
    assert len(commands) == 2
    demo, tests = commands
    assert demo.startswith("pip install torch==2.13.0") and demo.endswith("longboat demo")
    assert "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text()


def test_tour_runs_as_a_single_process():
    (tour,) = _blocks("python")
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", tour], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "gradient_merge" in done.stdout  # print(strategy) shows the changed fields


# options a README sentence names without being a whole command
FRAGMENTS = {"longboat launch --nnodes 2:4"}
READS = ("--profile", "--cluster", "--config", "--strategy")
WRITES = ("-o", "--output", "--write", "--png", "--json")


def inline_commands() -> list[str]:
    """The ``longboat ...`` commands the README's sentences show, in order (line breaks inside
    a span joined)."""
    sentences = README.partition("## Documentation")[0]  # past it: pages named, not commands
    spans = [" ".join(s.split()) for s in re.findall(r"`(longboat [^`]+)`", sentences)]
    return [s for s in spans if s not in FRAGMENTS]


def _values(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in flags]


def test_every_file_a_readme_command_reads_an_earlier_one_writes():
    """So each line runs as written in an empty directory (the tour writes train.py)."""
    made = {"train.py"}
    commands = inline_commands()
    assert any(c.startswith("longboat sim predict") for c in commands), commands
    for command in commands:
        argv = shlex.split(command)
        missing = [f for f in _values(argv, READS) if f not in made]
        assert not missing, f"README: `{command}` reads {missing}, which no line before makes"
        made.update(_values(argv, WRITES))


@pytest.mark.slow
def test_every_readme_command_runs_in_an_empty_directory(tmp_path):
    """The tour saved as train.py, then each command of the README's sentences, in order."""
    (tour,) = _blocks("python")
    (tmp_path / "train.py").write_text(tour)
    env = env_with_bin({**os.environ, "PYTHONUNBUFFERED": "1"})
    for command in inline_commands():
        if command.startswith("longboat emulate") and os.geteuid() != 0:
            continue  # network namespaces need root, as the slow tier in CI has
        argv = longboat_argv() + shlex.split(command)[1:]
        done = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
