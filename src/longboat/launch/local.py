"""Start N ranks on this machine through torch's elastic agent.

`launch_local` is a thin policy layer over torch's local agent (`supervisor.run_agent`): a
standalone c10d rendezvous on 127.0.0.1, a fair share of the cores per rank, quiet torch logging,
a deadline, and failures translated into a `LaunchError` that names the first failed rank, shows
its error, and lists the ranks the launcher stopped because of it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.launcher.api import LaunchConfig

from longboat.launch import torch_compat
from longboat.launch.agent import patched_environ, quiet_torch_logging, signals_raise_in_main_thread
from longboat.launch.exits import RankExit, stopped_ranks
from longboat.launch.ports import free_port as _free_port
from longboat.launch.supervisor import GroupFailedError, run_agent

__all__ = ["LaunchError", "RankFailure", "launch_local"]

_HOST = "127.0.0.1"
_PORT_ATTEMPTS = 5
_TAIL_LINES = 15
_SHUTDOWN_GRACE_S = 5
_RDZV_TIMEOUT_S = 60
_NO_TRACEBACK = (
    "(the rank left no traceback: wrap a script's main in "
    "torch.distributed.elastic.multiprocessing.errors.record, or pass log_dir to keep its stderr)"
)


@dataclass(frozen=True)
class RankFailure:
    """How one rank ended and the tail of its error.

    ``exitcode`` is negative for a signal, and None for a rank that had raised (its traceback
    was written) but was stopped while exiting because another rank's exit was noticed first.
    """

    rank: int
    exitcode: int | None
    signal: str | None
    error: str

    def describe(self) -> str:
        if self.signal:
            how = f"killed by {self.signal}"
        elif self.exitcode is None:
            how = "raised an exception"
        else:
            how = f"exit code {self.exitcode}"
        return f"rank {self.rank} failed ({how})"


class LaunchError(RuntimeError):
    """A launched job failed; ``failures`` maps rank to `RankFailure`, root cause first;
    ``stopped`` lists the ranks the launcher stopped because of them."""

    def __init__(
        self,
        message: str,
        failures: Mapping[int, RankFailure] | None = None,
        stopped: Sequence[int] = (),
    ):
        super().__init__(message)
        self.failures: dict[int, RankFailure] = dict(failures or {})
        self.stopped: list[int] = list(stopped)


def launch_local(
    entrypoint: Callable[..., Any] | str,
    args: Sequence[Any] = (),
    nproc: int = 2,
    *,
    log_dir: str | None = None,
    run_id: str | None = None,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    timeout: float = 600.0,
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` on ``nproc`` local ranks and return ``{rank: return value}``.

    A callable must be importable (module level): it runs in processes started with ``spawn``
    and its return value comes back through a local multiprocessing queue. A string runs as a
    program (``sys.executable`` for Python scripts) with ``args`` as its arguments; its ranks
    return None. Every rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT ... from
    the agent, ``env`` on top, and OMP_NUM_THREADS = cores // nproc unless already set.
    ``log_dir`` keeps each rank's stdout, stderr and error file there (the console then shows
    them prefixed by ``[rankN]:``); without it output goes to the console as is.
    The whole run is stopped after ``timeout`` seconds (enforced from the main thread only).

    Raises `LaunchError` naming the failed rank, its exit code or signal and its last error lines.
    """
    if nproc < 1:
        raise ValueError(f"launch_local: nproc must be >= 1, got {nproc}")
    if timeout <= 0:
        raise ValueError(f"launch_local: timeout must be > 0 seconds, got {timeout}")
    if max_restarts < 0:
        raise ValueError(f"launch_local: max_restarts must be >= 0, got {max_restarts}")
    quiet_torch_logging()
    run_id = run_id or f"longboat-{uuid.uuid4().hex[:12]}"
    with (
        _log_root(log_dir) as root,
        patched_environ(_rank_env(nproc, env)),
        signals_raise_in_main_thread(),
        _watchdog(timeout) as expired,
    ):
        try:
            return _launch_with_free_port(
                entrypoint, args, nproc, root, run_id, max_restarts, keep_logs=log_dir is not None
            )
        except GroupFailedError as exc:
            raise _launch_error(exc, root, run_id) from None
        except SignalException as exc:
            if expired.is_set():
                raise LaunchError(
                    f"launch_local: run {run_id!r} did not finish within {timeout:g} s; "
                    f"all {nproc} ranks were stopped (raise `timeout` if the job needs longer)"
                ) from None
            if exc.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise


def _launch_with_free_port(
    entrypoint: Callable[..., Any] | str,
    args: Sequence[Any],
    nproc: int,
    log_root: str,
    run_id: str,
    max_restarts: int,
    keep_logs: bool,
) -> dict[int, Any]:
    """Launch on a port that was free a moment ago; pick another if someone took it meanwhile."""
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        port = _free_port()
        config = _launch_config(nproc, port, log_root, run_id, max_restarts, keep_logs)
        try:
            return run_agent(config, entrypoint, args, shutdown_grace_s=_SHUTDOWN_GRACE_S)
        except RendezvousConnectionError as exc:
            if attempt == _PORT_ATTEMPTS:
                raise LaunchError(
                    f"launch_local: could not host the rendezvous on {_HOST}:{port} "
                    f"after {_PORT_ATTEMPTS} ports ({exc}); check that local TCP ports can be bound"
                ) from exc
    raise AssertionError("unreachable")


def _launch_config(
    nproc: int, port: int, log_root: str, run_id: str, max_restarts: int, keep_logs: bool
) -> LaunchConfig:
    """A single-node, standalone-style config: c10d rendezvous hosted by this process.

    With ``keep_logs`` each rank's stdout and stderr go to files under ``log_root`` and to the
    console prefixed by ``[rankN]:``; otherwise they go to the console untouched (progress bars
    keep their terminal) and ``log_root`` only receives the ranks' error files.
    """
    return torch_compat.launch_config(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=f"{_HOST}:{port}",
        rdzv_configs={"is_host": True, "timeout": _RDZV_TIMEOUT_S},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=_HOST,
        logs_specs=DefaultLogsSpecs(log_dir=log_root, tee=Std.ALL if keep_logs else Std.NONE),
        log_line_prefix_template="[rank${rank}]:",
    )


def _rank_env(nproc: int, env: Mapping[str, str] | None) -> dict[str, str]:
    """The variables every rank inherits: ``env`` plus a fair share of cores for OpenMP."""
    extra = dict(env or {})
    if "OMP_NUM_THREADS" not in extra and "OMP_NUM_THREADS" not in os.environ:
        extra["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    return extra


def _launch_error(exc: GroupFailedError, log_root: str, run_id: str) -> LaunchError:
    """Translate the agent's failure into one readable message, first failure first."""
    report = exc.report
    attempt = _latest_attempt_dir(log_root, run_id)
    failures = {c.rank: _rank_failure(c, attempt) for c in report.causes}
    root = failures[report.first.rank]
    lines = [f"launch_local: {root.describe()}"]
    others = [f.describe() for f in failures.values() if f is not root]
    if others:
        lines.append("then: " + "; ".join(others))
    if report.stopped:
        lines.append("stopped by the launcher as a consequence: " + stopped_ranks(report.stopped))
    lines.append(f"--- last lines from rank {root.rank} ---")
    lines.append(root.error or _NO_TRACEBACK)
    return LaunchError("\n".join(lines), failures, [s.rank for s in report.stopped])


def _rank_failure(cause: RankExit, attempt: str | None) -> RankFailure:
    """A failed rank with the tail of its traceback (or of its stderr log)."""
    failure = ProcessFailure(
        local_rank=cause.rank, pid=0, exitcode=cause.exitcode or 1, error_file=cause.error_file
    )
    error = _traceback_tail(failure) or _stderr_tail(attempt, cause.rank)
    exitcode = None if cause.stopped else cause.exitcode
    return RankFailure(cause.rank, exitcode, None if cause.stopped else cause.signal_name, error)


def _latest_attempt_dir(log_root: str, run_id: str) -> str | None:
    """The newest ``<log_root>/<run_id>_*/attempt_<n>`` directory the agent created, if any."""
    runs = glob.glob(os.path.join(log_root, glob.escape(run_id) + "_*"))
    if not runs:
        return None
    run = max(runs, key=os.path.getmtime)
    attempts = glob.glob(os.path.join(run, "attempt_*"))
    return max(attempts, key=lambda a: int(a.rsplit("_", 1)[1]), default=None)


def _traceback_tail(failure: ProcessFailure) -> str:
    """The last lines of the traceback a rank wrote to its error file, if it wrote one."""
    data = failure.error_file_data.get("message")
    if isinstance(data, dict):
        text = data.get("extraInfo", {}).get("py_callstack") or data.get("message", "")
    else:
        text = "" if data in (None, "<NONE>") else str(data)
    return _tail(text)


def _stderr_tail(attempt: str | None, rank: int) -> str:
    """The last lines of the rank's stderr, kept only when log_dir was given (single node:
    global rank = local rank)."""
    if attempt is None:
        return ""
    try:
        with open(os.path.join(attempt, str(rank), "stderr.log"), errors="replace") as f:
            return _tail(f.read())
    except OSError:
        return ""


def _tail(text: str) -> str:
    return "\n".join(text.rstrip().splitlines()[-_TAIL_LINES:])


@contextlib.contextmanager
def _log_root(log_dir: str | None) -> Iterator[str]:
    """``log_dir`` as given, or a temporary directory removed afterwards."""
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
        yield log_dir
        return
    with tempfile.TemporaryDirectory(prefix="longboat-launch-") as tmp:
        yield tmp


@contextlib.contextmanager
def _watchdog(timeout: float) -> Iterator[threading.Event]:
    """After ``timeout`` s send this process SIGTERM; the agent then stops every rank."""
    expired = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield expired
        return

    def fire() -> None:
        expired.set()
        os.kill(os.getpid(), signal.SIGTERM)

    timer = threading.Timer(timeout, fire)
    timer.daemon = True
    timer.start()
    try:
        yield expired
    finally:
        timer.cancel()
        timer.join()
