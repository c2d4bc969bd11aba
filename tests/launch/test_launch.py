"""`longboat launch` end to end: real ranks through torch's elastic agent."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launch._launcher import Launched, run_launcher

PROBE = Path(__file__).with_name("launch_probe.py")
FAILURE_PROBE = Path(__file__).with_name("failure_probe.py")
RACE_LAUNCHES = 5


def launch(tmp_path: Path, *args: str, timeout: float = 90) -> Launched:
    return run_launcher(tmp_path, *args, timeout=timeout)


def results(out: Path, pattern: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(pattern))]


def test_two_ranks_allreduce_and_get_every_variable(tmp_path):
    done = launch(tmp_path, "--nproc-per-node", "2", str(PROBE), str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Configuration Arguments" in done.stdout and "Distributed Envs" in done.stdout
    ranks = results(tmp_path, "rank*.json")
    assert [r["sum"] for r in ranks] == [1.0, 1.0]
    endpoints = ranks[0]["PADDLE_TRAINER_ENDPOINTS"].split(",")
    assert len(endpoints) == 2 and len(set(endpoints)) == 2
    for rank, env in enumerate(ranks):
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == str(rank) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] and env["MASTER_PORT"]
        assert env["PADDLE_TRAINER_ID"] == str(rank) and env["PADDLE_TRAINERS_NUM"] == "2"
        assert env["PADDLE_CURRENT_ENDPOINT"] == endpoints[rank]
        assert env["FLAGS_selected_gpus"] == str(rank)
        assert env["HOROVOD_RANK"] == str(rank) and env["HOROVOD_SIZE"] == "2"
        assert env["HOROVOD_LOCAL_RANK"] == str(rank) and env["HOROVOD_LOCAL_SIZE"] == "2"
        assert env["HOROVOD_CROSS_RANK"] == "0" and env["HOROVOD_CROSS_SIZE"] == "1"
        assert env["OMP_NUM_THREADS"] == "1"  # 2 cores / 2 local ranks (unless CI set it)
    assert (tmp_path / "log" / "workerlog.0").exists() and (
        tmp_path / "log" / "workerlog.1"
    ).exists()


@pytest.mark.parametrize(
    ("action", "expected"),
    [("exit3", "rank 1 exited with code 3"), ("sigkill", "rank 1 was killed by SIGKILL")],
)
def test_failed_rank_stops_the_group_and_is_named(tmp_path, action, expected):
    done = launch(tmp_path, "--nproc-per-node", "2", str(PROBE), str(tmp_path), action, timeout=50)
    assert done.returncode != 0
    assert expected in done.stdout, done.stdout
    assert "last 20 lines of log/workerlog.1" in done.stdout
    if action == "exit3":
        assert "exiting with code 3 on purpose" in done.stdout
    # rank 0 sleeps 60 s then leaves a marker; the launcher (bounded at 50 s by `launch`) must
    # have stopped it first
    assert not (tmp_path / "survived0.json").exists()


@pytest.mark.slow  # slow tier: two whole launches
def test_two_launches_at_once_on_default_ports(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    procs = []
    for d in dirs:
        d.mkdir()
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "longboat",
                    "launch",
                    "--nproc-per-node",
                    "2",
                    str(PROBE),
                    str(d),
                ],
                cwd=d,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    for d in dirs:
        assert [r["sum"] for r in results(d, "rank*.json")] == [1.0, 1.0]


def test_taken_explicit_port_is_named(tmp_path):
    with socket.create_server(("0.0.0.0", 0)) as holder:
        port = holder.getsockname()[1]
        done = launch(
            tmp_path,
            "--master",
            f"127.0.0.1:{port}",
            "--nproc-per-node",
            "2",
            str(PROBE),
            str(tmp_path),
        )
    assert done.returncode != 0
    assert f"port {port} is already in use" in done.stdout
    if shutil.which("ss"):
        assert "python" in done.stdout  # the holder is this test process, named by ss


@pytest.mark.slow  # a whole end-to-end run: the slow tier (CI runs it after the quick one)
def test_parameter_server_roles(tmp_path):
    done = launch(tmp_path, "--servers", "2", "--workers", "2", str(PROBE), str(tmp_path), "ps")
    assert done.returncode == 0, done.stdout + done.stderr
    servers = results(tmp_path, "server*.json")
    trainers = results(tmp_path, "trainer*.json")
    assert len(servers) == 2 and len(trainers) == 2
    server_list = servers[0]["PADDLE_PSERVERS_IP_PORT_LIST"].split(",")
    assert all(t["seen"] == server_list for t in trainers)
    assert {t["TRAINING_ROLE"] for t in trainers} == {"TRAINER"}
    assert {s["TRAINING_ROLE"] for s in servers} == {"PSERVER"}
    assert sorted(t["PADDLE_TRAINER_ID"] for t in trainers) == ["0", "1"]
    assert (tmp_path / "log" / "serverlog.0").exists() and (
        tmp_path / "log" / "workerlog.1"
    ).exists()
    assert "trainer 0 reached every server" in done.stdout  # the console shows trainer 0
    assert "trainer 1 reached" not in done.stdout


def test_bad_option_is_explained(tmp_path):
    done = launch(tmp_path, "--nnodes", "2", str(PROBE))
    assert done.returncode == 2
    assert "--master HOST:PORT" in done.stdout


@pytest.mark.slow  # slow tier: restarts and kills ranks
def test_max_restarts_resumes_from_checkpoint_and_matches_uninterrupted(tmp_path):
    probe = str(Path(__file__).with_name("restart_probe.py"))
    finals = {}
    for name, extra in (("crashed", ["--max-restarts", "1"]), ("clean", [])):
        out = tmp_path / name
        out.mkdir()
        crash = ["4"] if name == "crashed" else []
        done = launch(
            out, "--nproc-per-node", "2", *extra, probe, str(out), "10", *crash, timeout=180
        )
        assert done.returncode == 0, done.stdout + done.stderr
        finals[name] = torch.load(out / "final.pt", weights_only=True)
        if name == "crashed":
            assert (
                "longboat launch: restart attempt 1 of 1 after rank 1 exited with code 5"
                in done.stdout
            ), done.stdout
            assert "workers started again" in done.stdout
            logs = (out / "log" / "workerlog.1").read_text()
            assert "resumed at step 5" in logs
            assert "crashes on purpose" in (out / "log" / "workerlog.1.attempt0").read_text()
    assert finals["crashed"].keys() == finals["clean"].keys()
    for key in finals["clean"]:
        torch.testing.assert_close(
            finals["crashed"][key], finals["clean"][key], rtol=1e-6, atol=1e-7
        )


def test_config_file_reaches_the_ranks(tmp_path):
    config = tmp_path / "strategy.yaml"
    config.write_text("nccl_comm_num: 2\n")
    done = launch(
        tmp_path, "--nproc-per-node", "2", "--config", str(config), str(PROBE), str(tmp_path)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert {r["LONGBOAT_CONFIG"] for r in results(tmp_path, "rank*.json")} == {str(config)}


def summary_of(done: Launched) -> list[str]:
    """The launcher's failure summary: its lines from the one naming the first failure."""
    lines = done.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("longboat launch: rank"))
    return lines[start:]


@pytest.mark.slow  # slow tier: restarts and kills ranks
def test_sigkilled_rank_is_named_before_the_rank_the_launcher_stopped(tmp_path):
    """Rank 1 SIGKILLs itself while rank 0 waits in an allreduce. Rank 0 then raises too
    ("Connection reset by peer") and is stopped by the launcher while exiting; whichever of
    the two the agent notices first, rank 1 is the failure and rank 0 the one stopped."""
    firsts, stopped = [], []
    for attempt in range(RACE_LAUNCHES):
        out = tmp_path / f"launch{attempt}"
        out.mkdir()
        done = run_launcher(
            out, "--nproc-per-node", "2", str(FAILURE_PROBE), str(out), "sigkill", pid_dir=out
        )
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.left_running == [], "ranks outlived the launcher"
        summary = summary_of(done)
        firsts.append(summary[0])
        stopped.append(summary[1])
        assert summary[2] == "--- last 20 lines of log/workerlog.1 ---"
        assert "rank 1 kills itself with SIGKILL" in summary[3:]
    host = socket.gethostname()
    assert firsts == [f"longboat launch: rank 1 was killed by SIGKILL on host {host}"] * len(firsts)
    assert stopped == ["stopped by the launcher as a consequence: rank 0 (SIGTERM)"] * len(stopped)


@pytest.mark.slow  # a real stall: the job's timeout has to pass
def test_a_hung_rank_is_named_first_with_where_it_hangs(tmp_path):
    """Rank 1 sleeps inside training; rank 0 times out waiting for it and exits. The summary
    leads with rank 1, not with rank 0 that waited, and shows rank 1's stack."""
    done = run_launcher(
        tmp_path,
        *("--nproc-per-node", "2", "--failure-timeout", "4"),
        *(str(FAILURE_PROBE), str(tmp_path), "hang"),
        pid_dir=tmp_path,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.left_running == []
    summary = summary_of(done)
    assert summary[0].startswith("longboat launch: rank 1 stopped responding"), summary[0]
    assert "rank 0 exited with code 1" in summary[0]
    hung = summary.index("--- last 20 lines of log/workerlog.1 (a rank the others waited for) ---")
    stack = summary[hung + 1 : summary.index("--- last 20 lines of log/workerlog.0 ---")]
    assert any("failure_probe.py" in line and "in <module>" in line for line in stack), stack


@pytest.mark.slow  # slow tier: a stalled launch
def test_stall_report_is_shown_even_far_from_the_end_of_the_log(tmp_path):
    done = run_launcher(
        tmp_path,
        "--nproc-per-node",
        "2",
        str(FAILURE_PROBE),
        str(tmp_path),
        "stall",
        pid_dir=tmp_path,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.left_running == []
    summary = summary_of(done)
    assert summary[0].startswith("longboat launch: rank 0 stopped responding")  # as reported
    assert "rank 1 exited with code 70 on host" in summary[0]
    label = summary.index(
        '--- stall report of rank 1 (last "Missing ranks:" line of log/workerlog.1) ---'
    )
    report = summary[label + 1]
    assert "ERROR" in report and "Missing ranks: 0: [barrier]" in report
    tail = summary[summary.index("--- last 20 lines of log/workerlog.1 ---") + 1 :]
    assert len(tail) == 20 and not any("Missing ranks:" in line for line in tail)


@pytest.mark.slow  # slow tier: two restarts of a launched group
def test_a_plain_torch_script_forms_its_group_again_after_each_restart(tmp_path):
    """Each restart's ranks get a store of their own: a script calling init_process_group
    itself no longer reads the dead ranks' addresses (Gloo's "Connection refused")."""
    probe = str(Path(__file__).with_name("plain_torch_restart_probe.py"))
    done = launch(tmp_path, "--nproc-per-node", "2", "--max-restarts", "2", probe, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "restart attempt 2 of 2" in done.stdout
    assert "attempt 2: sum 2" in (tmp_path / "log" / "workerlog.0").read_text()
