"""Run `longboat launch` from a test and leave no process behind, whatever happens."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

_STOP_GRACE_S = 30


@dataclass
class Launched:
    """How the launcher ended; ``left_running``: rank pids still alive after it exited."""

    returncode: int
    stdout: str
    stderr: str
    left_running: list[int] = field(default_factory=list)


def run_launcher(
    cwd: Path, *args: str, timeout: float = 90, pid_dir: Path | None = None
) -> Launched:
    """``python -m longboat launch ARGS`` in ``cwd``; stdout and stderr captured as text.

    Past ``timeout`` the launcher gets SIGTERM (its agent then stops the ranks), then SIGKILL.
    Ranks that wrote their pid to ``pid_dir/pid.<rank>`` and still run at the end are noted in
    ``left_running`` and killed.
    """
    left: list[int] = []
    proc = subprocess.Popen(
        [sys.executable, "-m", "longboat", "launch", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=_STOP_GRACE_S)
        finally:
            proc.kill()
            proc.communicate()
        raise
    finally:
        if pid_dir is not None:
            left = rank_pids(pid_dir)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return Launched(proc.returncode, out, err, left)


def rank_pids(pid_dir: Path) -> list[int]:
    """The pids ranks recorded in ``pid_dir`` that still belong to a live process."""
    return [pid for p in sorted(pid_dir.glob("pid.*")) if alive(pid := int(p.read_text()))]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie awaiting its parent counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
