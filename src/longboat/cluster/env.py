"""Read the cluster from the environment: torchrun, Paddle, Horovod, Slurm, Open MPI, or nothing.

Each reader returns None when its launcher left no trace, a ClusterInfo when the description is
complete, and raises ClusterError (naming the variable, its value and the fix) when it is partial
or inconsistent. :func:`discover` asks them in precedence order; the first one present wins.

longboat's own ``LONGBOAT_*`` variables (`VARIABLES`, `variable`, `check_variables`) live in
`longboat.cluster.variables`; they are importable from here too.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Mapping

from longboat.cluster.hostlist import expand_hostlist, expand_tasks_per_node
from longboat.cluster.info import ClusterError, ClusterInfo, Source
from longboat.cluster.variables import VARIABLES, Variable, check_variables, variable

__all__ = [
    "DERIVED_PORT_BASE",
    "DERIVED_PORT_SPAN",
    "SINGLE",
    "VARIABLES",
    "Variable",
    "check_variables",
    "derived_port",
    "discover",
    "variable",
]

#: Ports derived from a job id fall in [DERIVED_PORT_BASE, DERIVED_PORT_BASE + DERIVED_PORT_SPAN),
#: below Linux's default ephemeral range (32768+), so the OS does not hand them out to clients.
DERIVED_PORT_BASE = 15000
DERIVED_PORT_SPAN = 15000

_TORCH_FIX = (
    "set all of RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
    "(torchrun and `longboat launch` do), or unset them all for a single process"
)
_PADDLE_FIX = (
    "set PADDLE_TRAINER_ID, PADDLE_TRAINERS_NUM, PADDLE_TRAINER_ENDPOINTS (ip:port per rank) "
    "and PADDLE_CURRENT_ENDPOINT consistently (paddle.distributed.launch does)"
)
_HOROVOD_FIX = (
    "launch with horovodrun, which sets HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, "
    "HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK and HOROVOD_CROSS_SIZE"
)
_SLURM_FIX = "start the ranks with `srun` inside the allocation (one task per rank)"
_OMPI_FIX = "start the ranks with `mpirun` (Open MPI), which sets OMPI_COMM_WORLD_*"
_MASTER_FIX = "export MASTER_ADDR (a host of rank 0) and MASTER_PORT (a free TCP port) to all ranks"


def _present(env: Mapping[str, str], *names: str) -> bool:
    return any(name in env for name in names)


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` that is set, as (name, value)."""
    for name in names:
        if name in env:
            return name, env[name]
    return None


def _require(env: Mapping[str, str], name: str, why: str, fix: str) -> str:
    value = env.get(name)
    if value is None or not value.strip():
        raise ClusterError(f"{name} is not set but {why}; {fix}")
    return value.strip()


def _to_int(name: str, value: str, fix: str, minimum: int = 0) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise ClusterError(f"{name}={value!r} is not an integer; {fix}") from None
    if number < minimum:
        raise ClusterError(f"{name}={value!r} must be >= {minimum}; {fix}")
    return number


def _int(env: Mapping[str, str], name: str, why: str, fix: str, minimum: int = 0) -> int:
    return _to_int(name, _require(env, name, why, fix), fix, minimum)


def _agreeing_int(env: Mapping[str, str], names: tuple[str, ...], fix: str) -> int | None:
    """The integer that every set variable among ``names`` agrees on, or None if none is set."""
    found = [(n, _to_int(n, env[n], fix)) for n in names if n in env]
    for name, value in found[1:]:
        if value != found[0][1]:
            raise ClusterError(
                f"{found[0][0]}={found[0][1]} and {name}={value} disagree; unset one of them"
            )
    return found[0][1] if found else None


def _check_below(lo_name: str, lo: int, hi_name: str, hi: int, fix: str) -> None:
    if lo >= hi:
        raise ClusterError(f"{lo_name}={lo} must be < {hi_name}={hi}; {fix}")


def _port(name: str, value: str, fix: str) -> int:
    port = _to_int(name, value, fix, minimum=1)
    if port > 65535:
        raise ClusterError(f"{name}={value!r} is not a TCP port (1-65535); {fix}")
    return port


def derived_port(token: str) -> int:
    """A port every rank computes alike from a shared job token (CRC-32, not Python's hash)."""
    token = token.strip()
    offset = int(token) if token.isdigit() else zlib.crc32(token.encode())
    return DERIVED_PORT_BASE + offset % DERIVED_PORT_SPAN


def _split_endpoint(name: str, endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host:
        raise ClusterError(f"{name} entry {endpoint!r} is not ip:port; {_PADDLE_FIX}")
    return host.strip("[]"), _port(name, port, _PADDLE_FIX)


def _from_torch(env: Mapping[str, str]) -> ClusterInfo | None:
    markers = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if not _present(env, *markers):
        return None
    why = "other torchrun variables (" + ", ".join(n for n in markers if n in env) + ") are"
    world = _int(env, "WORLD_SIZE", why, _TORCH_FIX, minimum=1)
    rank = _int(env, "RANK", why, _TORCH_FIX)
    _check_below("RANK", rank, "WORLD_SIZE", world, _TORCH_FIX)
    local_world = _int(env, "LOCAL_WORLD_SIZE", why, _TORCH_FIX, minimum=1)
    local_rank = _int(env, "LOCAL_RANK", why, _TORCH_FIX)
    _check_below("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world, _TORCH_FIX)
    if local_world > world:
        raise ClusterError(
            f"LOCAL_WORLD_SIZE={local_world} exceeds WORLD_SIZE={world}; {_TORCH_FIX}"
        )
    addr = _require(env, "MASTER_ADDR", why, _TORCH_FIX)
    port = _port("MASTER_PORT", _require(env, "MASTER_PORT", why, _TORCH_FIX), _TORCH_FIX)
    node_fix = "set LONGBOAT_NODE_RANK and LONGBOAT_NNODES to this node's index and node count"
    explicit_node = _agreeing_int(env, ("LONGBOAT_NODE_RANK", "GROUP_RANK"), node_fix)
    nodes = _agreeing_int(env, ("LONGBOAT_NNODES", "GROUP_WORLD_SIZE"), node_fix)
    if nodes is None:
        if world % local_world:
            raise ClusterError(
                f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}, "
                f"so the node count is unknown; {node_fix}"
            )
        nodes = world // local_world
    node = rank // local_world if explicit_node is None else explicit_node
    _check_below("node rank (LONGBOAT_NODE_RANK/GROUP_RANK)", node, "node count", nodes, node_fix)
    return ClusterInfo(
        rank,
        world,
        local_rank,
        local_world,
        node,
        nodes,
        addr,
        port,
        "torch",
        node_key=None if explicit_node is None else f"node:{explicit_node}",
    )


def _from_paddle(env: Mapping[str, str]) -> ClusterInfo | None:
    if not _present(env, "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM"):
        return None
    why = "PADDLE_TRAINER_ID/PADDLE_TRAINERS_NUM are"
    world = _int(env, "PADDLE_TRAINERS_NUM", why, _PADDLE_FIX, minimum=1)
    rank = _int(env, "PADDLE_TRAINER_ID", why, _PADDLE_FIX)
    _check_below("PADDLE_TRAINER_ID", rank, "PADDLE_TRAINERS_NUM", world, _PADDLE_FIX)
    raw = _require(env, "PADDLE_TRAINER_ENDPOINTS", why, _PADDLE_FIX)
    endpoints = [_split_endpoint("PADDLE_TRAINER_ENDPOINTS", e) for e in raw.split(",")]
    if len(endpoints) != world:
        raise ClusterError(
            f"PADDLE_TRAINER_ENDPOINTS lists {len(endpoints)} endpoints but "
            f"PADDLE_TRAINERS_NUM={world}; {_PADDLE_FIX}"
        )
    current_raw = _require(env, "PADDLE_CURRENT_ENDPOINT", why, _PADDLE_FIX)
    current = _split_endpoint("PADDLE_CURRENT_ENDPOINT", current_raw)
    if current != endpoints[rank]:
        raise ClusterError(
            f"PADDLE_CURRENT_ENDPOINT={current_raw!r} is not entry {rank} "
            f"(PADDLE_TRAINER_ID) of PADDLE_TRAINER_ENDPOINTS={raw!r}; {_PADDLE_FIX}"
        )
    ip = current[0]
    same_ip = [i for i, (host, _) in enumerate(endpoints) if host == ip]
    ips = list(dict.fromkeys(host for host, _ in endpoints))
    master_addr, master_port = endpoints[0]
    return ClusterInfo(
        rank,
        world,
        same_ip.index(rank),
        len(same_ip),
        ips.index(ip),
        len(ips),
        master_addr,
        master_port,
        "paddle",
        node_key=f"ip:{ip}",
    )


def _master_or(
    env: Mapping[str, str], fallback: Callable[[], tuple[str | None, int | None]]
) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT where set, the launcher-specific fallback for the rest."""
    addr = env.get("MASTER_ADDR", "").strip() or None
    port = _port("MASTER_PORT", env["MASTER_PORT"], _MASTER_FIX) if "MASTER_PORT" in env else None
    if addr is None or port is None:
        fb_addr, fb_port = fallback()
        addr, port = addr or fb_addr, port or fb_port
    if addr is None:
        raise ClusterError(f"MASTER_ADDR is not set and cannot be derived; {_MASTER_FIX}")
    if port is None:
        raise ClusterError(f"MASTER_PORT is not set and cannot be derived; {_MASTER_FIX}")
    return addr, port


def _from_horovod(env: Mapping[str, str]) -> ClusterInfo | None:
    if not _present(env, "HOROVOD_RANK", "HOROVOD_SIZE"):
        return None
    why = "HOROVOD_RANK/HOROVOD_SIZE are"
    world = _int(env, "HOROVOD_SIZE", why, _HOROVOD_FIX, minimum=1)
    rank = _int(env, "HOROVOD_RANK", why, _HOROVOD_FIX)
    _check_below("HOROVOD_RANK", rank, "HOROVOD_SIZE", world, _HOROVOD_FIX)
    local_world = _int(env, "HOROVOD_LOCAL_SIZE", why, _HOROVOD_FIX, minimum=1)
    local_rank = _int(env, "HOROVOD_LOCAL_RANK", why, _HOROVOD_FIX)
    _check_below("HOROVOD_LOCAL_RANK", local_rank, "HOROVOD_LOCAL_SIZE", local_world, _HOROVOD_FIX)
    nodes = _int(env, "HOROVOD_CROSS_SIZE", why, _HOROVOD_FIX, minimum=1)
    node = _int(env, "HOROVOD_CROSS_RANK", why, _HOROVOD_FIX)
    _check_below("HOROVOD_CROSS_RANK", node, "HOROVOD_CROSS_SIZE", nodes, _HOROVOD_FIX)

    def rendezvous() -> tuple[str | None, int | None]:
        # The Gloo rendezvous server itself listens on that port, so the store takes the next.
        addr = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "").strip() or None
        raw = env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
        port = None if raw is None else _port("HOROVOD_GLOO_RENDEZVOUS_PORT", raw, _MASTER_FIX)
        return addr, None if port is None else port % 65535 + 1

    addr, port = _master_or(env, rendezvous)
    return ClusterInfo(
        rank,
        world,
        local_rank,
        local_world,
        node,
        nodes,
        addr,
        port,
        "horovod",
        node_key=f"node:{node}",
    )


def _slurm_local_world(env: Mapping[str, str], node: int, nodes: int, world: int) -> int:
    found = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if found is None:
        per_node = _int(env, "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE is not", _SLURM_FIX, 1)
        counts = [per_node] * nodes
        found = ("SLURM_NTASKS_PER_NODE", str(per_node))
    else:
        try:
            counts = expand_tasks_per_node(found[1])
        except ValueError as exc:
            raise ClusterError(f"{found[0]}={found[1]!r}: {exc}; {_SLURM_FIX}") from None
    if len(counts) != nodes or sum(counts) != world:
        raise ClusterError(
            f"{found[0]}={found[1]!r} gives {sum(counts)} tasks on {len(counts)} nodes, but the "
            f"step has {world} tasks on {nodes} nodes; {_SLURM_FIX}"
        )
    return counts[node]


def _slurm_master(env: Mapping[str, str], nodes: int) -> tuple[str, int]:
    def first_host_and_job_port() -> tuple[str | None, int | None]:
        found = _first(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
        host = None
        if found is not None:
            try:
                hosts = expand_hostlist(found[1])
            except ValueError as exc:
                raise ClusterError(f"{found[0]}={found[1]!r}: {exc}; {_SLURM_FIX}") from None
            if len(hosts) != nodes:
                raise ClusterError(
                    f"{found[0]}={found[1]!r} names {len(hosts)} hosts but the step has "
                    f"{nodes} nodes; {_SLURM_FIX}"
                )
            host = hosts[0]
        job = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
        port = None
        if job is not None:
            port = derived_port(str(_to_int(job[0], job[1], _MASTER_FIX)))
        return host, port

    return _master_or(env, first_host_and_job_port)


def _from_slurm(env: Mapping[str, str]) -> ClusterInfo | None:
    # Only an srun step describes the ranks; a batch script or salloc shell is one process.
    if "SLURM_PROCID" not in env or not _present(env, "SLURM_STEP_ID", "SLURM_STEPID"):
        return None
    why = "SLURM_PROCID is set inside an srun step"
    world_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    world = _int(env, world_name, why, _SLURM_FIX, minimum=1)
    rank = _int(env, "SLURM_PROCID", why, _SLURM_FIX)
    _check_below("SLURM_PROCID", rank, world_name, world, _SLURM_FIX)
    nodes_name = "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in env else "SLURM_NNODES"
    nodes = _int(env, nodes_name, why, _SLURM_FIX, minimum=1)
    node = _int(env, "SLURM_NODEID", why, _SLURM_FIX)
    _check_below("SLURM_NODEID", node, nodes_name, nodes, _SLURM_FIX)
    local_world = _slurm_local_world(env, node, nodes, world)
    local_rank = _int(env, "SLURM_LOCALID", why, _SLURM_FIX)
    _check_below("SLURM_LOCALID", local_rank, "tasks on this node", local_world, _SLURM_FIX)
    addr, port = _slurm_master(env, nodes)
    return ClusterInfo(
        rank,
        world,
        local_rank,
        local_world,
        node,
        nodes,
        addr,
        port,
        "slurm",
        node_key=f"node:{node}",
    )


def _from_openmpi(env: Mapping[str, str]) -> ClusterInfo | None:
    if not _present(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        return None
    why = "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE are"
    world = _int(env, "OMPI_COMM_WORLD_SIZE", why, _OMPI_FIX, minimum=1)
    rank = _int(env, "OMPI_COMM_WORLD_RANK", why, _OMPI_FIX)
    _check_below("OMPI_COMM_WORLD_RANK", rank, "OMPI_COMM_WORLD_SIZE", world, _OMPI_FIX)
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", why, _OMPI_FIX, minimum=1)
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", why, _OMPI_FIX)
    _check_below(
        "OMPI_COMM_WORLD_LOCAL_RANK",
        local_rank,
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        local_world,
        _OMPI_FIX,
    )
    if world % local_world:
        raise ClusterError(
            f"OMPI_COMM_WORLD_SIZE={world} is not a multiple of OMPI_COMM_WORLD_LOCAL_SIZE="
            f"{local_world}; longboat assumes the same number of ranks per node, mapped by slot "
            "(mpirun --map-by slot -npernode K)"
        )
    nodes = world // local_world

    def one_node_fallback() -> tuple[str | None, int | None]:
        job = _first(env, "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE")
        port = None if job is None else derived_port(job[1])
        return ("127.0.0.1" if nodes == 1 else None), port

    addr, port = _master_or(env, one_node_fallback)
    return ClusterInfo(
        rank, world, local_rank, local_world, rank // local_world, nodes, addr, port, "openmpi"
    )


_READERS: tuple[tuple[Source, Callable[[Mapping[str, str]], ClusterInfo | None]], ...] = (
    ("torch", _from_torch),
    ("paddle", _from_paddle),
    ("horovod", _from_horovod),
    ("slurm", _from_slurm),
    ("openmpi", _from_openmpi),
)

SINGLE = ClusterInfo(0, 1, 0, 1, 0, 1, "127.0.0.1", 0, "single")


def discover(env: Mapping[str, str] | None = None) -> ClusterInfo:
    """Describe this process from ``env`` (default ``os.environ``); no side effects.

    Launchers are tried in order torch, paddle, horovod, slurm, openmpi; the first whose
    variables are present must be complete and consistent (else ClusterError) and wins.
    With none present the result is a single process (``source="single"``).
    """
    env = os.environ if env is None else env
    for _, reader in _READERS:
        info = reader(env)
        if info is not None:
            return info
    return SINGLE
