"""Glue around torch's elastic agent shared by `launch_local` and `longboat launch`."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator, Mapping

from torch.distributed.elastic.multiprocessing import SignalException

_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")
# these only repeat, as tracebacks of torch internals, what the launchers report themselves
_TORCH_FAILURE_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.multiprocessing.spawn",
)


def _not_death_signal(record: logging.LogRecord) -> bool:
    """The agent's "Received N death signal" warning: the launcher says it in its own words."""
    return not str(record.msg).startswith("Received %s death signal")


def quiet_torch_logging() -> None:
    """Keep the agent's INFO chatter off the console unless the user asked for it (LOGLEVEL)."""
    if "LOGLEVEL" in os.environ:
        return
    for name in _TORCH_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in _TORCH_FAILURE_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    if _not_death_signal not in agent_log.filters:
        agent_log.addFilter(_not_death_signal)


@contextlib.contextmanager
def patched_environ(extra: Mapping[str, str]) -> Iterator[None]:
    """Set ``extra`` for the ranks to inherit; undo it and anything torch set on the way out."""
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def _raise_signal_exception(signum: int, frame: object) -> None:
    sigval = signal.Signals(signum)
    raise SignalException(f"process {os.getpid()} got {sigval.name}", sigval=sigval)


@contextlib.contextmanager
def signals_raise_in_main_thread() -> Iterator[None]:
    """Turn termination signals into SignalException (as the agent does once workers start),
    also during rendezvous, and put the caller's handlers back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = [getattr(signal, name) for name in _HANDLED_SIGNALS if hasattr(signal, name)]
    saved = {s: signal.getsignal(s) for s in signums}
    for s in signums:
        signal.signal(s, _raise_signal_exception)
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
