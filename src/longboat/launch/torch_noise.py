"""torch's C++ warnings on the launcher's console: recognised, counted, one line each.

torch's C++ code (c10d's TCPStore, its sockets) writes warnings straight to file descriptor 2,
each with up to 30 lines of C++ frames: a node waiting on a wrong ``--master`` prints hundreds of
them, burying longboat's own lines. `KnownWarnings` classifies those lines; `quiet_console`
applies it to the launcher's own descriptor 2 (the full text goes to ``<log_dir>/launcherlog.N``)
and to the ranks' lines that the console shows (their full text stays in ``workerlog.N``). The
first warning of each kind prints one line saying what it means and what to check; the end of
the launch prints how many were kept off the console.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TextIO

#: ``[W1207 05:32:21.526450949 TCPStore.cpp:340] ...``: glog-style C++ log lines
_HEADER = re.compile(r"^\[[WEIF]\d{4} [\d:.]+(?: \d+)? [\w.]+\.(?:cpp|cc|h|hpp):\d+\] ")
#: the C++ frames a warning (or a Python exception's message) carries after its first line
_FRAME = re.compile(r"^(?:Exception raised from |frame #\d+: |<omitting python frames>)")
_RANK_PREFIX = re.compile(r"^\[rank \d+\] ")

#: kind -> (how a warning's first line is recognised, what it means and what to check)
KINDS: dict[str, tuple[re.Pattern[str], str]] = {
    "ping failed": (
        re.compile(r"Ping failed"),
        "the --master endpoint answers, but not as a torch store: another service (or another "
        "job) listens on that port; check that --master names node 0's `longboat launch` port",
    ),
    "hostname": (
        re.compile(r"hostname of the client socket cannot be retrieved"),
        "the store could not look up a peer's address by name (no reverse DNS for it); harmless, "
        "nothing to fix (an /etc/hosts entry per node silences it)",
    ),
    "peer ended": (
        re.compile(
            r"DistNetworkError|Connection reset|Broken pipe|failed to recv|recvBytes|sendBytes|"
            r"Connection refused|connect\(\) failed|Socket Timeout|timed out|Connection closed"
        ),
        "a peer, or the node that serves the rendezvous store, ended or became unreachable: "
        "normal when one node finishes first; otherwise check that node's log and the network",
    ),
    "other": (re.compile(""), "a warning of torch's C++ code; read it in full if the job fails"),
}


def first_line(error: BaseException) -> str:
    """An exception's message without the C++ frames torch appends to it."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


class KnownWarnings:
    """Classifies console lines from several sources; counts each kind of torch C++ warning."""

    def __init__(self, say: Callable[[str], None], where: Callable[[str], str]):
        self._say = say  # prints one longboat line
        self._where = where  # source -> where its full text is kept
        self.counts: Counter[str] = Counter()
        self._in_frames: dict[str, bool] = {}
        self._lock = threading.Lock()

    def swallow(self, line: str, source: str) -> bool:
        """Whether ``line`` (without its newline) is torch C++ noise, kept off the console."""
        text = _RANK_PREFIX.sub("", line)
        key = source + (line[: len(line) - len(text)])
        with self._lock:
            if not _HEADER.match(text):
                frames = bool(_FRAME.match(text) or (self._in_frames.get(key) and not text.strip()))
                self._in_frames[key] = frames
                return frames
            kind = next(k for k, (pattern, _) in KINDS.items() if pattern.search(text))
            self.counts[kind] += 1
            self._in_frames[key] = True
            first = self.counts[kind] == 1
        if first:  # outside the lock: the line itself goes through this filter
            self._say(self.first_line(kind, source))
        return True

    def first_line(self, kind: str, source: str) -> str:
        meaning = KINDS[kind][1]
        return (
            f"longboat launch: torch warned ({kind}): {meaning}. Full text, and any repeats "
            f"(counted, kept off this console), in {self._where(source)}"
        )

    def summary(self) -> str | None:
        """``kept N torch C++ warnings off the console: ...`` (None when there were none)."""
        total = sum(self.counts.values())
        if not total:
            return None
        kinds = ", ".join(f"{n} {kind}" for kind, n in self.counts.most_common())
        noun = "warning" if total == 1 else "warnings"
        return f"longboat launch: kept {total} torch C++ {noun} off the console ({kinds})"


class _FilteredText:
    """A text stream that drops the lines `KnownWarnings` swallows and passes the rest on."""

    def __init__(self, inner: TextIO, known: KnownWarnings, source: str):
        self._inner = inner
        self._known = known
        self._source = source

    def write(self, text: str) -> int:
        kept = [
            line
            for line in text.splitlines(keepends=True)
            if not line.endswith("\n") or not self._known.swallow(line[:-1], self._source)
        ]
        self._inner.write("".join(kept))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Descriptor2:
    """The process' descriptor 2 through a pipe: swallowed lines to ``log_path``, the rest to
    the original descriptor."""

    def __init__(self, known: KnownWarnings, log_path: str, source: str):
        self._known, self._log_path, self._source = known, log_path, source
        self._stop = threading.Event()
        self._log: Any = None
        sys.stderr.flush()
        self._saved = os.dup(2)
        self._read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self._thread = threading.Thread(target=self._run, name="longboat-stderr", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pending = b""
        while True:
            ready, _, _ = select.select([self._read], [], [], 0.1)
            if not ready:
                if self._stop.is_set():
                    break
                continue
            chunk = os.read(self._read, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                self._one(raw + b"\n")
        if pending:
            self._one(pending)
        if self._log is not None:
            self._log.close()

    def _one(self, raw: bytes) -> None:
        try:
            noise = self._known.swallow(raw.decode(errors="replace").rstrip("\n"), self._source)
        except Exception:  # noqa: BLE001 - a classifier bug must never swallow the console
            noise = False
        if not noise:
            os.write(self._saved, raw)
            return
        if self._log is None:  # made only when there is something to keep
            self._log = open(self._log_path, "ab")  # noqa: SIM115 - closed when the pipe ends
        self._log.write(raw)
        self._log.flush()

    def close(self) -> None:
        """Put descriptor 2 back; lines already in the pipe are still handled."""
        sys.stderr.flush()
        os.dup2(self._saved, 2)  # drops this process' write end: ranks may still hold one
        self._stop.set()
        self._thread.join(timeout=2)
        os.close(self._saved)


@contextlib.contextmanager
def quiet_console(
    say: Callable[[str], None], log_dir: str, node_rank: int
) -> Iterator[KnownWarnings]:
    """While the launch runs: torch's C++ warnings off the console, one line per kind, and a
    count at the end (printed by ``say``)."""
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"launcherlog.{node_rank}")
    shown = os.path.join(log_dir, "")

    def where(source: str) -> str:
        return log_path if source == "launcher" else f"the rank's log ({shown}workerlog.N)"

    known = KnownWarnings(say, where)
    saved_stdout = sys.stdout
    sys.stdout = _FilteredText(saved_stdout, known, "ranks")  # type: ignore[assignment]
    fd2 = _Descriptor2(known, log_path, "launcher")
    try:
        yield known
    finally:
        fd2.close()
        sys.stdout = saved_stdout
        line = known.summary()
        if line is not None:
            say(line)
