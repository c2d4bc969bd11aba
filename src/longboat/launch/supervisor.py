"""torch's local elastic agent, reporting failures in the order they happened, and restarts.

`WatchedAgent` is `LocalElasticAgent` plus an `ExitWatch` per attempt: it knows when each
worker exited and which workers it stopped itself, so a failed attempt becomes a
`GroupFailure` (first failure first, stopped ranks apart). `run_agent` runs it for a
`LaunchConfig` as ``torch.distributed.launcher.api.launch_agent`` does, and raises
`GroupFailedError` (a `ChildFailedError` carrying that report) when the job fails.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig

from longboat.cluster import job_timeout
from longboat.launch import torch_compat
from longboat.launch.arrivals import RendezvousWait
from longboat.launch.exit_watch import ExitWatch
from longboat.launch.exits import GroupFailure, RankExit, classify
from longboat.launch.worker_store import WorkerStores

_FAILED_STATES = (WorkerState.FAILED, WorkerState.UNHEALTHY)


@dataclass(frozen=True)
class Restart:
    """The agent restarted the group: ``attempt`` of ``max_restarts``, after ``failure`` (None:
    a node joined the rendezvous, which is not counted), ``resume_s`` from the failure being
    seen (or the restart beginning) to the workers running again."""

    attempt: int
    max_restarts: int
    failure: GroupFailure | None
    resume_s: float


class GroupFailedError(ChildFailedError):
    """torch's ChildFailedError with the agent's `GroupFailure` as ``report`` (built from
    torch's own failures, ordered by their whole-second timestamps, if the agent has none)."""

    def __init__(self, name: str, failures: dict[int, ProcessFailure], report: GroupFailure | None):
        super().__init__(name, failures)
        self.report = report or _report_from_torch(failures)


def _report_from_torch(failures: dict[int, ProcessFailure]) -> GroupFailure:
    order = sorted(failures, key=lambda rank: (failures[rank].timestamp, rank))
    return GroupFailure(tuple(RankExit(rank, failures[rank].exitcode) for rank in order), ())


class WatchedAgent(LocalElasticAgent):
    """LocalElasticAgent that notes how each attempt ended and calls ``on_restart``.

    ``shutdown_grace_s``: for a torch whose agent has no ``shutdown_timeout``, how long ranks
    being stopped get between the death signal and SIGKILL (torch's default is 30 s).
    ``fresh_stores``: every node restarts with the others, so each attempt's ranks can get a
    store of their own (`longboat.launch.worker_store`); False where a node restarts only its
    own ranks (several-node parameter-server jobs), whose peers keep the first store.
    """

    def __init__(
        self,
        *args: Any,
        on_restart: Callable[[Restart], None] | None = None,
        shutdown_grace_s: float | None = None,
        on_started: Callable[[], None] | None = None,
        fresh_stores: bool = True,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self._on_restart = on_restart
        self._on_started = on_started
        self._grace_s = shutdown_grace_s
        self._watch: ExitWatch | None = None
        self._torch_failures: dict[int, ProcessFailure] = {}
        self._failed_seen: float | None = None
        self.failure: GroupFailure | None = None
        self._worker_stores = WorkerStores(job_timeout()) if fresh_stores else None

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        static = worker_group.spec.rdzv_handler.get_backend() == "static"
        if static and self._worker_stores is not None:
            attempt = worker_group.spec.max_restarts - self._remaining_restarts
            self._worker_stores.point(worker_group, attempt)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._close_watch()
        ids = super()._start_workers(worker_group)
        if self._on_started is not None:
            self._on_started()
        self._watch_workers(worker_group, ids)
        if self._pcontext is not None:
            _before_close(self._pcontext, self._note_stopping, self._grace_s)
        return ids

    def _note_stopping(self) -> None:
        if self._watch is not None:
            self._watch.stopping()

    def _watch_workers(self, worker_group: WorkerGroup, ids: dict[int, Any]) -> None:
        """A fresh `ExitWatch` over the running workers ``ids`` (local rank -> pid) under the
        global ranks ``worker_group`` gives them now."""
        self._close_watch()
        ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
        error_files = getattr(self._pcontext, "error_files", {})
        self._watch = ExitWatch(
            {ranks[local]: pid for local, pid in ids.items()},
            {ranks[local]: path for local, path in error_files.items()},
        )

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._watch is not None and self._watch.any_failed():
            # this poll will find the failure and stop the others; torch's multiprocessing
            # context does so inside its own join, before `PContext.close`
            self._watch.stopping()
        result = super()._monitor_workers(worker_group)
        if result.state in _FAILED_STATES:
            self._torch_failures = dict(result.failures)
        return result

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        watch = self._watch if worker_group.state in _FAILED_STATES else None
        if watch is not None:
            watch.stopping()
        super()._stop_workers(worker_group)  # closes the watch too
        if watch is not None:
            codes = {rank: f.exitcode for rank, f in self._torch_failures.items()}
            self.failure = classify(watch.ends(codes))
            self._failed_seen = watch.first_seen()

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        failed = worker_group.state in _FAILED_STATES
        began = time.monotonic()
        super()._restart_workers(worker_group)  # stops (noting the failure), then starts
        if self._on_restart is None:
            return
        failure = None
        if failed:
            failure = self.failure or _report_from_torch(self._torch_failures)
        since = (self._failed_seen or began) if failed else began
        self._on_restart(
            Restart(
                attempt=worker_group.spec.max_restarts - self._remaining_restarts,
                max_restarts=worker_group.spec.max_restarts,
                failure=failure,
                resume_s=time.monotonic() - since,
            )
        )

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        super()._shutdown(*args, **kwargs)
        self._close_watch()

    def _close_watch(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None


def _before_close(
    pcontext: PContext, hook: Callable[[], None], grace_s: float | None = None
) -> None:
    """Call ``hook`` before torch stops this context's processes: its poll stops the survivors
    (``self.close()``) as soon as one worker fails, before the agent hears of it. With
    ``grace_s``, a close that names no timeout waits that long before SIGKILL."""
    close = pcontext.close

    def close_after_hook(*args: Any, **kwargs: Any) -> None:
        hook()
        if grace_s is not None and len(args) < 2 and "timeout" not in kwargs:
            kwargs["timeout"] = grace_s
        close(*args, **kwargs)

    pcontext.close = close_after_hook  # type: ignore[method-assign]


def run_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: tuple[Any, ...] | list[Any] = (),
    on_restart: Callable[[Restart], None] | None = None,
    agent_class: type[WatchedAgent] | None = None,
    shutdown_grace_s: int | None = None,
    waiting: RendezvousWait | None = None,
    **agent_kwargs: Any,
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` under a `WatchedAgent` for ``config``; ``{rank: return value}``.

    The same steps as torch's ``launch_agent`` (rendezvous handler, worker spec, agent run, the
    rendezvous closed unless a signal ended the run). Raises `GroupFailedError` when a worker
    failed and no restart was left. ``agent_class`` (a `WatchedAgent` subclass, built with
    ``agent_kwargs``) replaces it; an elastic agent that fails leaves the rendezvous open for
    the nodes that go on. ``shutdown_grace_s``: seconds between the death signal and SIGKILL
    when the agent stops the ranks (None: torch's default). ``waiting`` reports who has
    arrived while this node waits at the rendezvous, until the ranks start.
    """
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _static_master(params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = torch_compat.worker_spec(
        config,
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
    )
    agent = (agent_class or WatchedAgent)(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        on_restart=on_restart,
        on_started=waiting.ranks_started if waiting is not None else None,
        **shutdown_grace(shutdown_grace_s),
        **agent_kwargs,
    )
    if waiting is not None:
        waiting.start(spec.rdzv_handler)
    close_rendezvous = agent_class is None  # elastic: only a finished job closes it
    try:
        result = agent.run()
        if result.is_failed():
            raise GroupFailedError(_name(entrypoint, args), result.failures, agent.failure)
        close_rendezvous = True
        return result.return_values
    except SignalException:
        close_rendezvous = False  # as torch: a signalled agent leaves the rendezvous open
        raise
    finally:
        if waiting is not None:
            waiting.stop()
        agent._close_watch()
        if close_rendezvous:
            spec.rdzv_handler.shutdown()


def shutdown_grace(seconds: int | None) -> dict[str, Any]:
    """The agent's keyword arguments for a ``seconds`` grace period before SIGKILL, whoever
    stops the ranks: `WatchedAgent` applies it to every close that names no timeout (torch
    stops the survivors of a failed rank that way, with its own 30 s), and torch's
    ``shutdown_timeout``, where its agent takes one, covers the launcher being stopped."""
    if seconds is None:
        return {}
    grace: dict[str, Any] = {"shutdown_grace_s": seconds}
    if torch_compat.agent_accepts("shutdown_timeout"):
        grace["shutdown_timeout"] = int(seconds)
    return grace


def _static_master(params: RendezvousParameters) -> tuple[str | None, int | None]:
    """The master address of a static rendezvous (others choose their own)."""
    if params.backend != "static":
        return None, None
    host, port = parse_rendezvous_endpoint(params.endpoint.strip(), default_port=-1)
    if port == -1:
        raise ValueError(f"rendezvous endpoint {params.endpoint!r} has no port")
    return host, port


def _name(entrypoint: Callable[..., Any] | str, args: tuple[Any, ...] | list[Any]) -> str:
    """The job's name in torch's error: the function, or the script a Python runs."""
    if callable(entrypoint):
        return getattr(entrypoint, "__name__", repr(entrypoint))
    if entrypoint == sys.executable:
        return next((str(a) for a in args if not str(a).startswith("-")), entrypoint)
    return entrypoint
