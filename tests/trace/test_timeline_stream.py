"""The timeline streams to disk: bounded memory over a long run, a killed rank's file still
loads and merges (up to its last flush)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest

from longboat.trace import rank_stats
from longboat.trace import recorder as recorder_mod
from longboat.trace.recorder import Recorder, finished, load, rank_path, read_events
from tests.trace.test_stats import assert_timeline_cli_works

pytestmark = pytest.mark.slow  # slow tier: timeline memory over a long run (soak)

BUCKETS = 4
EVENTS_PER_STEP = 5 + 2 * BUCKETS  # data, forward, backward, wait, optimizer + per bucket 2


def record_step(rec: Recorder, step: int) -> None:
    """One training step's events, as the observer records them."""
    with rec.span("data", "next batch", "data"):
        pass
    with rec.span("compute", "forward", step=step):
        pass
    start = rec.now()
    for b in range(BUCKETS):
        rec.instant("compute", f"bucket {b} ready", {"bucket": b})
    rec.complete("compute", "backward", start, rec.now(), args={"step": step})
    for b in range(BUCKETS):
        args = {"bucket": b, "bytes": 4096, "algorithm": "native", "step": step}
        rec.complete(f"comm{b % 2}", f"allreduce b{b}", start, rec.now(), "comm", args)
    rec.complete("compute", "wait allreduce", start, rec.now(), "wait")
    with rec.span("optimizer", "optimizer step", "optimizer", step=step):
        pass


def test_memory_stays_bounded_and_every_event_reaches_the_file(tmp_path: Path) -> None:
    steps = 20_000
    rec = Recorder(tmp_path / "t.json", 1, 2, comm_lanes=2)
    bound = 2 * rec.batch_events  # documented: at most 2 x BATCH_EVENTS events in memory
    tracemalloc.start()
    try:
        most = 0
        for step in range(1, steps + 1):
            record_step(rec, step)
            most = max(most, rec.buffered)
            assert rec.buffered <= bound
            if step == 2_000:
                early = tracemalloc.get_traced_memory()[0]
        grown = tracemalloc.get_traced_memory()[0] - early
    finally:
        tracemalloc.stop()
    # 18,000 more steps (~234,000 events) kept in memory would be ~80 MB
    assert grown < 16 * 2**20, grown
    rec.save()
    assert rec.buffered == 0 and finished(rec.file)
    doc = json.loads(rec.file.read_text())  # a closed rank file is one valid JSON array
    spans = [e for e in doc if e["ph"] != "M"]
    assert len(spans) == steps * EVENTS_PER_STEP
    forwards = [e["args"]["step"] for e in spans if e["name"] == "forward"]
    assert forwards == list(range(1, steps + 1))


def test_recording_thread_writes_when_the_writer_falls_behind(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "t.json", 0, 1, comm_lanes=1, batch_events=8)
    rec._stop.set()  # no background writer: only the hard bound empties the buffer
    rec._wake.set()
    for i in range(100):
        rec.instant("compute", f"mark {i}")
        assert rec.buffered < 16
    names = [e["name"] for e in read_events(rec.file) if e["ph"] == "i"]
    assert names == [f"mark {i}" for i in range(100 - rec.buffered)]


def test_background_writer_flushes_without_a_full_batch(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "t.json", 0, 1, comm_lanes=1, flush_interval_s=0.05)
    record_step(rec, 1)
    deadline = time.monotonic() + 60  # generous: only waits for the writer thread to run
    while rec.buffered and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rec.buffered == 0
    assert sum(e["ph"] != "M" for e in read_events(rec.file)) == EVENTS_PER_STEP
    assert not finished(rec.file)  # still open: readable all the same


def test_the_merge_line_counts_one_rank_in_the_singular(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rec = Recorder(tmp_path / "t.json", 0, 1, comm_lanes=1)
    record_step(rec, 1)
    with caplog.at_level(logging.INFO, logger="longboat"):
        assert rec.save() is not None
    assert "(1 rank); open it in" in caplog.text


_KILLED = """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from tests.trace.test_timeline_stream import record_step
    from longboat.trace.recorder import Recorder

    rec = Recorder({path!r}, 1, 2, comm_lanes=2, flush_interval_s=3600)
    for step in range(1, {flushed} + 1):
        record_step(rec, step)
    rec.flush()
    for step in range({flushed} + 1, {flushed} + 11):
        record_step(rec, step)  # buffered only: lost with the process
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_killed_rank_trace_loads_and_merges(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "trace.json"
    flushed = 50
    script = textwrap.dedent(_KILLED).format(
        root=str(Path(__file__).resolve().parents[2]), path=str(path), flushed=flushed
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    killed = rank_path(path, 1)
    assert not finished(killed)
    with open(killed, "a", encoding="utf-8") as f:
        f.write(',\n{"ph":"X","pid":1,"tid":0,"name":"forw')  # torn by the kill mid-write
    forwards = [e for e in read_events(killed) if e.get("name") == "forward"]
    assert [e["args"]["step"] for e in forwards] == list(range(1, flushed + 1))

    monkeypatch.setattr(recorder_mod, "MERGE_WAIT_S", 0.1)
    rec = Recorder(path, 0, 2, comm_lanes=2)
    for step in range(1, 4):
        record_step(rec, step)
    assert rec.save() == path  # rank 0 merges its own file and the killed rank's
    events = json.loads(path.read_text())["traceEvents"]
    assert events == load(path)
    assert min(e["ts"] for e in events if "ts" in e) == 0
    stats = {s.rank: s for s in rank_stats(events)}
    assert stats[0].steps == 3 and stats[1].steps == flushed
    lanes = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"compute", "comm0", "comm1", "optimizer", "data"} <= lanes

    assert_timeline_cli_works(path, tmp_path / "o.png")


def test_unfinished_files_merge_on_demand(tmp_path: Path) -> None:
    """No merged file (rank 0 died too): ``load`` merges the open per-rank files, not a previous
    run's merged trace or its files of ranks beyond this run's world size."""
    path = tmp_path / "trace.json"
    for old in (path, rank_path(path, 2)):
        old.write_text('{"traceEvents":[{"ph":"X","pid":2,"tid":0,"name":"old","ts":0,"dur":1}]}')
    recs = [Recorder(path, r, 2, comm_lanes=2) for r in (0, 1)]
    assert not path.exists() and not rank_path(path, 2).exists()
    for rec in recs:
        record_step(rec, 1)
        rec.flush()
    assert not path.exists()
    events = load(path)
    assert {e["pid"] for e in events} == {0, 1}
    assert sum(e["ph"] == "X" for e in events) == 2 * (EVENTS_PER_STEP - BUCKETS)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_does_not_write_the_parents_file(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "t.json", 0, 1, comm_lanes=1, flush_interval_s=3600)
    record_step(rec, 1)
    pid = os.fork()
    if pid == 0:  # the child: a DataLoader worker, say
        code = int(rec.flush() != 0 or rec.save() is not None)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    rec.save()
    assert sum(e["ph"] != "M" for e in json.loads(rec.file.read_text())) == EVENTS_PER_STEP
