"""Per-rank entry point of `longboat launch`: finish the environment, then run the script.

    python -u -m longboat.launch.bootstrap [-m] TARGET [ARGS...]

torch's elastic agent starts this in every rank with RANK, WORLD_SIZE, LOCAL_RANK, ... set.
It merges stderr into the rank's log, gathers every rank's endpoint through the agent's
store, exports the Paddle/Horovod/longboat variables, applies the parameter-server lifecycle
(trainers wait for servers; servers end after the trainers), and runs the script as
``__main__``.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from longboat.launch import ps_layout
from longboat.launch.rank_env import rank_env
from longboat.launch.roles import num_servers, role_of

_SERVER_GRACE_S = 2.0


def _agent_store(timeout: float, prefix: str | None = None) -> Any:
    """The elastic agent's store (imports torch: only multi-node and PS runs need it); in an
    elastic job, the current round's namespace of the rendezvous store."""
    import torch.distributed as dist

    from longboat.elastic.membership import connect_store, elastic_dir, read_membership

    directory = elastic_dir()
    membership = read_membership(directory) if directory else None
    if membership is not None:
        return dist.PrefixStore("launch", connect_store(membership, timedelta(seconds=timeout)))

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(prefix or f"/longboat-launch/attempt_{attempt}", store)


def _gather_endpoints(store: Any, mine: str, world: int) -> list[str]:
    """Every rank's endpoint, in rank order (bytes through the store; nothing unpickled)."""
    store.set(f"endpoint/{os.environ['RANK']}", mine)
    keys = [f"endpoint/{r}" for r in range(world)]
    store.wait(keys)
    return [store.get(k).decode() for k in keys]


LOCAL_SERVERS_ENV = "LONGBOAT_LOCAL_SERVERS"


def _ps_layout(store: Any, world: int, timeout: float) -> tuple[list[str], int]:
    """Multi-node PS: gather every rank's role; renumber this rank in the job-wide layout
    (servers first) and export the job's server count. Returns (endpoints, servers)."""
    local_rank = int(os.environ["LOCAL_RANK"])
    host = os.environ.get("LONGBOAT_HOST_IP", "127.0.0.1")
    mine = f"{host}:{os.environ['LONGBOAT_ENDPOINT_PORTS'].split(',')[local_rank]}"
    # read once and dropped: the script's Strategy checks know only the job-wide variables
    role = ps_layout.local_role(local_rank, int(os.environ.pop(LOCAL_SERVERS_ENV)))
    layout = ps_layout.gather(store, int(os.environ["RANK"]), world, role, mine, timeout)
    if role == "trainer" and layout.index == 0:  # for the launchers' banners
        store.set(ps_layout.SERVERS_KEY, ",".join(layout.servers))
    os.environ.update(RANK=str(layout.rank), LONGBOAT_NUM_SERVERS=str(len(layout.servers)))
    return layout.endpoints, len(layout.servers)


def _wait_for_servers(endpoints: list[str], timeout: float) -> None:
    """The launch barrier: block until every server endpoint accepts TCP connections."""
    deadline = time.monotonic() + timeout
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"trainer waited {timeout:.0f}s for parameter server {endpoint} to "
                        "accept connections; check the server log (log/serverlog.N) - did the "
                        "server start listening on PADDLE_PORT?"
                    ) from None
                time.sleep(0.2)


def _stop_after_trainers(store: Any, trainers: int) -> None:
    """Server side: once every trainer has finished, give the script a grace period, then end."""

    def watch() -> None:
        store.wait(["trainers_done"], timedelta(days=365))
        while int(store.add("trainers_done_count", 0)) < trainers:
            time.sleep(0.2)
        time.sleep(_SERVER_GRACE_S)
        sys.stdout.flush()
        os._exit(0)  # the trainers are done: this server's work is over

    threading.Thread(target=watch, name="longboat-server-stop", daemon=True).start()


def _renumber_for_role(role: str, index: int, count: int) -> None:
    """PS mode: servers and trainers each form their own group, numbered from 0."""
    os.environ.update(
        RANK=str(index), WORLD_SIZE=str(count), LOCAL_RANK=str(index), LOCAL_WORLD_SIZE=str(count)
    )


_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"


def _write_error_files_aside() -> str | None:
    """Point torch's error file (ours and any ``@record`` in the script) at a side file.

    The agent parses the real path as JSON once the rank has exited; a rank stopped with
    SIGTERM halfway through ``json.dump`` would leave half a file there and crash the
    agent's parse. The side file is renamed into place only once complete.
    """
    final = os.environ.get(_ERROR_FILE)
    if final:
        os.environ[_ERROR_FILE] = f"{final}.writing"
    return final


def _record_failure(exc: BaseException, final: str | None) -> None:
    """Write torch's error file for the agent's failure report (torch imported only now)."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    handler = ErrorHandler()
    handler.initialize()
    handler.record_exception(exc)
    if final:
        os.replace(os.environ[_ERROR_FILE], final)


#: the signal that makes a rank write its threads' stacks to its log and go on
STACKS_SIGNAL = signal.SIGUSR2


def main(argv: list[str]) -> None:
    """Finish the rank's environment and run the target; failures land in the error file."""
    final = _write_error_files_aside()
    try:
        _main(argv)
    except SystemExit:
        raise
    except KeyboardInterrupt:  # Ctrl-C: the launcher prints one line for the whole job
        sys.exit(128 + signal.SIGINT)
    except BaseException as exc:
        _record_failure(exc, final)
        raise


def _main(argv: list[str]) -> None:
    if os.environ.get("LONGBOAT_LOG_FILE"):
        os.dup2(1, 2)  # one log per rank, in order: stderr joins stdout's file
    # the launcher asks for every thread's stack (into this rank's log) before it stops a
    # rank that is still running when another failed: where a stuck rank was stuck
    signal.signal(STACKS_SIGNAL, signal.SIG_IGN)  # what stays once Python has shut down
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    module = argv[:1] == ["-m"]
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    timeout = float(os.environ.get("LONGBOAT_LAUNCH_TIMEOUT", "300"))
    world = int(os.environ["WORLD_SIZE"])
    servers = num_servers(os.environ)
    elastic = bool(os.environ.get("LONGBOAT_ELASTIC_DIR"))
    multinode_ps = LOCAL_SERVERS_ENV in os.environ
    gather = servers or not (elastic or "LONGBOAT_ALL_ENDPOINTS" in os.environ)
    store = _agent_store(timeout) if gather and not multinode_ps else None
    if multinode_ps:  # servers and trainers on several nodes: the job-wide layout
        store = _agent_store(timeout, ps_layout.PREFIX)
        endpoints, servers = _ps_layout(store, world, timeout)
    elif elastic:  # ranks come and go: only this rank's own endpoint is known for sure
        mine = f"{os.environ.get('LONGBOAT_HOST_IP', '127.0.0.1')}:"
        mine += os.environ["LONGBOAT_ENDPOINT_PORTS"].split(",")[int(os.environ["LOCAL_RANK"])]
        endpoints = [mine if r == int(os.environ["RANK"]) else "" for r in range(world)]
    elif store is None:  # one node: the launcher already knows every endpoint
        endpoints = os.environ["LONGBOAT_ALL_ENDPOINTS"].split(",")
    else:
        host = os.environ.get("LONGBOAT_HOST_IP", "127.0.0.1")
        ports = os.environ["LONGBOAT_ENDPOINT_PORTS"].split(",")
        mine = f"{host}:{ports[int(os.environ['LOCAL_RANK'])]}"
        endpoints = _gather_endpoints(store, mine, world)
    os.environ.update(rank_env(os.environ, endpoints))
    if servers:
        role, index = role_of(int(os.environ["RANK"]), servers)
        trainers = world - servers
        _renumber_for_role(role, index, servers if role == "server" else trainers)
        if role == "server":
            _stop_after_trainers(store, trainers)
        else:
            _wait_for_servers(endpoints[:servers], timeout)
    sys.argv = [target, *args]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    finally:
        if servers and os.environ.get("LONGBOAT_ROLE") == "trainer":
            store.add("trainers_done_count", 1)
            store.set("trainers_done", "1")


if __name__ == "__main__":
    main(sys.argv[1:])
