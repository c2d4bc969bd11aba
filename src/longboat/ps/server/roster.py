"""Which trainers a parameter server expects, and since when it has not heard from them.

A trainer that something waits for and that has been silent (no call in progress, none
ended) for ``timeout`` seconds may be dropped (``ServerState.drop_silent``): later sync steps
and barriers stop waiting for it, and its pushes are refused (``Dropped``) until it calls
``join``, which makes the server expect it again from the step it names.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

from longboat.log import get_logger
from longboat.ps.server.limits import TRAINER_TIMEOUT_ENV
from longboat.ps.shared.request import DROPPED, Dropped

GONE = math.inf  # TrainerRoster.back_at of a dropped trainer that has not rejoined

log = get_logger("longboat.ps")


class TrainerRoster:
    """The trainers of server ``server``'s job and their liveness records (read on ``clock``);
    every method runs under the server state's lock."""

    def __init__(self, server: int, timeout: float, clock: Callable[[], float]) -> None:
        self.server = server
        self.trainers = 0  # the job's trainers (0: not known yet)
        self.timeout, self.clock = timeout, clock
        self.last_seen: dict[int, float] = {}  # trainer -> when a call of it started or ended
        self.busy: dict[int, int] = {}  # trainer -> its calls in progress
        self.last_step: dict[int, int] = {}  # trainer -> the highest sync step it pushed
        self.back_at: dict[int, float] = {}  # trainer -> first step it is expected at (GONE)
        self.dropped_at: dict[int, int] = {}  # trainer -> the step that was waiting when dropped
        self.joined: set[int] = set()  # trainers that called join
        self._refusals: set[tuple[int, int]] = set()  # (trainer, step) refusals logged

    def present(self) -> set[int]:
        """The trainers barriers wait for: all but those dropped and not rejoined."""
        return {t for t in range(max(self.trainers, 1)) if self.back_at.get(t, 0) != GONE}

    def expected(self, step: int) -> set[int]:
        """The trainers whose pushes sync step ``step`` waits for."""
        return {t for t in range(self.trainers) if self.back_at.get(t, 0) <= step}

    def touch(self, trainer: Any) -> None:
        """A sign of life of ``trainer`` (ignored unless a trainer index of this job)."""
        if isinstance(trainer, int) and 0 <= trainer < self.trainers:
            self.last_seen[trainer] = self.clock()

    @contextlib.contextmanager
    def calling(self, trainer: int | None) -> Iterator[None]:
        """``trainer`` has a call in progress (it is not silent meanwhile)."""
        if trainer is None or not 0 <= trainer < self.trainers:
            yield
            return
        self.touch(trainer)
        self.busy[trainer] = self.busy.get(trainer, 0) + 1
        try:
            yield
        finally:
            self.busy[trainer] -= 1
            self.touch(trainer)

    def pushed(self, trainer: int, step: int) -> None:
        """``trainer``'s sync push of ``step`` was accepted."""
        self.last_step[trainer] = max(step, self.last_step.get(trainer, step))

    def lost_push(self, trainer: int | None, version: int) -> bool:
        """``trainer`` never pushed the step before ``version`` here and did not join at
        ``version`` (this server restarted from an older checkpoint and lost that push)."""
        return (
            trainer is not None
            and self.last_step.get(trainer, -1) < version - 1
            and self.back_at.get(trainer, 0) < version
        )

    def refuse_if_dropped(self, trainer: int, step: int) -> None:
        """Raise ``Dropped`` for a sync push of ``step`` the server no longer expects from
        ``trainer`` (dropped, and not rejoined for that step)."""
        back = self.back_at.get(trainer, 0)
        if back <= step:
            return
        state = "has not rejoined" if back == GONE else f"rejoined from step {int(back)}"
        text = (
            f"server {self.server}: trainer {trainer}'s push of step {step} is refused (not "
            f"applied): the trainer {DROPPED} at step {self.dropped_at.get(trainer, step)} "
            f"after {TRAINER_TIMEOUT_ENV}={self.timeout:g} s of silence and {state}"
        )
        if (trainer, step) not in self._refusals:
            self._refusals.add((trainer, step))
            log.warning("%s", text)
        raise Dropped(f"{text}; its engine rejoins by itself (PSEngine.rejoin)")

    def silence(self, trainer: int, now: float) -> float | None:
        """How long ``trainer`` has been silent at ``now`` if that is ``timeout`` or longer
        (None: never seen, still starting; in a call; or not silent long enough)."""
        seen = self.last_seen.get(trainer)
        if seen is None or self.busy.get(trainer) or now - seen < self.timeout:
            return None
        return now - seen

    def drop(self, trainer: int, step: int) -> None:
        """Stop expecting ``trainer``; ``step`` was waiting for it."""
        self.back_at[trainer] = GONE
        self.dropped_at[trainer] = step

    def rejoined(self, trainer: int) -> bool:
        """``trainer`` joined (or was dropped) before."""
        return trainer in self.joined or trainer in self.back_at

    def join(self, trainer: int, start: int) -> None:
        """Expect ``trainer`` from sync step ``start`` on."""
        self.back_at[trainer] = start
        self.joined.add(trainer)
        self.touch(trainer)

    def rolled_back(self) -> None:
        """The server loaded a checkpoint: every trainer is expected again, none has pushed a
        step since."""
        self.back_at.clear()
        self.last_step.clear()
