"""How tests start the ``longboat`` command: the console script beside this Python (a venv's
``bin/``, activated or not), else ``python -m longboat``; never whatever ``PATH`` finds first."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def longboat_argv() -> list[str]:
    """The argv prefix that runs ``longboat`` from this interpreter's installation."""
    script = BIN / "longboat"
    return [str(script)] if script.exists() else [sys.executable, "-m", "longboat"]


def env_with_bin(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with this interpreter's ``bin/`` first on ``PATH``, so a
    shell line's ``longboat`` and ``python`` are this installation's."""
    env = dict(os.environ if env is None else env)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    return env
