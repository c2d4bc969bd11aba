"""Stall inspector on Gloo: a late rank is named with the tensors it is missing; shutdown exits."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from longboat.trace.stall import STALL_EXIT_CODE, finished, missing_report
from tests._dist import run_ranks
from tests.trace.stall_probe import train

PROBE = Path(__file__).with_name("stall_probe.py")
PARAMS = ["0.weight", "0.bias", "2.weight", "2.bias"]


def _warned(rank: int, world_size: int) -> list[str]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("longboat.stall").addHandler(Keep(logging.WARNING))
    train(sleep_s=5.0, warning_s=2.0, shutdown_s=0.0)
    return records


def test_late_rank_is_named_with_its_missing_tensors() -> None:
    warned = run_ranks(_warned, 2, timeout=120)
    assert warned[1] == []  # rank 1 never waited
    assert warned[0], "rank 0 waited 5 s with stall_warning_seconds=2 but logged no warning"
    text = warned[0][0]
    assert text.startswith("rank 0 has waited ")
    assert "for the allreduce of bucket 0" in text
    missing = text.split("Missing ranks: ", 1)[1]
    assert missing.startswith("1: [")  # rank 1, and only rank 1
    assert all(name in missing for name in PARAMS)  # one bucket: all of it is missing
    assert "raise stall_warning_seconds" in text


def test_stall_shutdown_ends_the_job_non_zero(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "longboat", "launch", "--nproc-per-node", "2"]
    cmd += ["--log-dir", str(tmp_path / "log"), str(PROBE), "60", "2", "4"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert f"rank 0 exited with code {STALL_EXIT_CODE}" in text  # the launcher names it
    assert "Missing ranks: 1: [" in text
    assert "stall_shutdown_seconds=4" in text


def test_missing_report_spans_buckets_and_unpublished_ranks() -> None:
    buckets = [["c.weight"], ["b.weight"], ["a.weight"]]
    # waiting on launch 6 (bucket 2 of the second step); rank 1 launched 4 (bucket 0 of it)
    text = missing_report(6, {0: 6, 1: 4, 2: None, 3: 6}, buckets)
    assert text == (
        "Missing ranks: 1: [b.weight, a.weight]; 2: [no progress published: not started, or dead]"
    )
    assert missing_report(3, {0: 3, 1: 3}, buckets).endswith("none (all arrived; slow network?)")


@pytest.mark.parametrize("value", [True, False])
def test_finished_reads_future_state(value: bool) -> None:
    import torch

    f: torch.futures.Future = torch.futures.Future()
    if value:
        f.set_result(None)
    assert finished(f) is value
