"""Give up forming a round's process group as soon as the launchers publish a newer round.

While a rank forms its group in round R (``init_process_group`` on R's namespace of the
store), a member of R may die, and its node's restarted ranks go on to a newer round. The
rank would then wait for them under R's keys until the failure timeout, and the others would
wait for it in the newer round. A watch thread reads each publication while the group forms;
when a newer round appears it shuts down (``shutdown(2)``) the connections to the rendezvous
store this process opened since forming began (its store client of R), so the blocked wait
for R's peers fails at once and the rank takes up the newer round. Links to peers are left
alone: Gloo bounds their connection attempts itself, and cutting one under its event loop
would abort the process.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from longboat.elastic.lost_links import endpoint, shut_down, socket_inodes, tcp_peers
from longboat.elastic.membership import read_membership
from longboat.log import get_logger

_log = get_logger("longboat.elastic")
_POLL_S = 0.1


class _Watch:
    def __init__(self, directory: Path, token: str, store: tuple[str | None, int]) -> None:
        self._directory = directory
        self._token = token
        self._store = store
        self._before = set(socket_inodes())
        self._done = threading.Event()
        self.newer = ""
        self._thread = threading.Thread(target=self._run, name="longboat-forming", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._done.wait(_POLL_S):
            if not self.newer:
                try:
                    published = read_membership(self._directory)
                except (OSError, ValueError, TypeError):  # being replaced: next poll
                    continue
                if published is None or published.token == self._token:
                    continue
                self.newer = published.token
            # every poll from then on: the attempt may still be opening connections
            peers = tcp_peers()
            opened = [
                (fd, i) for i, fd in socket_inodes().items() if peers.get(i) == self._store
            ]
            closed = shut_down([(fd, i) for fd, i in opened if i not in self._before])
            self._before |= {i for _, i in opened}
            if closed:
                _log.warning(
                    "round %s was replaced by round %s while its process group formed: "
                    "closed %d connection(s) of it to take up the new round",
                    self._token,
                    self.newer,
                    closed,
                )


@contextlib.contextmanager
def abandoned_when_replaced(directory: Path, token: str, store: str) -> Iterator[_Watch]:
    """Within the block, forming round ``token``'s group on the store at ``store``
    (``HOST:PORT``) fails at once when the launcher publishes another round in ``directory``
    (the yielded watch's ``newer`` names it)."""
    watch = _Watch(directory, token, endpoint(store))
    try:
        yield watch
    finally:
        watch.stop()
