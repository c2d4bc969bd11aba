"""What an elastic launcher prepares on its node before its ranks start, and removes after:
its elastic directory cleared of an earlier job's files, and the directory where its ranks
keep a copy of their last commit (`longboat.elastic.node_copy`)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from longboat.comm.shm_segment import pid_alive
from longboat.elastic.membership import clear_round_files
from longboat.launch.elastic_agent import elastic_directory
from longboat.launch.spec import LaunchSpec

_SHM = Path("/dev/shm")
_PREFIX = "longboat-copies-"


def _own_prefix() -> str:
    return f"{_PREFIX}{os.getuid()}-"


def copy_directory(spec: LaunchSpec) -> Path:
    """Shared memory where the machine has it (the copies never touch a disk and go with the
    launcher), else the log directory."""
    if _SHM.is_dir() and os.access(_SHM, os.W_OK):
        return _SHM / f"{_own_prefix()}{os.getpid()}"
    return elastic_directory(spec.log_dir) / "copies"


def remove_orphans(root: Path = _SHM) -> int:
    """Remove the copy directories of this user's launchers that are gone (killed without a
    chance to clean up); how many were removed."""
    removed = 0
    with contextlib.suppress(OSError):
        for path in root.glob(f"{_own_prefix()}*"):
            pid = path.name.rpartition("-")[2]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
    return removed


@contextlib.contextmanager
def elastic_files(spec: LaunchSpec) -> Iterator[Path | None]:
    """For an elastic job: clear the node's elastic directory, make the copy directory
    (yielded) and remove it when the launcher ends. Yields None for other jobs."""
    if not spec.elastic:
        yield None
        return
    clear_round_files(elastic_directory(spec.log_dir))
    remove_orphans()
    copies = copy_directory(spec)
    copies.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        yield copies
    finally:
        shutil.rmtree(copies, ignore_errors=True)
