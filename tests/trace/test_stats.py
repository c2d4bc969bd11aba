"""Overlap statistics on synthetic traces whose answer is known by construction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from longboat.trace import Recorder, load, merge, rank_path, rank_stats
from longboat.trace.stats import intersect, subtract, union


def _lanes(pid: int, names: dict[int, str]) -> list[dict[str, Any]]:
    return [
        {"ph": "M", "pid": pid, "tid": t, "name": "thread_name", "args": {"name": n}}
        for t, n in names.items()
    ]


def _x(pid: int, tid: int, name: str, ts: float, dur: float, cat: str = "compute") -> dict:
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "cat": cat}


def synthetic() -> list[dict[str, Any]]:
    """Two steps of 20 ms (µs in the trace). Per step: forward 0-4, backward 4-10, comm0 busy
    6-12 and comm1 8-14 (union 6-14 = 8 ms, of which 6-10 = 4 ms under backward), optimizer
    14-15, data 17-18; idle = 10 ms of the window [0, 38]... computed below."""
    events = _lanes(0, {0: "compute", 1: "comm0", 2: "comm1", 100: "optimizer", 101: "data"})
    for step in range(2):
        t = step * 20_000.0
        events += [
            _x(0, 0, "forward", t + 0, 4_000),
            _x(0, 0, "backward", t + 4_000, 6_000),
            _x(0, 1, "allreduce b0", t + 6_000, 6_000, "comm"),
            _x(0, 2, "allreduce b1", t + 8_000, 6_000, "comm"),
            _x(0, 0, "wait allreduce", t + 10_000, 4_000, "wait"),
            _x(0, 100, "optimizer step", t + 14_000, 1_000, "optimizer"),
            _x(0, 101, "next batch", t + 17_000, 1_000, "data"),
        ]
    return events


def test_overlap_statistics_match_construction() -> None:
    (s,) = rank_stats(synthetic())
    assert s.steps == 2 and s.step_ms == pytest.approx(20.0)
    assert s.window_ms == pytest.approx(38.0)  # 0 .. 20 + 18
    assert s.compute_ms == pytest.approx(2 * 11.0)  # forward + backward + optimizer
    assert s.comm_ms == pytest.approx(2 * 8.0)
    assert s.hidden_ms == pytest.approx(2 * 4.0)
    assert s.hidden_fraction == pytest.approx(0.5)
    assert s.exposed_comm_ms == pytest.approx(2 * 4.0)
    assert s.data_ms == pytest.approx(2 * 1.0)
    # busy per step: 0-15 and 17-18 -> idle 15-17 in each step, plus 18-20 in the first
    assert s.idle_ms == pytest.approx(2 + 2 + 2)


def test_no_overlap_and_full_overlap() -> None:
    lanes = _lanes(3, {0: "compute", 1: "comm0"})
    serial = lanes + [_x(3, 0, "backward", 0, 10), _x(3, 1, "allreduce b0", 10, 5, "comm")]
    hidden = lanes + [_x(3, 0, "backward", 0, 10), _x(3, 1, "allreduce b0", 2, 5, "comm")]
    assert rank_stats(serial)[0].hidden_fraction == 0.0
    assert rank_stats(hidden)[0].hidden_fraction == 1.0
    assert rank_stats(serial)[0].idle_ms == 0.0


def test_interval_helpers() -> None:
    assert union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert intersect([(0, 3), (5, 8)], [(2, 6)]) == [(2, 3), (5, 6)]


def test_recorder_files_merge_and_cli(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    for rank in (0, 1):
        rec = Recorder(path, rank, 2, comm_lanes=1)
        with rec.span("compute", "forward"):
            pass
        rec.complete("comm0", "allreduce b0", rec.now(), rec.now() + 5.0, "comm", {"bytes": 4})
        rec.instant("compute", "bucket 0 ready")
        rec._saved = True  # write only this rank's file (no merge by "rank 0")
        rank_path(path, rank).write_text(
            json.dumps({"traceEvents": rec.events(), "otherData": {"lanes": rec.lanes}})
        )
    assert not path.exists()
    events = load(path)  # merges the per-rank files
    assert path.exists() and {e["pid"] for e in events} == {0, 1}
    assert min(e["ts"] for e in events if "ts" in e) == 0
    merge([rank_path(path, 1)], tmp_path / "one.json")
    assert_timeline_cli_works(path, tmp_path / "o.png")


def assert_timeline_cli_works(trace: Path, picture: Path) -> None:
    """``longboat timeline TRACE -o PICTURE`` succeeds, prints statistics, draws the picture."""
    out = subprocess.run(
        [sys.executable, "-m", "longboat", "timeline", str(trace), "-o", str(picture)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "hidden" in out.stdout and picture.stat().st_size > 0


def test_cli_names_a_missing_trace(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "longboat", "timeline", str(tmp_path / "nope.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "no per-rank files" in out.stdout


def test_ps_lanes_are_communication_and_waits_are_not_compute() -> None:
    """A PS trainer: forward 0-10 ms blocked 2-6 ms on a lookup pull (ps lane), a push on ps1
    at 7-9 under forward compute and one at 12-14 during the step (10-15, neither compute nor
    comm). compute = 0-2 + 6-10; comm = 2-6 + 7-9 + 12-14; hidden = 7-9."""
    events = _lanes(0, {0: "compute", 100: "optimizer", 102: "ps", 201: "ps1"}) + [
        _x(0, 0, "forward", 0, 10_000),
        _x(0, 0, "wait pull", 2_000, 4_000, "wait"),
        _x(0, 102, "pull s0", 2_000, 4_000, "ps"),
        _x(0, 201, "push s1", 7_000, 2_000, "ps"),
        _x(0, 100, "optimizer step", 10_000, 5_000, "step"),
        _x(0, 102, "push s0", 12_000, 2_000, "ps"),
    ]
    (s,) = rank_stats(events)
    assert s.compute_ms == pytest.approx(6.0)
    assert s.comm_ms == pytest.approx(8.0)
    assert s.hidden_ms == pytest.approx(2.0) and s.exposed_comm_ms == pytest.approx(6.0)
    assert s.idle_ms == pytest.approx(3.0)  # 10-12 and 14-15: inside the step, no call out


def test_subtract() -> None:
    assert subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert subtract([(0, 10), (20, 30)], [(8, 22)]) == [(0, 8), (22, 30)]
    assert subtract([(0, 10)], [(-5, 15)]) == [] and subtract([(0, 1)], []) == [(0, 1)]
