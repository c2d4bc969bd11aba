"""Failure reports without a launch: ordering rules, exit sightings, and the console text."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from longboat.launch.exit_watch import ExitWatch
from longboat.launch.exits import RAISE_MARGIN_S, GroupFailure, RankExit, WorkerEnd, classify
from longboat.launch.summary import failure_summary, last_line_with, restart_line
from longboat.launch.supervisor import Restart

SIGKILL, SIGTERM = -int(signal.SIGKILL), -int(signal.SIGTERM)


def end(rank, code, seen=None, raised=None, stopped=False):
    return WorkerEnd(rank, code, seen, raised, stopped)


def test_a_rank_the_launcher_stopped_is_not_a_failure():
    # rank 1 killed; rank 0 reacted (wrote its error file a hair before rank 1's exit was seen)
    # and was stopped by the launcher while exiting
    report = classify([end(0, SIGTERM, 100.09, 99.995, stopped=True), end(1, SIGKILL, 100.0)])
    assert [c.rank for c in report.causes] == [1]
    assert report.first.how() == "was killed by SIGKILL"
    assert [(s.rank, s.ending()) for s in report.stopped] == [(0, "SIGTERM")]


def test_failures_are_ordered_by_exit_sighting_not_rank_or_error_file():
    ends = [end(0, 1, 100.2), end(1, 3, 100.05), end(2, 1, 100.1), end(3, SIGTERM, stopped=True)]
    report = classify(ends)
    assert [c.rank for c in report.causes] == [1, 2, 0]
    assert report.first.how() == "exited with code 3"
    assert [s.rank for s in report.stopped] == [3]


def test_one_sighting_puts_a_signal_death_first():
    report = classify([end(0, 1, 100.0, raised=99.99), end(1, SIGKILL, 100.0)])
    assert [c.rank for c in report.causes] == [1, 0]


def test_a_rank_that_raised_first_goes_first_even_if_it_exited_last():
    # rank 2 raised, then took long to exit; rank 0 reacted (raised later) and exited first
    ends = [end(0, 1, 100.3, raised=100.2), end(1, 0, 100.4), end(2, SIGTERM, 100.5, 100.1, True)]
    report = classify(ends)
    assert [c.rank for c in report.causes] == [2, 0]
    assert report.first.how() == "raised an error and was then stopped by the launcher"
    assert report.stopped == ()


def test_an_error_file_beats_a_bare_exit_only_by_the_margin():
    near = classify([end(0, SIGTERM, 101, 100.0 - RAISE_MARGIN_S / 2, True), end(1, 5, 100.0)])
    assert near.first.rank == 1
    far = classify([end(0, SIGTERM, 101, 100.0 - 2 * RAISE_MARGIN_S, True), end(1, 5, 100.0)])
    assert far.first.rank == 0


def test_nothing_failed():
    assert classify([end(0, 0, 100.0), end(1, 0, 100.1)]) is None


def exited(proc: subprocess.Popen) -> None:
    """Wait for ``proc`` to exit, leaving its status to be read (as torch's agent would)."""
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)


def test_exit_watch_sees_exits_and_which_workers_were_still_running():
    procs = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(3)
    ]
    watch = ExitWatch({rank: p.pid for rank, p in enumerate(procs)})
    try:
        procs[1].kill()
        exited(procs[1])
        watch.stopping()  # rank 1 has exited: the launcher would stop ranks 0 and 2
        watch.stopping()  # only the first call counts
        procs[0].send_signal(signal.SIGTERM)
        procs[2].send_signal(signal.SIGTERM)
        for p in procs:
            exited(p)
        ends = {e.rank: e for e in watch.ends()}
    finally:
        watch.close()
        for p in procs:
            p.kill()
            p.wait()
    assert [ends[r].stopped for r in range(3)] == [True, False, True]
    assert [ends[r].exitcode for r in range(3)] == [SIGTERM, SIGKILL, SIGTERM]
    assert all(e.seen_at is not None for e in ends.values())
    assert ends[1].seen_at <= min(ends[0].seen_at, ends[2].seen_at)
    report = classify(ends.values())
    assert [c.rank for c in report.causes] == [1]
    assert [s.rank for s in report.stopped] == [0, 2]


@pytest.mark.parametrize("before", [0, 10, 5000, 70000])
def test_last_line_with_finds_the_last_match_far_from_the_end(tmp_path, before):
    log = tmp_path / "workerlog.1"
    lines = [f"line {i}" for i in range(before)]
    lines += ["[longboat] ERROR: old. Missing ranks: 2: [a]", "x" * 100]
    lines += ["[longboat] ERROR: new. Missing ranks: 0: [b]"] + [f"after {i}" for i in range(5000)]
    log.write_text("\n".join(lines) + "\n")
    assert (
        last_line_with(str(log), "Missing ranks:") == "[longboat] ERROR: new. Missing ranks: 0: [b]"
    )
    assert last_line_with(str(log), "not there") is None
    assert last_line_with(str(tmp_path / "missing"), "Missing ranks:") is None


def test_summary_orders_ranks_and_shows_the_stall_report(tmp_path: Path):
    report = GroupFailure(
        causes=(RankExit(1, 70), RankExit(2, SIGKILL)),
        stopped=(RankExit(0, SIGTERM, stopped=True), RankExit(3, 1, stopped=True)),
    )
    lines = ["[longboat] ERROR: rank 1 has waited 3.0 s. Missing ranks: 0: [barrier]"]
    lines += [f"later line {i}" for i in range(30)]
    (tmp_path / "workerlog.1").write_text("\n".join(lines) + "\n")
    (tmp_path / "workerlog.0").write_text('File "train.py", line 9 in <module>\n')
    text = failure_summary(report, str(tmp_path), "node7")
    out = text.splitlines()
    assert out[0] == (  # rank 1 waited for rank 0: rank 0 is where to look
        "longboat launch: rank 0 stopped responding (the stall report below names it missing; "
        "look at its logs); waiting for it, rank 1 exited with code 70 on host node7"
    )
    assert out[1] == "then: rank 2 was killed by SIGKILL"
    assert out[2] == (
        "stopped by the launcher as a consequence: rank 0 (SIGTERM), rank 3 (exit code 1)"
    )
    assert out[3].startswith('--- stall report of rank 1 (last "Missing ranks:" line of ')
    assert out[4] == lines[0]
    assert out[5].endswith("workerlog.0 (a rank the others waited for) ---")
    assert out[6] == 'File "train.py", line 9 in <module>'
    assert out[7].startswith("--- last 20 lines of ") and out[8:] == lines[-20:]


def test_summary_without_a_stall_report_leads_with_the_first_failure(tmp_path: Path):
    report = GroupFailure(causes=(RankExit(1, 1),), stopped=(RankExit(0, SIGTERM, stopped=True),))
    out = failure_summary(report, str(tmp_path), "node7").splitlines()
    assert out[0] == "longboat launch: rank 1 exited with code 1 on host node7"


def test_missing_ranks_are_read_from_a_stall_report():
    from longboat.launch.summary import missing_ranks

    line = "WARNING: rank 0 has waited 9.8 s (launch 4). Missing ranks: 1: [bias, w]; 3: [x]. Fix"
    assert missing_ranks(line) == [1, 3]
    assert missing_ranks("Missing ranks: none (all arrived; slow network?)") == []
    assert missing_ranks(None) == []


def test_restart_line():
    failure = GroupFailure((RankExit(1, 5),), (RankExit(0, SIGTERM, stopped=True),))
    line = restart_line(Restart(attempt=1, max_restarts=2, failure=failure, resume_s=1.234))
    assert line == (
        "longboat launch: restart attempt 1 of 2 after rank 1 exited with code 5 (stopped by the "
        "launcher: rank 0 (SIGTERM)); workers started again 1.23 s after the failure was seen"
    )


def test_an_error_file_is_in_place_only_once_complete(tmp_path, monkeypatch):
    """A rank stopped halfway through writing its error file must not leave half a JSON
    where the agent parses it (torch's ProcessFailure raises on it and the launcher dies)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from longboat.launch import bootstrap

    final = tmp_path / "1.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(final))
    assert bootstrap._write_error_files_aside() == str(final)
    aside = Path(os.environ["TORCHELASTIC_ERROR_FILE"])
    assert aside != final
    aside.write_text('{"message": {"mess')  # what SIGTERM mid-json.dump leaves
    assert ProcessFailure(0, 1, 1, str(final)).message  # the agent's parse survives it
    try:
        raise ValueError("boom")
    except ValueError as exc:
        bootstrap._record_failure(exc, str(final))
    assert ProcessFailure(0, 1, 1, str(final)).message["message"] == "ValueError: boom"
    assert not aside.exists()
