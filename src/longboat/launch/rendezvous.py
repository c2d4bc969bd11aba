"""torch's c10d rendezvous with sub-second timings, for elastic jobs.

``torchrun --rdzv-conf`` takes the c10d rendezvous timings in whole seconds, and torch's
handler polls the shared state once a second, so a lost node costs 4-5 s before the survivors
form their next round (3 missed 1 s heartbeats, a 1 s last call, 1 s polls). Elastic longboat
jobs use the same handler, backend, state and protocol (torch's `DynamicRendezvousHandler` on
the c10d store), registered as the ``longboat-c10d`` backend with finer timings: a heartbeat
every `KEEP_ALIVE_S`, a node silent for `KEEP_ALIVE_S` x `KEEP_ALIVE_ATTEMPTS` counts as lost,
`LAST_CALL_S` of last call, and the state polled every `POLL_S`.

torch hard-codes the one-second poll (``_delay(seconds=1)`` in its op executor, and a one
second state cache); both are shortened for handlers of this process only.

A node that ends without the other nodes of its round (they went on to a later round, or were
lost) calls `LongboatHandler.leave_open`: its shutdown then only stops its heartbeats, so that
the nodes that go on are not told the job is over.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as _dynamic
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

#: The backend name `longboat launch` passes for ``--nnodes MIN:MAX``.
BACKEND = "longboat-c10d"
#: Seconds between a node's heartbeats.
KEEP_ALIVE_S = 0.25
#: Heartbeats a node may miss before the others drop it (1.5 s of silence).
KEEP_ALIVE_ATTEMPTS = 6
#: After MIN nodes joined a round, how long it waits for more before it starts.
LAST_CALL_S = 0.3
#: How often a waiting node reads the rendezvous state.
POLL_S = 0.1
#: Bound on finishing the rendezvous after it was closed.
CLOSE_S = 10.0
#: A launcher cut off from the rendezvous store gives up a store call after this long
#: (whole seconds; torch's default is 60).
STORE_READ_TIMEOUT_S = 10

_torch_delay = _dynamic._delay


def _poll_delay(seconds: float | tuple[float, float]) -> None:
    """torch's ``_delay``, with its fixed one-second state poll shortened to `POLL_S`."""
    _torch_delay(seconds=POLL_S if seconds == 1 else seconds)


class LongboatHandler(_dynamic.DynamicRendezvousHandler):
    """torch's c10d handler whose ``shutdown`` can leave the rendezvous open."""

    _leave_open = False

    def leave_open(self) -> None:
        """From now on ``shutdown`` stops this node's heartbeats and does not close the
        rendezvous (torch closes it: a node that finished means the job finished)."""
        self._leave_open = True

    def shutdown(self) -> bool:
        """torch's shutdown, or, after `leave_open`, this node's heartbeats stopped only (the
        others drop it once they expire)."""
        if not self._leave_open:
            return super().shutdown()
        self._stop_heartbeats()
        return True


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d handler for ``params`` (join timeout from ``join_timeout``), with the
    timings above."""
    backend, store = create_backend(params)
    settings = _dynamic.RendezvousSettings(
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        _dynamic.RendezvousTimeout(
            join=timedelta(seconds=float(params.get("join_timeout", 600))),
            last_call=timedelta(seconds=LAST_CALL_S),
            close=timedelta(seconds=CLOSE_S),
        ),
        keep_alive_interval=timedelta(seconds=KEEP_ALIVE_S),
        keep_alive_max_attempt=KEEP_ALIVE_ATTEMPTS,
    )
    node = _dynamic.DynamicRendezvousHandler._node_desc_generator.generate(params.local_addr)
    holder = _dynamic._BackendRendezvousStateHolder(backend, settings, cache_duration=POLL_S)
    _dynamic._delay = _poll_delay
    return LongboatHandler(node, settings, BACKEND, store, holder)


def register() -> None:
    """Make ``longboat-c10d`` a rendezvous backend torch's agent can create (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, create_handler)


# torch keeps the rendezvous state in a private holder of the handler; it is read here only
# to notice early what the next rendezvous round would find out anyway.


def synced_round(handler: Any) -> int | None:
    """The rendezvous round the handler last synced (None if it does not say)."""
    value = getattr(synced_state(handler), "round", None)
    return value if isinstance(value, int) else None


def lost_participants(handler: Any, round_nodes: int) -> int:
    """How many of the current round's ``round_nodes`` nodes the handler's last synced state
    no longer lists (their heartbeats expired, or they left for a new round); 0 if unknown."""
    state = synced_state(handler)
    participants = getattr(state, "participants", None)
    if not isinstance(participants, dict) or not getattr(state, "complete", False):
        return 0
    return max(0, round_nodes - len(participants))


def rendezvous_closed(handler: Any) -> bool:
    """Whether the handler's last synced state says the rendezvous was closed (a node finished
    the job and shut it down)."""
    return bool(getattr(synced_state(handler), "closed", False))


def synced_state(handler: Any) -> object:
    """The rendezvous state the handler last synced (torch's private holder; None if absent)."""
    return getattr(getattr(handler, "_state_holder", None), "state", None)
