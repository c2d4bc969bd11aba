"""The documentation's runnable examples run as written (slow tier).

A fenced block preceded by ``<!-- docs-run: COMMAND -->`` is written to the file its first line
names (``# train.py``) in a fresh directory, and ``COMMAND`` runs there: it must exit 0. A
block preceded by a bare ``<!-- docs-run -->`` is a shell block, run as is in the directory of
the files written before it in the same document, where ``examples/`` and ``tests/`` are the
repository's (blocks that emulate nodes need root, as the slow tier has). So an example cannot
drift from the code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._cli import env_with_bin, longboat_argv

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKED = re.compile(
    r"<!-- docs-run(?::\s*(?P<cmd>.*?))?\s*-->\n```(?P<lang>\w+)\n(?P<body>.*?)```", re.S
)
NAMED = re.compile(r"#\s*(?P<name>[\w.-]+\.py)\s*\n")


def examples() -> list[tuple[str, list[tuple[str | None, str, str]]]]:
    """Per document with marked blocks: its (command, language, body) triples, in order."""
    found = []
    for doc in DOCS:
        blocks = [(m["cmd"], m["lang"], m["body"]) for m in MARKED.finditer(doc.read_text())]
        if blocks:
            found.append((str(doc.relative_to(ROOT)), blocks))
    return found


BLOCK = re.compile(r"(?P<marker><!-- docs-(?:run|skip)[^>]*-->\n)?```(?:python|bash)\n", re.S)


def test_every_python_or_shell_block_runs_or_says_why_not() -> None:
    """A new example is either run (``docs-run``) or marked ``<!-- docs-skip: why -->``."""
    unmarked = []
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            if not m["marker"]:
                line = text[: m.start()].count("\n") + 1
                unmarked.append(f"{doc.relative_to(ROOT)}:{line}")
            elif m["marker"].startswith("<!-- docs-skip") and ":" not in m["marker"]:
                unmarked.append(f"{doc.relative_to(ROOT)}: docs-skip without a reason")
    assert not unmarked, "mark these blocks docs-run or docs-skip: REASON: " + ", ".join(unmarked)


def test_the_marker_finds_the_documented_examples() -> None:
    docs = dict(examples())
    assert {"README.md", "docs/ps.md", "docs/emulate.md", "docs/integrations.md"} <= set(docs)
    for doc, blocks in docs.items():
        for cmd, lang, body in blocks:
            if cmd is not None:
                assert lang == "python" and NAMED.match(body), f"{doc}: name the file: # x.py"


@pytest.mark.slow
@pytest.mark.parametrize(("doc", "blocks"), examples(), ids=[d for d, _ in examples()])
def test_example_runs_as_written(doc: str, blocks: list, tmp_path: Path) -> None:
    # this Python's `longboat` and `python`, whether or not its venv is activated
    env = env_with_bin({**os.environ, "PYTHONUNBUFFERED": "1"})
    for name in ("examples", "tests"):  # blocks name the repository's files as from its root
        (tmp_path / name).symlink_to(ROOT / name)
    for cmd, _, body in blocks:
        if cmd is not None:
            (tmp_path / NAMED.match(body)["name"]).write_text(body)
            argv = cmd.split()
            if argv[0] == "python":
                argv[0] = sys.executable
            elif argv[0] == "longboat":
                argv = longboat_argv() + argv[1:]
            run = subprocess.run(
                argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
            )
        else:
            run = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env,
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
        assert run.returncode == 0, (
            f"{doc}: {cmd or body}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        )
        # an example whose injected faults never fire does not do what its text says
        assert "did not fire" not in run.stdout + run.stderr, f"{doc}: {cmd or body}"
