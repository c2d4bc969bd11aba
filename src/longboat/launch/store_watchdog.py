"""End a launcher whose calls to the rendezvous store stopped returning.

torch's TCP store client can block in ``recv`` for good once the link to the store is gone
(seen on a node whose link was cut: the first call times out, the next one never returns), so
the elastic agent's monitor loop would hang with its ranks. `StoreWatchdog` bounds those
calls: a call that has not returned ``seconds`` after it began runs ``give_up`` (which stops
this node's ranks and ends the launcher) from the watchdog's own thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

_TICK_S = 0.5


class StoreWatchdog:
    """Bounds calls made under `bounded` to ``seconds``; ``give_up(seconds)`` on overrun."""

    def __init__(self, seconds: float, give_up: Callable[[float], None]):
        self.seconds = seconds
        self._give_up = give_up
        self._deadline: float | None = None
        self._fired = False
        self._thread = threading.Thread(
            target=self._watch, name="longboat-store-watch", daemon=True
        )
        self._thread.start()

    @contextlib.contextmanager
    def bounded(self) -> Iterator[None]:
        """Run the block under the bound (not re-entrant)."""
        self._deadline = time.monotonic() + self.seconds
        try:
            yield
        finally:
            self._deadline = None

    def _watch(self) -> None:
        while not self._fired:
            time.sleep(_TICK_S)
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._fired = True
                self._give_up(self.seconds)
