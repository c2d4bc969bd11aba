"""Timeline recorder: Chrome trace events, one file per rank, merged into one trace.

Each rank is a process (``pid`` = rank) and each lane a thread of it: ``compute`` (forward,
backward, bucket-ready marks, waits), ``comm0..K`` (one per communicator), ``optimizer``,
``data`` and ``ps`` (a parameter-server trainer's calls; ``ps1``, ``ps2``... for calls in
flight at once). The merged file opens in Perfetto (ui.perfetto.dev) or chrome://tracing.

Recording appends a tuple to a list (thread-safe under the GIL, no lock, no I/O); the file is
written once, when the process exits (or on ``save()``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from longboat.log import get_logger

log = get_logger("longboat.trace")

#: how long rank 0 waits at exit for the other ranks' files before merging what it has
MERGE_WAIT_S = 10.0

FIXED_LANES = ("compute", "optimizer", "data", "ps")
_TID = {"compute": 0, "optimizer": 100, "data": 101, "ps": 102}


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


class Recorder:
    """Collects this rank's events; ``save()`` writes them (and merges, on rank 0)."""

    def __init__(self, path: str | os.PathLike[str], rank: int, world_size: int, comm_lanes: int):
        self.path = Path(path)
        self.rank = rank
        self.world_size = world_size
        self.lanes = ["compute", *(comm_lane(k) for k in range(comm_lanes)), *FIXED_LANES[1:]]
        self._events: list[tuple[Any, ...]] = []
        self._wall0_us = time.time_ns() / 1e3
        self._perf0_ns = time.perf_counter_ns()
        self._saved = False
        with contextlib.suppress(FileNotFoundError):
            rank_path(self.path, rank).unlink()  # a previous run's file must not be merged

    def add_lane(self, lane: str) -> None:
        """Declare another lane (named in the trace's metadata)."""
        if lane not in self.lanes:
            self.lanes.append(lane)

    def now(self) -> float:
        """Microseconds since the epoch, with perf_counter resolution."""
        return self._wall0_us + (time.perf_counter_ns() - self._perf0_ns) / 1e3

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
        self._events.append(("X", lane, name, start_us, end_us - start_us, cat, args))

    def instant(self, lane: str, name: str, args: dict[str, Any] | None = None) -> None:
        """A mark on ``lane`` now."""
        self._events.append(("i", lane, name, self.now(), 0.0, "mark", args))

    @contextlib.contextmanager
    def span(self, lane: str, name: str, cat: str = "compute", **args: Any) -> Iterator[None]:
        """Record the body as a span on ``lane``."""
        start = self.now()
        try:
            yield
        finally:
            self.complete(lane, name, start, self.now(), cat, args or None)

    def events(self) -> list[dict[str, Any]]:
        """This rank's events in Chrome trace format, with process/thread names."""
        pid = self.rank
        out: list[dict[str, Any]] = [
            {
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "name": "process_name",
                "args": {"name": f"rank {pid}"},
            },
            {
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "name": "process_sort_index",
                "args": {"sort_index": pid},
            },
        ]
        for lane in self.lanes:
            tid = lane_tid(lane)
            out.append(
                {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": lane}}
            )
            out.append(
                {
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "name": "thread_sort_index",
                    "args": {"sort_index": tid},
                }
            )
        for ph, lane, name, ts, dur, cat, args in list(self._events):
            event: dict[str, Any] = {
                "ph": ph,
                "pid": pid,
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
            out.append(event)
        return out

    def save(self) -> Path | None:
        """Write this rank's file; rank 0 then merges every rank's into ``path``. Idempotent."""
        if self._saved:
            return None
        self._saved = True
        mine = rank_path(self.path, self.rank)
        _write_json(mine, _document(self.events(), self.world_size, self.lanes))
        if self.rank != 0:
            return mine
        files = _wait_for_ranks(self.path, self.world_size, MERGE_WAIT_S)
        missing = [r for r, f in enumerate(files) if f is None]
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
        merged = merge([f for f in files if f is not None], self.path)
        log.info(
            "timeline: wrote %s (%d ranks); open it in https://ui.perfetto.dev",
            merged,
            len(files) - len(missing),
        )
        return merged


def _document(events: list[dict[str, Any]], world_size: int, lanes: Sequence[str]) -> dict:
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "longboat", "world_size": world_size, "lanes": list(lanes)},
    }


def _write_json(path: Path, doc: dict) -> None:
    """Write atomically, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":")))
    os.replace(tmp, path)


def _wait_for_ranks(path: Path, world_size: int, timeout: float) -> list[Path | None]:
    deadline = time.monotonic() + timeout
    while True:
        files = [rank_path(path, r) for r in range(world_size)]
        found = [f if f.exists() else None for f in files]
        if all(found) or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def rank_files(path: str | os.PathLike[str]) -> list[Path]:
    """The per-rank files next to ``path`` (``trace.rank*.json``), by rank."""
    p = Path(path)
    found = p.parent.glob(f"{p.stem}.rank*{p.suffix or '.json'}")
    ranked = []
    for f in found:
        tag = f.name[len(p.stem) + len(".rank") :].split(".")[0]
        if tag.isdigit():
            ranked.append((int(tag), f))
    return [f for _, f in sorted(ranked)]


def merge(files: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> Path:
    """Merge per-rank trace files into ``out``; time 0 is the earliest event of any rank."""
    events: list[dict[str, Any]] = []
    lanes: list[str] = []
    for f in files:
        doc = json.loads(Path(f).read_text())
        events += doc["traceEvents"]
        lanes += [x for x in doc.get("otherData", {}).get("lanes", []) if x not in lanes]
    origin = min((e["ts"] for e in events if "ts" in e), default=0.0)
    for e in events:
        if "ts" in e:
            e["ts"] = round(e["ts"] - origin, 3)
    out = Path(out)
    _write_json(out, _document(events, len(files), lanes))
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
    doc = json.loads(p.read_text())
    return doc["traceEvents"] if isinstance(doc, dict) else doc
