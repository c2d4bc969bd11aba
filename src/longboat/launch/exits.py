"""How the workers of a failed attempt ended, and which of them caused the failure.

The agent notes, for every worker, when it first saw the process exited (`ExitWatch`), its
exit status, and whether the launcher was already stopping the group while it still ran.
`classify` turns those notes into a `GroupFailure`: the ranks that failed on their own, first
failure first, and the ranks the launcher stopped as a consequence.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass

#: how much earlier than a rank's exit was seen another rank's error file must have been written
#: to count as the first failure (a sighting lags the exit; file times are coarse)
RAISE_MARGIN_S = 0.5


@dataclass(frozen=True)
class WorkerEnd:
    """What the agent saw of one worker process.

    ``exitcode`` is negative for a signal and None when the status could not be read;
    ``seen_at`` is wall-clock time (None: never seen exited), ``raised_at`` when its error file
    (traceback) was written (None: none written); ``stopped``: still running when the launcher
    began stopping the group.
    """

    rank: int
    exitcode: int | None
    seen_at: float | None
    raised_at: float | None
    stopped: bool
    error_file: str = ""


@dataclass(frozen=True)
class RankExit:
    """One rank in a failure report: its exit status, whether it wrote an error file
    (traceback), and whether the launcher stopped it."""

    rank: int
    exitcode: int | None
    raised: bool = False
    stopped: bool = False
    error_file: str = ""

    @property
    def signal_name(self) -> str | None:
        """``SIGKILL`` for a rank ended by that signal, else None."""
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def how(self) -> str:
        """``exited with code 3``, ``was killed by SIGKILL``, ... (for a failed rank)."""
        if self.stopped:
            return "raised an error and was then stopped by the launcher"
        if self.signal_name:
            return f"was killed by {self.signal_name}"
        if self.exitcode is None:
            return "ended (exit status unknown)"
        return f"exited with code {self.exitcode}"

    def ending(self) -> str:
        """``SIGTERM`` or ``exit code 1`` (for a stopped rank)."""
        if self.signal_name:
            return self.signal_name
        if self.exitcode is None:
            return "exit status unknown"
        return f"exit code {self.exitcode}"


@dataclass(frozen=True)
class GroupFailure:
    """A failed attempt: ``causes`` failed on their own (first failure first), ``stopped`` were
    still running when the launcher stopped the group because of them."""

    causes: tuple[RankExit, ...]
    stopped: tuple[RankExit, ...]

    @property
    def first(self) -> RankExit:
        return self.causes[0]


def stopped_ranks(exits: Iterable[RankExit]) -> str:
    """``rank 0 (SIGTERM), rank 3 (exit code 1)``: stopped ranks and how they ended."""
    return ", ".join(f"rank {e.rank} ({e.ending()})" for e in exits)


def classify(ends: Iterable[WorkerEnd]) -> GroupFailure | None:
    """Order the failures of one attempt by what happened first; None when nothing failed.

    A rank failed when it ended with a non-zero status before the launcher began stopping the
    group. Failures are ordered by when the agent saw each process exit; ties (one sighting)
    put a rank killed by a signal first, as a signal cannot be a reaction to a peer's exit and
    an exception can. One exception: a rank that wrote its error file (it raised) before the
    first failure did goes first, even if it was still exiting when the launcher stopped it.
    "Before" compares error files with each other; against an exit sighting only (no error
    file), it needs a margin of `RAISE_MARGIN_S`, as a sighting comes a little after the exit.
    """
    ends = list(ends)
    causes = sorted((e for e in ends if not e.stopped and _failed(e)), key=_sighting)
    if not causes:
        return None
    first = causes[0]
    raised = [
        e for e in ends if e.raised_at is not None and e is not first and (e.stopped or _failed(e))
    ]
    earliest = min(raised, key=lambda e: e.raised_at or 0.0, default=None)
    if earliest is not None and _raised_before(earliest, first):
        causes = [earliest] + [c for c in causes if c is not earliest]
    failed = {c.rank for c in causes}
    return GroupFailure(
        tuple(_exit(c) for c in causes),
        tuple(_exit(e) for e in ends if e.stopped and e.rank not in failed),
    )


def _failed(end: WorkerEnd) -> bool:
    if end.exitcode is None:
        return end.raised_at is not None
    return end.exitcode != 0


def _sighting(end: WorkerEnd) -> tuple[float, bool, int]:
    own_signal = end.exitcode is not None and end.exitcode < 0
    seen = end.seen_at if end.seen_at is not None else float("inf")
    return seen, not own_signal, end.rank


def _raised_before(end: WorkerEnd, first: WorkerEnd) -> bool:
    assert end.raised_at is not None
    if first.raised_at is not None:
        return end.raised_at < first.raised_at
    if first.seen_at is not None:
        return end.raised_at < first.seen_at - RAISE_MARGIN_S
    return False


def _exit(end: WorkerEnd) -> RankExit:
    return RankExit(
        rank=end.rank,
        exitcode=end.exitcode,
        raised=end.raised_at is not None,
        stopped=end.stopped,
        error_file=end.error_file,
    )
