"""Timeline recorder: Chrome trace events, one file per rank, merged into one trace.

Each rank is a process (``pid`` = rank) and each lane a thread of it: ``compute`` (forward,
backward, bucket-ready marks, waits), ``comm0..K`` (one per communicator), ``optimizer``,
``data`` and ``ps`` (a parameter-server trainer's calls; ``ps1``, ``ps2``... for calls in
flight at once). The merged file opens in Perfetto (ui.perfetto.dev) or chrome://tracing.

Recording appends a tuple to a deque (thread-safe, no lock, no I/O). The rank's file is written
as the run goes: a background thread appends the buffered events in one write whenever
`BATCH_EVENTS` have piled up, and at least every `FLUSH_INTERVAL_S`. A recording thread writes
the batch itself only if `2 * BATCH_EVENTS` are buffered (the writer fell behind), so memory
holds at most that many events however long the run. The file is Chrome's JSON array format,
one event per line, closed with ``]`` by ``save()``; a file cut short (process killed) still
reads, up to its last complete line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from longboat.log import get_logger
from longboat.words import plural

log = get_logger("longboat.trace")

#: how long rank 0 waits at exit for the other ranks to finish their files before merging
MERGE_WAIT_S = 10.0
#: rank 0 merges at exit only up to this many bytes of per-rank files (~1 min per GB to merge)
MERGE_AT_EXIT_MAX_BYTES = 1 << 30
#: events buffered before the writer thread appends them to the rank's file
BATCH_EVENTS = 4096
#: the writer thread also appends whatever is buffered this often (bounds what a kill loses)
FLUSH_INTERVAL_S = 5.0

FIXED_LANES = ("compute", "optimizer", "data", "ps")
_TID = {"compute": 0, "optimizer": 100, "data": 101, "ps": 102}
_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode  # one event, compact
_MERGED_HEAD = '{"traceEvents":['  # first line of a merged trace; one event per line follows
_TS = re.compile(r'"ts":(-?[0-9][0-9.eE+-]*)')  # an event line's first "ts": its own


def comm_lane(k: int) -> str:
    """The lane of communicator ``k``."""
    return f"comm{k}"


def lane_tid(lane: str) -> int:
    """Thread id (and sort order) of a lane: compute first, then comm0..K, then the rest."""
    if lane.startswith("comm"):
        return 1 + int(lane[4:])
    if lane.startswith("ps") and lane[2:].isdigit():
        return 200 + int(lane[2:])
    return _TID[lane]


def rank_path(path: str | os.PathLike[str], rank: int) -> Path:
    """``trace.json`` -> ``trace.rank3.json``: the file rank 3 writes."""
    p = Path(path)
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


def _meta(pid: int, tid: int, kind: str, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": args}


def _lane_meta(pid: int, lane: str) -> list[dict[str, Any]]:
    tid = lane_tid(lane)
    return [
        _meta(pid, tid, "thread_name", name=lane),
        _meta(pid, tid, "thread_sort_index", sort_index=tid),
    ]


class Recorder:
    """Collects this rank's events and streams them to ``trace.rank<r>.json``; ``save()``
    finishes the file (and merges every rank's, on rank 0)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        rank: int,
        world_size: int,
        comm_lanes: int,
        batch_events: int = BATCH_EVENTS,
        flush_interval_s: float = FLUSH_INTERVAL_S,
    ):
        self.path = Path(path)
        self.rank = rank
        self.world_size = world_size
        self.lanes = ["compute", *(comm_lane(k) for k in range(comm_lanes)), *FIXED_LANES[1:]]
        self.batch_events = batch_events
        self.file = rank_path(self.path, rank)
        self._events: deque[tuple[Any, ...] | dict[str, Any]] = deque()
        self._wall0_us = time.time_ns() / 1e3
        self._perf0_ns = time.perf_counter_ns()
        self._pid = os.getpid()
        self._lock = threading.Lock()  # one writer of the file at a time
        self._saved = False
        self._failed = False
        self.file.parent.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            _remove_previous(self.path, world_size)
        head = [
            _meta(rank, 0, "process_name", name=f"rank {rank}"),
            _meta(rank, 0, "process_sort_index", sort_index=rank),
        ]
        for lane in self.lanes:
            head += _lane_meta(rank, lane)
        # replaces a previous run's file, which must not be merged
        self.file.write_text("[\n" + ",\n".join(_encode(e) for e in head))
        self._wake = threading.Event()
        self._stop = threading.Event()
        threading.Thread(
            target=_writer,
            args=(weakref.ref(self), self._wake, self._stop, flush_interval_s),
            name=f"longboat-timeline-{rank}",
            daemon=True,
        ).start()
        weakref.finalize(self, self._stop.set)

    @property
    def buffered(self) -> int:
        """Events recorded but not yet written to the file."""
        return len(self._events)

    def add_lane(self, lane: str) -> None:
        """Declare another lane (named in the trace's metadata)."""
        if lane not in self.lanes:
            self.lanes.append(lane)
            for meta in _lane_meta(self.rank, lane):
                self._record(meta)

    def now(self) -> float:
        """Microseconds since the epoch, with perf_counter resolution."""
        return self._wall0_us + (time.perf_counter_ns() - self._perf0_ns) / 1e3

    def _record(self, event: tuple[Any, ...] | dict[str, Any]) -> None:
        q = self._events
        q.append(event)
        if len(q) >= self.batch_events:
            if len(q) >= 2 * self.batch_events:
                self.flush()  # the writer thread fell behind: write here, so memory stays bounded
            else:
                self._wake.set()

    def complete(
        self,
        lane: str,
        name: str,
        start_us: float,
        end_us: float,
        cat: str = "compute",
        args: dict[str, Any] | None = None,
    ) -> None:
        """A span on ``lane`` from ``start_us`` to ``end_us``."""
        self._record(("X", lane, name, start_us, end_us - start_us, cat, args))

    def instant(self, lane: str, name: str, args: dict[str, Any] | None = None) -> None:
        """A mark on ``lane`` now."""
        self._record(("i", lane, name, self.now(), 0.0, "mark", args))

    @contextlib.contextmanager
    def span(self, lane: str, name: str, cat: str = "compute", **args: Any) -> Iterator[None]:
        """Record the body as a span on ``lane``."""
        start = self.now()
        try:
            yield
        finally:
            self.complete(lane, name, start, self.now(), cat, args or None)

    def _chrome(self, item: tuple[Any, ...] | dict[str, Any]) -> dict[str, Any]:
        if isinstance(item, dict):
            return item
        ph, lane, name, ts, dur, cat, args = item
        event: dict[str, Any] = {
            "ph": ph,
            "pid": self.rank,
            "tid": lane_tid(lane),
            "name": name,
            "ts": ts,
            "cat": cat,
        }
        if ph == "X":
            event["dur"] = dur
        else:
            event["s"] = "t"
        if args:
            event["args"] = args
        return event

    def flush(self) -> int:
        """Append the buffered events to the rank's file now; returns how many."""
        if os.getpid() != self._pid:
            return 0  # a forked child: its copy of the buffer is the parent's to write
        with self._lock:
            return self._write()

    def _write(self, tail: str = "") -> int:
        """Append the buffer (and ``tail``) to the file; the caller holds the lock."""
        q = self._events
        batch = [q.popleft() for _ in range(len(q))]
        if self._saved or self._failed or not (batch or tail):
            return 0  # after save() or a write error: dropped
        text = "".join(",\n" + _encode(self._chrome(e)) for e in batch)
        try:
            with open(self.file, "a", encoding="utf-8") as f:
                f.write(text + tail)
        except OSError as exc:
            self._failed = True
            log.error("timeline: cannot write %s (%s); recording stopped", self.file, exc)
            return 0
        return len(batch)

    def events(self) -> list[dict[str, Any]]:
        """This rank's events in Chrome trace format: those in its file, then the buffered."""
        with self._lock:
            out = list(read_events(self.file)) if self.file.exists() else []
            return out + [self._chrome(e) for e in list(self._events)]

    def save(self) -> Path | None:
        """Finish this rank's file; rank 0 then merges every rank's into ``path``. Idempotent."""
        if self._saved or os.getpid() != self._pid:
            return None
        with self._lock:
            self._write(tail="\n]\n")
            self._saved = True
            self._stop.set()
            self._wake.set()
            self._events.clear()  # recorded after save(): not kept
        if self._failed:
            return None
        if self.rank != 0:
            return self.file
        files = _wait_for_ranks(self.path, self.world_size, MERGE_WAIT_S)
        missing = [r for r, f in enumerate(files) if f is None]
        unfinished = [r for r, f in enumerate(files) if f is not None and not finished(f)]
        if missing:
            log.warning(
                "timeline: no file from rank(s) %s after %.0fs; %s holds the other ranks only. "
                "Merge later with `longboat timeline %s` once their %s files exist",
                missing,
                MERGE_WAIT_S,
                self.path,
                self.path,
                rank_path(self.path, missing[0]).name,
            )
        if unfinished:
            log.warning(
                "timeline: rank(s) %s did not finish their file within %.0fs (still running, or "
                "killed): their part of the trace ends at their last write",
                unfinished,
                MERGE_WAIT_S,
            )
        present = [f for f in files if f is not None]
        size = sum(f.stat().st_size for f in present)
        if size > MERGE_AT_EXIT_MAX_BYTES:
            log.warning(
                "timeline: the per-rank files hold %.1f GB; not merged at exit. Open one in "
                "Perfetto as it is, or merge them with `longboat timeline %s`",
                size / 1e9,
                self.path,
            )
            return None
        merged = merge(present, self.path)
        log.info(
            "timeline: wrote %s (%s); open it in https://ui.perfetto.dev",
            merged,
            plural(len(files) - len(missing), "rank"),
        )
        return merged


def _remove_previous(path: Path, world_size: int) -> None:
    """Delete a previous run's merged trace and its files of ranks beyond ``world_size``, so
    that neither is read as this run's (each rank truncates its own file)."""
    stale = [f for f in rank_files(path) if _rank_of(path, f) >= world_size]
    for f in [path, *stale]:
        with contextlib.suppress(FileNotFoundError):
            f.unlink()


def _writer(
    ref: weakref.ReferenceType[Recorder],
    wake: threading.Event,
    stop: threading.Event,
    interval: float,
) -> None:
    """Background writer: flushes when a batch is full (``wake``) and every ``interval``."""
    while not stop.is_set():
        wake.wait(interval)
        wake.clear()
        rec = ref()
        if rec is None or stop.is_set():
            return
        rec.flush()
        del rec


def finished(path: str | os.PathLike[str]) -> bool:
    """Whether a rank's file was closed by its ``save()`` (it ends with ``]``)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 16))
        return f.read().rstrip().endswith(b"]")


def _wait_for_ranks(path: Path, world_size: int, timeout: float) -> list[Path | None]:
    deadline = time.monotonic() + timeout
    while True:
        files = [rank_path(path, r) for r in range(world_size)]
        found = [f if f.exists() else None for f in files]
        done = all(f is not None and finished(f) for f in found)
        if done or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The events of a trace file, streamed line by line when it holds one event per line.

    Reads a rank's file (JSON array, possibly without its closing ``]`` and with a torn last
    line when its process was killed), a merged trace, or any Chrome trace JSON document.
    """
    for text in event_lines(path):
        yield json.loads(text)


def event_lines(path: str | os.PathLike[str]) -> Iterator[str]:
    """Each event of a trace file as one line of JSON, ``"ts"`` (if any) its first number.

    A file in longboat's one-event-per-line layout is streamed as it is, less a torn last line;
    any other Chrome trace document is loaded whole and its events re-encoded.
    """
    with open(path, encoding="utf-8") as f:
        first = f.readline()
        if first.strip() not in ("[", _MERGED_HEAD):
            for e in _whole(first + f.read()):
                yield _encode({"ts": e["ts"], **e} if "ts" in e else e)
            return
        last = None
        for line in f:
            text = line.strip().rstrip(",")
            if text.startswith("]"):
                break
            if text:
                if last is not None:
                    yield last
                last = text
        if last is None:
            return
        try:
            json.loads(last)  # only the last line can be torn: appends stop when a process dies
        except json.JSONDecodeError:
            log.warning("timeline: %s ends in a partial event (cut short); skipped it", path)
            return
        yield last


def _whole(text: str) -> list[dict[str, Any]]:
    """Events of a trace that is one JSON document (an unterminated array is closed first)."""
    text = text.strip()
    if text.startswith("[") and not text.endswith("]"):
        text = text.rstrip(",") + "]"
    doc = json.loads(text)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def rank_files(path: str | os.PathLike[str]) -> list[Path]:
    """The per-rank files next to ``path`` (``trace.rank*.json``), by rank."""
    p = Path(path)
    found = p.parent.glob(f"{p.stem}.rank*{p.suffix or '.json'}")
    ranked = [(_rank_of(p, f), f) for f in found]
    return [f for r, f in sorted(ranked) if r >= 0]


def _rank_of(path: Path, file: Path) -> int:
    """The rank of a per-rank file of ``path`` (-1 when its name has none)."""
    tag = file.name[len(path.stem) + len(".rank") :].split(".")[0]
    return int(tag) if tag.isdigit() else -1


def merge(files: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> Path:
    """Merge per-rank trace files into ``out``; time 0 is the earliest event of any rank.

    Streams two passes over the files' lines (the earliest time, then the lines with their
    ``ts`` shifted), so memory does not grow with the trace. ``out`` is written to a temporary
    file and renamed.
    """
    origin: float | None = None
    lanes: list[str] = []
    for f in files:
        for text in event_lines(f):
            ts = _TS.search(text)
            if ts is not None and (origin is None or float(ts[1]) < origin):
                origin = float(ts[1])
            if '"thread_name"' in text:
                e = json.loads(text)
                if e.get("name") == "thread_name" and e["args"]["name"] not in lanes:
                    lanes.append(e["args"]["name"])
    base = origin or 0.0

    def shift(m: re.Match[str]) -> str:
        return f'"ts":{round(float(m[1]) - base, 3)}'

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    other = {"producer": "longboat", "world_size": len(files), "lanes": lanes}
    try:
        with open(tmp, "w", encoding="utf-8") as w:
            w.write(_MERGED_HEAD)
            sep = "\n"
            for f in files:
                for text in event_lines(f):
                    w.write(sep + _TS.sub(shift, text, count=1))
                    sep = ",\n"
            w.write(f'\n],"displayTimeUnit":"ms","otherData":{_encode(other)}}}\n')
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return out


def load(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Events of a merged trace; if ``path`` is absent, merge its per-rank files first."""
    p = Path(path)
    if not p.exists():
        files = rank_files(p)
        if not files:
            raise FileNotFoundError(
                f"{p}: no such trace, and no per-rank files {rank_path(p, 0).name}, ... next to "
                "it; record one with Strategy(timeline=...) or LONGBOAT_TIMELINE"
            )
        merge(files, p)
    return list(read_events(p))
