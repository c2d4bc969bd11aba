"""Process-group lifecycle: init (idempotent), accessors, bounded barrier, shutdown."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Imported before any process group exists: its functions take ``group=group.WORLD`` as a
# default, evaluated at import, and imported later (FSDP2 imports it) they would hold the
# world group for good, its Gloo threads running into interpreter exit (an occasional
# "terminate called without an active exception") and one group leaked per init/shutdown.
import torch.distributed.nn.functional  # noqa: F401  # isort: skip

from longboat.cluster.backends import runs_on_device
from longboat.cluster.env import discover
from longboat.cluster.info import ClusterError, ClusterInfo
from longboat.cluster.startup import Startup
from longboat.cluster.topology import Topology, gather_topology, node_key
from longboat.words import plural

DEFAULT_TIMEOUT_S = 300.0

_log = logging.getLogger("longboat")


@dataclass
class _State:
    """This process's membership of the job, from `init` to `shutdown`."""

    info: ClusterInfo
    topology: Topology
    timeout: timedelta
    owns_group: bool
    store: dist.Store | None
    strategy: Any = None
    startup: Startup = Startup()


_state: _State | None = None  # see `_current`
_startup = Startup()  # the last one `init` was handed: a re-init in this process reuses it
_shutdown_hooks: list[Callable[[], None]] = []
_group_end_hooks: list[Callable[[], None]] = []


def _current() -> _State | None:
    """The state `init` created, or None (before it, or after `shutdown`); every accessor below
    reads it through here."""
    return _state


def on_shutdown(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook`` at the next `shutdown` (once; latest first), before the process group goes.

    Every module that keeps per-process state (the current PS engine, timeline observer,
    stall watch, Horovod controller) registers its reset here, so `shutdown` forgets all of
    it and a second `init` in the same process starts clean. Registering twice is a no-op.
    """
    if hook not in _shutdown_hooks:
        _shutdown_hooks.append(hook)
    return hook


def on_group_end(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook`` at the next `shutdown` (once; latest first, after the `on_shutdown`
    hooks, before the group `init` created is destroyed): for what runs collectives on the
    group, such as worker threads and shared-memory segments. A group `init` adopted
    (Lightning's) outlives `shutdown`, but what longboat built on it ends there too."""
    _group_end_hooks.append(hook)
    return hook


def _resolve_timeout(seconds: float | None) -> timedelta:
    """The ``timeout`` argument, else LONGBOAT_TIMEOUT, else DEFAULT_TIMEOUT_S."""
    name, raw = "timeout", seconds
    if raw is None:
        name, raw = "LONGBOAT_TIMEOUT", os.environ.get("LONGBOAT_TIMEOUT", DEFAULT_TIMEOUT_S)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ClusterError(f"{name}={raw!r} is not a number of seconds; use e.g. 300") from None
    if not value > 0:
        raise ClusterError(f"{name}={raw!r} must be a positive number of seconds; use e.g. 300")
    return timedelta(seconds=value)


def _resolve_backend(requested: str | None, single: bool) -> str:
    """The ``backend`` argument, else LONGBOAT_BACKEND, else nccl with CUDA and gloo without."""
    origin, name = "backend", requested
    if name is None and os.environ.get("LONGBOAT_BACKEND"):
        origin, name = "LONGBOAT_BACKEND", os.environ["LONGBOAT_BACKEND"]
    if name is None:
        return "nccl" if torch.cuda.is_available() and not single else "gloo"
    name = name.strip().lower()
    if not dist.is_backend_available(name):
        raise ClusterError(
            f"{origin}={name!r} is not available in this torch build; "
            "use 'gloo' (CPU) or 'nccl' (CUDA GPUs)"
        )
    return name


def _make_store(info: ClusterInfo, timeout: timedelta, startup: Startup) -> dist.Store:
    """An in-process HashStore for a lone process, else the store the startup gives (an
    elastic round's), else a TCPStore served by rank 0.

    Under torch's elastic agent (torchrun, ``longboat launch``) the agent already serves
    the store on MASTER_PORT: connect to it, namespaced by restart attempt as torch does.
    """
    if info.source == "single":
        return dist.HashStore()
    given = startup.store(info, timeout) if startup.store is not None else None
    if given is not None:
        return given
    where = f"{info.master_addr}:{info.master_port}"
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(
            info.master_addr,
            info.master_port,
            info.world_size,
            is_master=info.rank == 0 and not agent_store,
            timeout=timeout,
        )
        if agent_store:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            role = os.environ.get("LONGBOAT_ROLE", "all")  # PS servers and trainers: own groups
            return dist.PrefixStore(f"/longboat/{role}/attempt_{attempt}", store)
        return store
    except Exception as exc:  # torch raises DistStoreError/RuntimeError/OSError variants
        role = (
            f"serve the rendezvous store on port {info.master_port} (is it in use?) and wait for "
            f"{info.world_size - 1} other ranks"
            if info.rank == 0
            else f"reach rank 0's rendezvous store at {where}"
        )
        raise ClusterError(
            f"rank {info.rank} could not {role} within {timeout.total_seconds():.0f}s "
            f"({info.source} launch): {exc}. Check MASTER_ADDR/MASTER_PORT and that every rank "
            "was started; raise LONGBOAT_TIMEOUT if ranks start slowly"
        ) from exc


def _start_group(
    info: ClusterInfo, backend: str, timeout: timedelta, startup: Startup
) -> dist.Store:
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    store = _make_store(info, timeout, startup)
    try:
        dist.init_process_group(
            backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout
        )
    except Exception as exc:
        raise ClusterError(
            f"rank {info.rank}: init_process_group(backend={backend!r}) failed: {exc}"
        ) from exc
    return store


def _gather(key: str | None, backend: str) -> Topology:
    if dist.get_world_size() == 1:
        return Topology((0,), 0)
    device = torch.device("cuda", torch.cuda.current_device()) if runs_on_device(backend) else None
    return gather_topology(node_key(key), device or torch.device("cpu"))


def _adopt() -> tuple[ClusterInfo, Topology]:
    """Describe a process group that the user initialised before calling init()."""
    rank, world, backend = dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    try:
        info: ClusterInfo | None = discover()
    except ClusterError:  # launcher variables half cleared (Lightning's teardown): the group rules
        info = None
    if info is not None and (info.rank, info.world_size) == (rank, world):
        info = replace(info, backend=backend)
        return info, _gather(info.node_key, backend)
    if info is not None and info.source != "single":
        raise ClusterError(
            f"torch.distributed is already initialised as rank {rank} of {world}, but the "
            f"{info.source} environment says rank {info.rank} of {info.world_size}; "
            "initialise it with the launcher's values or let longboat.init() do it"
        )
    topo = _gather(None, backend)  # no launcher variables: measure nodes by hostname
    local = topo.local_ranks()
    addr = os.environ.get("MASTER_ADDR", "")
    port = int(os.environ.get("MASTER_PORT", "0") or 0)
    info = ClusterInfo(
        rank,
        world,
        local.index(rank),
        len(local),
        topo.node,
        topo.nodes,
        addr,
        port,
        "single",
        backend=backend,
    )
    return info, topo


def _warn_if_inconsistent(info: ClusterInfo, topo: Topology) -> None:
    here = len(topo.local_ranks())
    if here != info.local_world_size or topo.nodes != info.num_nodes:
        _log.warning(
            "rank %d: the %s environment says %d ranks on this node and %d nodes, but node keys "
            "say %d and %d; node-local groups will follow the node keys",
            info.rank,
            info.source,
            info.local_world_size,
            info.num_nodes,
            here,
            topo.nodes,
        )


def init(
    strategy: Any = None,
    backend: str | None = None,
    timeout: float | None = None,
    *,
    startup: Startup | None = None,
) -> ClusterInfo:
    """Join the cluster described by the environment and return this process's ClusterInfo.

    Idempotent: later calls return the first call's info (a non-None ``strategy`` replaces the
    stored one). If torch.distributed is already initialised, it is adopted, not re-created.
    ``backend``: argument, else LONGBOAT_BACKEND, else "nccl" with CUDA, "gloo" without.
    ``timeout`` (seconds): argument, else LONGBOAT_TIMEOUT, else 300; bounds the rendezvous and
    every collective of the process group. ``startup``: what the layers above hand down
    (elastic rounds, the stall inspector, the cluster line); ``longboat.init`` passes theirs,
    and a later call without one (an elastic rank re-joining) reuses the last one given.
    """
    global _state, _startup
    if startup is not None:
        _startup = startup
    startup = _startup
    state = _current()
    if state is not None:
        if strategy is not None:
            state.strategy = strategy
        return state.info
    wait = _resolve_timeout(timeout)
    store: dist.Store | None = None
    if dist.is_initialized():
        info, topo = _adopt()
        owns = False
    else:
        found = discover()
        if startup.place is not None and found.source != "single":
            found = startup.place(found)
        name = _resolve_backend(backend, single=found.source == "single")
        joined = startup.joining(found) if startup.joining is not None else None
        store = _start_group(found, name, wait, startup)
        owns = True
        if joined is not None:
            joined()
        # a script that exits (sys.exit, end of file) without shutdown() would otherwise
        # abort in the process group's destructor and report SIGABRT instead of its exit code
        atexit.unregister(shutdown)
        atexit.register(shutdown)
        try:
            info, topo = replace(found, backend=name), _gather(found.node_key, name)
        except Exception:
            if dist.is_initialized():  # a mocked or failed start leaves none: keep the cause
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            raise
    _warn_if_inconsistent(info, topo)
    _state = _State(info, topo, wait, owns, store, strategy, startup)
    if startup.started is not None:
        startup.started(info, topo, strategy)
    if info.rank == 0:
        tail = startup.describe(info, topo, strategy) if startup.describe is not None else ""
        _log.info(
            "longboat cluster: %s on %s, %s%s, timeout %.0fs",
            plural(info.world_size, "rank"),
            plural(topo.nodes, "node"),
            info.describe(),
            tail,
            wait.total_seconds(),
        )
    return info


def job_timeout() -> timedelta:
    """The job's timeout: init's, or before init() LONGBOAT_TIMEOUT, else DEFAULT_TIMEOUT_S.

    Every process group, barrier and wait longboat creates is bounded by it.
    """
    state = _current()
    return state.timeout if state is not None else _resolve_timeout(None)


def new_group(ranks: list[int] | None = None) -> dist.ProcessGroup:
    """``dist.new_group`` bounded by the job's timeout (torch's own default is 30 minutes).

    Collective like any ``new_group``: every rank calls it with the same ``ranks``, in the
    same order.
    """
    return dist.new_group(ranks=ranks, timeout=job_timeout())


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    return _current() is not None


def cluster() -> ClusterInfo:
    """The initialised ClusterInfo, or before init() what discover() reads now."""
    state = _current()
    return state.info if state is not None else discover()


def rank() -> int:
    """Global rank of this process."""
    return cluster().rank


def world_size() -> int:
    """Number of processes."""
    return cluster().world_size


def local_rank() -> int:
    """Rank of this process among those on its node."""
    return cluster().local_rank


def local_world_size() -> int:
    """Number of processes on this node."""
    return cluster().local_world_size


def node_rank() -> int:
    """Index of this process's node."""
    return cluster().node_rank


def num_nodes() -> int:
    """Number of nodes."""
    return cluster().num_nodes


def current_strategy() -> Any:
    """The strategy given to init() (the latest non-None one), or None (also after shutdown)."""
    state = _current()
    return state.strategy if state is not None else None


def topology() -> Topology:
    """Which ranks share a node (measured once in init())."""
    state = _current()
    if state is None:
        raise ClusterError("topology() needs the process group: call longboat.init() first")
    return state.topology


def barrier(timeout: float | None = None) -> None:
    """Wait for every rank, at most ``timeout`` seconds (default: init's timeout).

    On gloo it uses monitored_barrier, whose error names the ranks that did not arrive.
    """
    state = _current()
    if state is None:
        if discover().world_size == 1:
            return
        raise ClusterError("barrier() before init(): call longboat.init() on every rank first")
    if state.info.world_size == 1:
        return
    wait = state.timeout if timeout is None else _resolve_timeout(timeout)
    try:
        with state.startup.named_wait("barrier", wait.total_seconds()):
            if state.info.backend == "gloo":
                dist.monitored_barrier(timeout=wait, wait_all_ranks=True)
            else:
                dist.barrier(async_op=True).wait(timeout=wait)
    except Exception as exc:
        raise ClusterError(
            f"rank {state.info.rank}: barrier did not complete within "
            f"{wait.total_seconds():.0f}s: {exc}"
        ) from exc


def shutdown() -> None:
    """Destroy the process group longboat created and forget the state; safe to call twice.

    First the hooks registered with `on_shutdown` run (latest first): each module forgets
    what it kept for this process group (stall watches, observers, Horovod's negotiation).
    Then those of `on_group_end` (longboat's collective workers and segments), also on a
    group `init` adopted, which stays its owner's; the group is destroyed if longboat made it.
    """
    global _state
    state, _state = _state, None
    _run_hooks(_shutdown_hooks)
    _run_hooks(_group_end_hooks)
    if state is not None and state.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def _run_hooks(hooks: list[Callable[[], None]]) -> None:
    """Pop and run every hook, latest first."""
    while hooks:
        hook = hooks.pop()
        try:
            hook()
        except Exception:  # one failing reset must not keep the others (or the group) alive
            _log.exception("error while shutting down %s", getattr(hook, "__qualname__", hook))
