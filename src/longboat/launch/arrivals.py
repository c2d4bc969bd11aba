"""What a node waiting at the rendezvous says: who has arrived, and why it gave up.

torch's agent blocks silently until enough nodes have joined, then either starts the ranks or
raises a timeout from deep inside its rendezvous. `RendezvousWait` prints a line every
`REPORT_EVERY_S` seconds while this node waits (the nodes that have arrived, where the elastic
rendezvous state says so), and `gave_up_line` turns the timeout into one line: how many nodes
of how many arrived, from where, and what to check.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed import DistNetworkError

from longboat.launch.rendezvous import synced_state

#: seconds between two "still waiting" lines
REPORT_EVERY_S = 5.0


def arrived_nodes(handler: Any) -> list[str] | None:
    """``addr`` of every node in the elastic rendezvous' pending round (participants and wait
    list), from the handler's last synced state; None where the rendezvous does not say
    (static rendezvous)."""
    state = synced_state(handler)
    participants = getattr(state, "participants", None)
    if not isinstance(participants, dict):
        return None
    nodes = [*participants, *getattr(state, "wait_list", ())]
    return sorted(str(getattr(node, "addr", node)) for node in nodes)


class RendezvousWait:
    """Prints ``waiting ...`` lines from a thread until `stop` (the ranks started, or the
    launch ended); `last_seen` keeps the latest list of arrived nodes for the final line."""

    def __init__(
        self,
        say: Callable[[str], None],
        master: str,
        nodes: str,
        timeout_s: float,
        every_s: float | None = REPORT_EVERY_S,
    ):
        self._say = say
        self.master = master
        self.nodes = nodes  # "2", or "2:4" for an elastic job
        self.timeout_s = timeout_s
        self._every = every_s
        self._stop = threading.Event()
        self._handler: Any = None
        self._thread: threading.Thread | None = None
        self._began = time.monotonic()
        self.started = False  # the ranks started: later errors are not the rendezvous'
        self.last_seen: list[str] | None = None

    def start(self, handler: Any) -> None:
        """Begin the lines (none when ``every_s`` is None)."""
        self._handler = handler
        self._began = time.monotonic()
        if self._every is None:
            return
        self._thread = threading.Thread(target=self._run, name="longboat-arrivals", daemon=True)
        self._thread.start()

    def ranks_started(self) -> None:
        self.started = True
        self.stop()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        assert self._every is not None
        while not self._stop.wait(self._every):
            self._say(self.line())

    def line(self) -> str:
        """``waiting at the rendezvous on HOST:PORT for N nodes (T s of S s): ...``."""
        seen = arrived_nodes(self._handler)
        if seen is not None:
            self.last_seen = seen
        waited = time.monotonic() - self._began
        where = f"waiting at the rendezvous on {self.master} for {self.nodes} nodes"
        timing = f"({waited:.0f} s of {self.timeout_s:.0f} s)"
        if seen is None:
            return f"longboat launch: {where} {timing}"
        return f"longboat launch: {where} {timing}: {len(seen)} here ({', '.join(seen)})"


_JOINED = re.compile(r"(\d+)/(\d+) clients joined")


def gave_up_line(wait: RendezvousWait, error: BaseException, this_node: str) -> str:
    """One line for a rendezvous that timed out: how many nodes arrived of how many, from
    where, and what to check."""
    joined = _JOINED.search(str(error))
    if joined:  # the static rendezvous' own count, on node 0
        arrived = f"{joined[1]} of {joined[2]} nodes reached"
    elif isinstance(error, DistNetworkError):  # a node that never got through to node 0
        arrived = "this node could not connect to"
    elif wait.last_seen is not None:
        arrived = f"{len(wait.last_seen)} node(s) ({', '.join(wait.last_seen)}) reached"
    else:
        arrived = "not enough nodes reached"
    host, _, port = wait.master.rpartition(":")
    return (
        f"longboat launch: {arrived} the rendezvous on {wait.master} within "
        f"{wait.timeout_s:.0f} s (needed: {wait.nodes} nodes; this node: {this_node}). Check "
        "that node 0 runs `longboat launch` too and that "
        f"every node gives --master {wait.master} and --nnodes "
        f"{wait.nodes}, that {host} port {port} is reachable from them (firewall, the address "
        "node 0 listens on; `longboat doctor` checks it), or raise --timeout if nodes start "
        "slowly"
    )
