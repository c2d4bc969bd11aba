"""Cluster discovery from launcher environments, host lists, topology, single-process lifecycle."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist

import longboat.cluster as lc
from longboat.cluster import ClusterError, ClusterInfo, Topology, discover
from longboat.cluster.env import DERIVED_PORT_BASE, DERIVED_PORT_SPAN
from longboat.cluster.topology import decode_key, encode_key

LAUNCHER_PREFIXES = ("PADDLE_", "HOROVOD_", "SLURM_", "OMPI_", "PMIX_", "LONGBOAT_")
LAUNCHER_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
)

TORCH = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
}
PADDLE = {
    "PADDLE_TRAINER_ID": "3",
    "PADDLE_TRAINERS_NUM": "4",
    "PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:6170,10.0.0.1:6171,10.0.0.2:6170,10.0.0.2:6171",
    "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:6171",
}
HOROVOD = {
    "HOROVOD_RANK": "2",
    "HOROVOD_SIZE": "4",
    "HOROVOD_LOCAL_RANK": "0",
    "HOROVOD_LOCAL_SIZE": "2",
    "HOROVOD_CROSS_RANK": "1",
    "HOROVOD_CROSS_SIZE": "2",
    "HOROVOD_HOSTNAME": "gpu2",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.9",
    "HOROVOD_GLOO_RENDEZVOUS_PORT": "40000",
    "HOROVOD_CONTROLLER": "gloo",
}
SLURM = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "6",
    "SLURM_NTASKS": "7",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "3",
    "SLURM_NNODES": "4",
    "SLURM_NODELIST": "node[01-03,07]",
    "SLURM_TASKS_PER_NODE": "2(x3),1",
    "SLURMD_NODENAME": "node07",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "MASTER_ADDR": "host-a",
    "MASTER_PORT": "23456",
}


def with_(base: dict[str, str], drop: tuple[str, ...] = (), **changes: str) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in drop}
    env.update(changes)
    return env


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher variables in os.environ, and no longboat state before or after."""
    for name in list(os.environ):
        if name in LAUNCHER_NAMES or name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    lc.shutdown()
    yield monkeypatch
    lc.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


# --- host lists -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("a[1-3]", ["a1", "a2", "a3"]),
        ("n[001-002,005],x", ["n001", "n002", "n005", "x"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("single", ["single"]),
        ("c[8-11]", ["c8", "c9", "c10", "c11"]),
        ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
        ("gpu[3],cpu[1-2].lab", ["gpu3", "cpu1.lab", "cpu2.lab"]),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert lc.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "a[1-3", "a]1[", "a[3-1]", "a[x-2]", "a,,b", "a[1-[2]]"])
def test_expand_hostlist_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="host list"):
        lc.expand_hostlist(text)


@pytest.mark.parametrize(
    ("text", "counts"),
    [("2(x3),1", [2, 2, 2, 1]), ("2(x2)", [2, 2]), ("4", [4]), ("1,3(x2),2", [1, 3, 3, 2])],
)
def test_expand_tasks_per_node(text: str, counts: list[int]) -> None:
    assert lc.expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["2(x)", "x", "2(3)", ""])
def test_expand_tasks_per_node_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="tasks-per-node"):
        lc.expand_tasks_per_node(text)


# --- discover: one source each ---------------------------------------------------------------


def test_discover_nothing_is_single() -> None:
    info = discover({"PATH": "/bin", "HOME": "/root"})
    assert info == ClusterInfo(0, 1, 0, 1, 0, 1, "127.0.0.1", 0, "single")


def test_discover_torchrun() -> None:
    info = discover(TORCH)
    assert info == ClusterInfo(
        5, 8, 1, 4, 1, 2, "10.0.0.1", 29500, "torch", backend=None, node_key="node:1"
    )


def test_discover_torch_without_node_variables_derives_them() -> None:
    info = discover(with_(TORCH, drop=("GROUP_RANK", "GROUP_WORLD_SIZE")))
    assert (info.node_rank, info.num_nodes, info.node_key) == (1, 2, None)


def test_discover_torch_longboat_node_variables() -> None:
    env = with_(
        TORCH,
        drop=("GROUP_RANK", "GROUP_WORLD_SIZE"),
        LONGBOAT_NODE_RANK="0",
        LONGBOAT_NNODES="3",
        LOCAL_WORLD_SIZE="2",
    )
    info = discover(env)
    assert (info.node_rank, info.num_nodes, info.node_key) == (0, 3, "node:0")


def test_discover_paddle() -> None:
    info = discover(PADDLE)
    assert info == ClusterInfo(3, 4, 1, 2, 1, 2, "10.0.0.1", 6170, "paddle", node_key="ip:10.0.0.2")


def test_discover_paddle_uneven_nodes() -> None:
    env = {
        "PADDLE_TRAINER_ID": "1",
        "PADDLE_TRAINERS_NUM": "3",
        "PADDLE_TRAINER_ENDPOINTS": "10.1.1.5:7000,10.1.1.7:7000,10.1.1.5:7001",
        "PADDLE_CURRENT_ENDPOINT": "10.1.1.7:7000",
    }
    info = discover(env)
    assert (info.local_rank, info.local_world_size, info.node_rank, info.num_nodes) == (0, 1, 1, 2)


def test_discover_horovod_uses_rendezvous_host_and_next_port() -> None:
    info = discover(HOROVOD)
    assert info == ClusterInfo(2, 4, 0, 2, 1, 2, "10.0.0.9", 40001, "horovod", node_key="node:1")


def test_discover_horovod_master_variables_win() -> None:
    info = discover(with_(HOROVOD, MASTER_ADDR="gpu1", MASTER_PORT="1234"))
    assert (info.master_addr, info.master_port) == ("gpu1", 1234)


def test_discover_slurm() -> None:
    info = discover(SLURM)
    port = DERIVED_PORT_BASE + 123456 % DERIVED_PORT_SPAN
    assert info == ClusterInfo(6, 7, 0, 1, 3, 4, "node01", port, "slurm", node_key="node:3")


def test_discover_slurm_hostlist_and_tasks_forms() -> None:
    env = with_(
        SLURM,
        SLURM_PROCID="3",
        SLURM_NTASKS="6",
        SLURM_LOCALID="0",
        SLURM_NODEID="1",
        SLURM_NNODES="3",
        SLURM_NODELIST="n[001-002,005],x",
        SLURM_TASKS_PER_NODE="2(x2),2",
        MASTER_PORT="29400",
    )
    with pytest.raises(ClusterError, match="names 4 hosts"):
        discover(env)
    info = discover(with_(env, SLURM_NODELIST="n[001-002],x"))
    assert (info.master_addr, info.master_port) == ("n001", 29400)
    assert (info.local_rank, info.local_world_size, info.node_rank) == (0, 2, 1)


def test_discover_slurm_ntasks_per_node_and_master_addr() -> None:
    env = with_(
        SLURM,
        drop=("SLURM_TASKS_PER_NODE",),
        SLURM_PROCID="5",
        SLURM_NTASKS="8",
        SLURM_LOCALID="1",
        SLURM_NODEID="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_NODELIST="a[1-4]",
        MASTER_ADDR="login1",
    )
    info = discover(env)
    assert (info.local_world_size, info.master_addr) == (2, "login1")


def test_discover_slurm_prefers_step_variables() -> None:
    env = with_(
        SLURM,
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_NODELIST="node07",
        SLURM_STEP_TASKS_PER_NODE="2",
        SLURM_PROCID="1",
        SLURM_LOCALID="1",
        SLURM_NODEID="0",
    )
    info = discover(env)
    assert (info.world_size, info.num_nodes, info.master_addr) == (2, 1, "node07")


def test_discover_slurm_batch_script_is_not_a_step() -> None:
    """Outside srun (no SLURM_STEP_ID) the allocation's counts do not describe the ranks."""
    assert discover(with_(SLURM, drop=("SLURM_STEP_ID",))).source == "single"


def test_discover_openmpi() -> None:
    info = discover(OMPI)
    assert info == ClusterInfo(3, 4, 1, 2, 1, 2, "host-a", 23456, "openmpi")


def test_discover_openmpi_one_node_derives_a_shared_port() -> None:
    env = with_(
        OMPI,
        drop=("MASTER_ADDR", "MASTER_PORT"),
        OMPI_COMM_WORLD_LOCAL_SIZE="4",
        OMPI_MCA_orte_hnp_uri="3563585536.0;tcp://10.0.0.1:40123",
    )
    first = discover(env)
    other = discover(with_(env, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_LOCAL_RANK="0"))
    assert first.master_addr == "127.0.0.1"
    assert first.master_port == other.master_port
    assert DERIVED_PORT_BASE <= first.master_port < DERIVED_PORT_BASE + DERIVED_PORT_SPAN
    changed = discover(with_(env, OMPI_MCA_orte_hnp_uri="999.0;tcp://10.0.0.1:1"))
    assert changed.master_port != first.master_port


def test_derived_port_is_stable() -> None:
    """CRC-32 based, so the same in every process regardless of PYTHONHASHSEED."""
    assert lc.derived_port("prterun-host-123@1") == lc.derived_port("prterun-host-123@1")
    assert lc.derived_port("42") == DERIVED_PORT_BASE + 42


# --- discover: precedence ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("envs", "source"),
    [
        ((SLURM, TORCH), "torch"),
        ((OMPI, TORCH), "torch"),
        ((SLURM, PADDLE), "paddle"),
        ((OMPI, HOROVOD), "horovod"),
        ((OMPI, SLURM), "slurm"),
        ((OMPI, HOROVOD, PADDLE, SLURM, TORCH), "torch"),
    ],
)
def test_discover_precedence(envs: tuple[dict[str, str], ...], source: str) -> None:
    merged: dict[str, str] = {}
    for env in envs:
        merged.update(env)
    assert discover(merged).source == source


def test_torchrun_inside_slurm_uses_torch_values() -> None:
    info = discover({**SLURM, **TORCH})
    assert (info.rank, info.world_size, info.master_addr) == (5, 8, "10.0.0.1")


# --- discover: errors name the variable, its value and the fix --------------------------------


@pytest.mark.parametrize(
    ("env", "needles"),
    [
        (with_(TORCH, drop=("WORLD_SIZE",)), ["WORLD_SIZE is not set", "torchrun"]),
        ({"RANK": "0"}, ["WORLD_SIZE is not set"]),
        ({"LOCAL_RANK": "0"}, ["WORLD_SIZE is not set", "LOCAL_RANK"]),
        (with_(TORCH, RANK="8"), ["RANK=8", "WORLD_SIZE=8"]),
        (with_(TORCH, RANK="two"), ["RANK='two'", "not an integer"]),
        (with_(TORCH, RANK="-1"), ["RANK='-1'", ">= 0"]),
        (with_(TORCH, WORLD_SIZE="0"), ["WORLD_SIZE='0'", ">= 1"]),
        (with_(TORCH, LOCAL_RANK="4"), ["LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"]),
        (with_(TORCH, LOCAL_WORLD_SIZE="16"), ["LOCAL_WORLD_SIZE=16", "WORLD_SIZE=8"]),
        (with_(TORCH, drop=("MASTER_ADDR",)), ["MASTER_ADDR is not set"]),
        (with_(TORCH, MASTER_PORT="70000"), ["MASTER_PORT='70000'", "1-65535"]),
        (with_(TORCH, MASTER_PORT="http"), ["MASTER_PORT='http'", "not an integer"]),
        (with_(TORCH, LONGBOAT_NODE_RANK="0"), ["LONGBOAT_NODE_RANK=0", "GROUP_RANK=1"]),
        (with_(TORCH, GROUP_RANK="2"), ["node rank", "LONGBOAT_NODE_RANK"]),
        (
            with_(TORCH, drop=("GROUP_RANK", "GROUP_WORLD_SIZE"), LOCAL_WORLD_SIZE="3"),
            ["WORLD_SIZE=8", "LOCAL_WORLD_SIZE=3", "LONGBOAT_NNODES"],
        ),
        (with_(PADDLE, drop=("PADDLE_TRAINER_ENDPOINTS",)), ["PADDLE_TRAINER_ENDPOINTS is not"]),
        (with_(PADDLE, PADDLE_TRAINERS_NUM="3"), ["PADDLE_TRAINER_ID=3", "PADDLE_TRAINERS_NUM=3"]),
        (with_(PADDLE, PADDLE_TRAINERS_NUM="5"), ["lists 4 endpoints", "PADDLE_TRAINERS_NUM=5"]),
        (with_(PADDLE, PADDLE_CURRENT_ENDPOINT="10.0.0.1:6170"), ["PADDLE_CURRENT_ENDPOINT="]),
        (
            with_(PADDLE, PADDLE_TRAINER_ENDPOINTS="a,b,c,d"),
            ["PADDLE_TRAINER_ENDPOINTS entry 'a'", "ip:port"],
        ),
        (with_(HOROVOD, drop=("HOROVOD_CROSS_RANK",)), ["HOROVOD_CROSS_RANK is not set"]),
        (with_(HOROVOD, HOROVOD_LOCAL_RANK="2"), ["HOROVOD_LOCAL_RANK=2", "HOROVOD_LOCAL_SIZE=2"]),
        (
            with_(HOROVOD, drop=("HOROVOD_GLOO_RENDEZVOUS_ADDR",)),
            ["MASTER_ADDR is not set", "export MASTER_ADDR"],
        ),
        (with_(SLURM, SLURM_PROCID="7"), ["SLURM_PROCID=7", "SLURM_NTASKS=7"]),
        (with_(SLURM, drop=("SLURM_NNODES",)), ["SLURM_NNODES is not set", "srun"]),
        (with_(SLURM, SLURM_NODEID="4"), ["SLURM_NODEID=4", "SLURM_NNODES=4"]),
        (with_(SLURM, SLURM_LOCALID="1"), ["SLURM_LOCALID=1", "tasks on this node=1"]),
        (with_(SLURM, SLURM_TASKS_PER_NODE="2(x4)"), ["SLURM_TASKS_PER_NODE='2(x4)'", "8 tasks"]),
        (with_(SLURM, SLURM_TASKS_PER_NODE="2(y3)"), ["SLURM_TASKS_PER_NODE='2(y3)'", "bad"]),
        (with_(SLURM, SLURM_NODELIST="node[01-03"), ["SLURM_NODELIST='node[01-03'", "unclosed"]),
        (with_(SLURM, drop=("SLURM_JOB_ID",)), ["MASTER_PORT is not set", "export"]),
        (with_(OMPI, drop=("OMPI_COMM_WORLD_LOCAL_SIZE",)), ["OMPI_COMM_WORLD_LOCAL_SIZE is not"]),
        (with_(OMPI, OMPI_COMM_WORLD_LOCAL_SIZE="3"), ["OMPI_COMM_WORLD_SIZE=4", "map-by slot"]),
        (
            with_(OMPI, drop=("MASTER_ADDR", "MASTER_PORT")),
            ["MASTER_ADDR is not set", "export MASTER_ADDR"],
        ),
        (
            with_(OMPI, drop=("MASTER_PORT",), OMPI_COMM_WORLD_LOCAL_SIZE="4"),
            ["MASTER_PORT is not set"],
        ),
    ],
)
def test_discover_errors(env: dict[str, str], needles: list[str]) -> None:
    with pytest.raises(ClusterError) as caught:
        discover(env)
    for needle in needles:
        assert needle in str(caught.value)


def test_cluster_error_is_a_runtime_error() -> None:
    assert issubclass(ClusterError, RuntimeError)


# --- topology ---------------------------------------------------------------------------------


def test_topology_from_keys() -> None:
    topo = Topology.from_keys(["host:b", "host:a", "host:b", "host:c", "host:a"], rank=4)
    assert topo.node_of == (0, 1, 0, 2, 1)
    assert topo.nodes == 3
    assert topo.ranks_on_node(0) == [0, 2]
    assert topo.local_ranks() == [1, 4]
    assert topo.leaders() == [0, 1, 3]
    assert not topo.is_homogeneous
    assert Topology.from_keys(["node:1", "node:1", "node:0", "node:0"], 0).is_homogeneous
    with pytest.raises(ValueError, match="node 3 out of range"):
        topo.ranks_on_node(3)


@pytest.mark.parametrize("key", ["host:x", "ip:10.0.0.1", "node:17", "host:" + "é" * 100])
def test_node_key_roundtrip(key: str) -> None:
    packed = encode_key(key)
    assert packed.dtype == torch.uint8 and packed.shape == (258,)
    assert decode_key(packed) == key


def test_node_key_too_long_and_malformed() -> None:
    with pytest.raises(ValueError, match="longer than"):
        encode_key("host:" + "x" * 300)
    bad = torch.zeros(258, dtype=torch.uint8)
    bad[0] = 255
    with pytest.raises(ValueError, match="malformed"):
        decode_key(bad)


# --- single-process lifecycle ------------------------------------------------------------------


def test_accessors_before_init_read_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    assert (lc.rank(), lc.world_size(), lc.is_initialized()) == (0, 1, False)
    for name, value in TORCH.items():
        clean_env.setenv(name, value)
    assert (lc.rank(), lc.world_size(), lc.local_rank(), lc.local_world_size()) == (5, 8, 1, 4)
    assert (lc.node_rank(), lc.num_nodes(), lc.cluster().source) == (1, 2, "torch")
    with pytest.raises(ClusterError, match="before init"):
        lc.barrier()
    with pytest.raises(ClusterError, match="init"):
        lc.topology()


def test_single_process_init_and_shutdown_repeat(
    clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = object()
    for _ in range(2):
        with caplog.at_level(logging.INFO, logger="longboat"):
            info = lc.init(strategy)
        assert (info.source, info.world_size, info.backend) == ("single", 1, "gloo")
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert lc.init() is info
        assert lc.current_strategy() is strategy
        assert lc.topology() == Topology((0,), 0)
        t = torch.tensor([3.0])
        dist.all_reduce(t)
        assert t.item() == 3.0
        lc.barrier(timeout=5)
        assert any("cluster: 1 rank on 1 node, " in r.getMessage() for r in caplog.records)
        lc.shutdown()
        lc.shutdown()
        assert not lc.is_initialized() and not dist.is_initialized()
        assert lc.current_strategy() is None
        caplog.clear()


def test_init_adopts_an_existing_process_group(clean_env: pytest.MonkeyPatch) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    info = lc.init()
    assert (info.world_size, info.backend) == (1, "gloo")
    lc.shutdown()
    assert dist.is_initialized(), "shutdown must not destroy a group the user created"


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("LONGBOAT_BACKEND", "carrier-pigeon", "LONGBOAT_BACKEND='carrier-pigeon'"),
        ("LONGBOAT_TIMEOUT", "soon", "LONGBOAT_TIMEOUT='soon'"),
        ("LONGBOAT_TIMEOUT", "-3", "LONGBOAT_TIMEOUT='-3'"),
    ],
)
def test_init_rejects_bad_settings(
    clean_env: pytest.MonkeyPatch, name: str, value: str, needle: str
) -> None:
    clean_env.setenv(name, value)
    with pytest.raises(ClusterError) as caught:
        lc.init()
    assert needle in str(caught.value)
    assert not lc.is_initialized() and not dist.is_initialized()


def test_init_backend_argument_is_checked(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ClusterError, match="backend='nope'"):
        lc.init(backend="nope")
