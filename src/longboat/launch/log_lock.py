"""One live job per log directory: a second launch into it is refused, naming the first.

The claim is an advisory ``flock`` on ``<log_dir>/.launch-node<N>.lock`` held for the life of
the launcher (the kernel drops it when the launcher dies, so a crash never leaves a stale
claim). Nodes sharing one directory over a network filesystem take separate locks.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from typing import IO


class LogDirBusyError(RuntimeError):
    """Another live job writes its worker logs into the same directory."""


def claim_log_dir(log_dir: str, node_rank: int, what: str) -> IO[str]:
    """Lock ``log_dir`` for this job; keep the returned file open as long as the job runs."""
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, f".launch-node{node_rank}.lock")
    handle = open(path, "a+")  # noqa: SIM115 - held open on purpose: the lock lives with it
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another launcher"
        handle.close()
        shown = os.path.join(log_dir, "")
        raise LogDirBusyError(
            f"{shown} is in use by a running job ({holder}); give this job its own "
            f"--log-dir DIR, or wait for that job to end"
        ) from None
    handle.seek(0)
    handle.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}: {what}")
    handle.flush()
    return handle
