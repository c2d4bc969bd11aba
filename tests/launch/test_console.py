"""What the launcher's console says: the master it prints is the one the ranks use, a second
job into a busy log directory is refused by name, and Ctrl-C ends everything in one line."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch._launcher import rank_pids, run_launcher

CLUSTER_PROBE = """\
import longboat as lb

lb.init()
lb.shutdown()
"""

# every rank records its pid, says it is ready, then waits for the file `release` (or 120 s)
WAITER = """\
import os
import sys
import time
from pathlib import Path

import longboat as lb

out = Path(sys.argv[1])
lb.init()
(out / f"pid.{lb.rank()}").write_text(str(os.getpid()))
print(f"ready {sys.argv[2]}", flush=True)
deadline = time.monotonic() + 120
while not (out / "release").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
lb.shutdown()
"""


def test_banner_master_is_the_master_the_ranks_use(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(CLUSTER_PROBE)
    done = run_launcher(tmp_path, "--nproc-per-node", "2", str(probe))
    assert done.returncode == 0, done.stdout + done.stderr
    banner = re.search(r"^master: (\S+)$", done.stdout, re.M)
    cluster = re.search(r"longboat cluster: .* master=(\S+),", done.stdout)
    assert banner and cluster, done.stdout
    assert banner.group(1) == cluster.group(1)


def _start(cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "longboat", "launch", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )


def _wait_for(path: Path, count: int, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(list(path.glob("pid.*"))) < count:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.1)


def _end(proc: subprocess.Popen[str], pid_dirs: list[Path]) -> tuple[str, str, list[int]]:
    """Wait for the launcher; its output and the ranks it left running (killed now)."""
    left: list[int] = []
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for pid_dir in pid_dirs:
            left += rank_pids(pid_dir)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return out, err, left


@pytest.mark.slow  # a whole end-to-end run: the slow tier (CI runs it after the quick one)
def test_two_jobs_in_one_directory_keep_their_own_logs(tmp_path):
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    first_out, second_out = tmp_path / "first", tmp_path / "second"
    first_out.mkdir()
    second_out.mkdir()
    first = _start(tmp_path, "--nproc-per-node", "2", str(script), str(first_out), "first")
    try:
        _wait_for(first_out, 2, first)
        refused = run_launcher(tmp_path, "--nproc-per-node", "2", str(script), str(second_out), "x")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        lines = refused.stdout.splitlines()
        assert len(lines) == 1 and lines[0].startswith("longboat launch: log/ is in use"), lines
        assert f"pid {first.pid}" in lines[0] and "--log-dir" in lines[0]
        assert list(second_out.iterdir()) == []  # no rank of the refused job started
        (second_out / "release").touch()
        second = run_launcher(
            tmp_path,
            "--log-dir",
            "log2",
            "--nproc-per-node",
            "2",
            str(script),
            str(second_out),
            "second",
        )
        assert second.returncode == 0, second.stdout + second.stderr
    finally:
        (first_out / "release").touch()
        out, err, _ = _end(first, [first_out, second_out])
    assert first.returncode == 0, out + err
    assert "ready first" in out and "ready second" not in out
    assert "ready second" in second.stdout and "ready first" not in second.stdout
    assert "ready first" in (tmp_path / "log" / "workerlog.1").read_text()
    assert "ready second" in (tmp_path / "log2" / "workerlog.1").read_text()


def test_ctrl_c_ends_every_rank_with_one_line(tmp_path):
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    proc = _start(tmp_path, "--nproc-per-node", "2", str(script), str(tmp_path), "job")
    try:
        _wait_for(tmp_path, 2, proc)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole group
    finally:
        out, err, left = _end(proc, [tmp_path])
    assert proc.returncode == 128 + signal.SIGINT, out + err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, out + err
    assert out.splitlines()[-1] == "longboat launch: stopped by SIGINT; 2 ranks ended, logs in log/"
    assert left == []
