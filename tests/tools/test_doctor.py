"""`longboat doctor`: topology parsing, interface and port checks in a test-made namespace, --comm."""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from longboat.launch import netns
from longboat.launch.local import launch_local
from longboat.tools import doctor

FIXTURE = Path(__file__).with_name("fixtures") / "nvidia_smi_topo.txt"


def test_topology_parser_reads_the_matrix_and_flags_slow_pairs() -> None:
    topo = doctor.parse_topo(FIXTURE.read_text())
    assert topo.devices == ["GPU0", "GPU1", "GPU2", "GPU3", "NIC0"]
    assert topo.gpus() == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert topo.links[("GPU0", "GPU1")] == "NV2" and topo.links[("GPU1", "GPU2")] == "NODE"
    assert topo.links[("GPU2", "GPU3")] == "PHB" and topo.links[("NIC0", "GPU1")] == "PIX"
    assert topo.affinity == {"GPU0": "0-23", "GPU1": "0-23", "GPU2": "24-47", "GPU3": "24-47"}
    check = doctor.topology_check(topo)
    assert check.status == doctor.WARN
    assert "GPU0-GPU3 SYS" in check.detail and "GPU1-GPU2 NODE" in check.detail
    assert "NV# = NVLink" in check.detail and "SYS = through PCIe and the SMP" in check.detail
    assert "GPU0-GPU1" not in check.detail.split("slow pairs:")[1]  # NVLink is not slow
    fast = doctor.parse_topo(FIXTURE.read_text().replace("SYS", "NV1").replace("NODE", "NV1"))
    assert doctor.topology_check(fast).status == doctor.PASS
    assert doctor.parse_topo("No devices were found").devices == []


def test_interface_checks_from_a_listing() -> None:
    ifaces = [
        doctor.Interface("lo", True, True, ["127.0.0.1"]),
        doctor.Interface("docker0", True, False, ["172.17.0.1"]),
        doctor.Interface("enp1s0", True, False, ["10.0.0.5"]),
    ]
    first, *_ = doctor.check_interfaces(ifaces, {})
    assert first.status == doctor.WARN and "docker0 172.17.0.1" in first.detail
    assert first.fix == "export GLOO_SOCKET_IFNAME=enp1s0 NCCL_SOCKET_IFNAME=enp1s0"
    bad = doctor.check_interfaces(ifaces, {"GLOO_SOCKET_IFNAME": "eth9"})
    assert [c.status for c in bad if c.name == "GLOO_SOCKET_IFNAME"] == [doctor.FAIL]
    virt = doctor.check_interfaces(ifaces, {"NCCL_SOCKET_IFNAME": "dock"})
    assert [c.status for c in virt if c.name == "NCCL_SOCKET_IFNAME"] == [doctor.WARN]
    good = doctor.check_interfaces(ifaces, {"NCCL_SOCKET_IFNAME": "enp"})
    assert [c.status for c in good] == [doctor.PASS, doctor.PASS]


def test_fixes_print_whole_lines_and_a_pass_gives_only_a_tip(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from longboat.tools.doctor.cli import render

    long_fix = "export GLOO_SOCKET_IFNAME=enp94s0f0np0 NCCL_SOCKET_IFNAME=enp94s0f0np0 && go"
    checks = [
        doctor.Check("interfaces", doctor.PASS, "eth0 recommended", long_fix),
        doctor.Check("hostname", doctor.WARN, "resolves to 127.0.0.1", "map it in /etc/hosts"),
        doctor.Check("torch", doctor.PASS, "ok"),
    ]
    monkeypatch.setenv("COLUMNS", "60")
    render(checks)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == ["fix hostname: map it in /etc/hosts", f"tip interfaces: {long_fix}"]
    single = doctor.check_omp({}, 1)
    assert "oversubscription)" in single.detail and "no oversubscription" in single.detail
    assert single.fix == ""


def test_omp_check_counts_agree_in_number() -> None:
    assert doctor.check_omp({"OMP_NUM_THREADS": "1"}, 1).detail.startswith("1 thread x 1 rank <")


def test_nccl_omp_and_pair_checks() -> None:
    nccl = doctor.check_nccl_env({"NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "INFO"})
    assert [(c.name, c.status) for c in nccl] == [
        ("NCCL_DEBUG", "INFO"),
        ("NCCL_IB_DISABLE", "WARN"),
    ]
    assert "RDMA" in nccl[1].detail
    cores = len(os.sched_getaffinity(0))
    assert doctor.check_omp({"OMP_NUM_THREADS": str(cores)}, 2).status == doctor.WARN
    assert doctor.check_omp({"OMP_NUM_THREADS": "1"}, 1).status == doctor.PASS
    pairs = {
        "node 0 <-> node 1": {"ok": True, "seconds": 0.01, "gbps": 1.0},
        "node 0 <-> node 2": {"ok": True, "seconds": 0.01, "gbps": 1.1},
        "node 1 <-> node 2": {"ok": True, "seconds": 0.1, "gbps": 0.1},
        "node 1 <-> node 3": {"ok": True, "seconds": 0.1, "gbps": 0.1},
        "node 2 <-> node 3": {"ok": False, "error": "timeout"},
    }
    out = {c.name: c for c in doctor.pair_checks(pairs, 16 << 20)}
    assert out["link node 0 <-> node 1"].status == doctor.PASS
    assert out["link node 1 <-> node 2"].status == doctor.WARN
    assert out["link node 2 <-> node 3"].status == doctor.FAIL
    assert out["slow node"].detail.startswith("node 1 is in every slow pair")


def _no_netns() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None if shutil.which("ip") and shutil.which("ss") else "needs iproute2 (ip, ss)"


@pytest.fixture
def namespace() -> Iterator[str]:
    """A namespace with a veth pair inside (veth0: virtual by name, eth7: the real-looking one);
    removed afterwards whatever happened (with anything still running in it)."""
    rid = secrets.token_hex(3)
    name = f"{netns.PREFIX}{rid}-doc"
    try:
        ip = ["ip", "-n", name]
        for cmd in (
            ["ip", "netns", "add", name],
            [*ip, "link", "set", "lo", "up"],
            [*ip, "link", "add", "veth0", "type", "veth", "peer", "name", "eth7"],
            [*ip, "addr", "add", "10.77.1.1/24", "dev", "veth0"],
            [*ip, "addr", "add", "10.77.0.1/24", "dev", "eth7"],
            [*ip, "link", "set", "veth0", "up"],
            [*ip, "link", "set", "eth7", "up"],
        ):
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)
        yield name
    finally:
        netns.cleanup_stale(f"{netns.PREFIX}{rid}", include_live=True)
        assert name not in netns.leftovers(f"{netns.PREFIX}{rid}")


@pytest.mark.skipif(_no_netns() is not None, reason=str(_no_netns()))
def test_doctor_flags_veth_and_a_taken_port_in_a_namespace(namespace: str) -> None:
    port = 29517
    holder_code = (
        f"import socket, time; s = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen(); "
        "print('ready', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", holder_code],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 30)
        assert ready and holder.stdout.readline().strip() == "ready"
        cmd = ["ip", "netns", "exec", namespace, sys.executable, "-m", "longboat", "doctor"]
        out = subprocess.run(
            [*cmd, "--json", "--port", str(port)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 1, out.stderr  # a FAIL: the taken port
        checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
        iface = checks["interfaces"]
        assert iface["status"] == "WARN" and "veth0 10.77.1.1" in iface["detail"]
        assert iface["data"]["recommended"] == "eth7"
        assert iface["fix"] == "export GLOO_SOCKET_IFNAME=eth7 NCCL_SOCKET_IFNAME=eth7"
        flagged = {i["name"]: i["virtual"] for i in iface["data"]["interfaces"]}
        assert flagged == {"lo": False, "veth0": True, "eth7": False}
        taken = checks["master port"]
        assert taken["status"] == "FAIL"
        assert f"port {port} is in use by python" in taken["detail"]
        assert f"pid {holder.pid}" in taken["detail"] and "--master HOST:PORT" in taken["fix"]
    finally:
        holder.kill()
        holder.wait(10)


def _comm(rank_env: None = None) -> list[dict]:
    return [c.__dict__ for c in doctor.comm_checks(size_bytes=1 << 16, repeats=2)]


def test_comm_measures_every_pair_under_the_launcher() -> None:
    out = launch_local(_comm, nproc=2, timeout=120)
    assert out[1] == []
    (pair,) = out[0]
    assert pair["name"] == "link rank 0 <-> rank 1" and pair["status"] == "PASS"
    assert pair["data"]["ok"] and pair["data"]["gbps"] > 0
