"""Bucket timeline: collectives launched in plan order, one at a time per communicator,
sharing the link with the collectives of the other communicators in flight.

Each job is ``(ready, comm, latency, work)``: launched at ``max(ready, previous launch)`` (the
reducer launches buckets strictly in plan order), started when its communicator is free; it
then spends ``latency`` seconds alone, then ``work`` seconds of exclusive link time, progressing
at rate ``1/k`` while ``k`` jobs are in their link phase (processor sharing).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

_EPS = 1e-15


@dataclass(frozen=True)
class Job:
    ready: float
    comm: int
    latency: float
    work: float


def finish_times(jobs: Sequence[Job]) -> list[float]:
    """Finish time of every job (same order)."""
    return schedule(jobs)[1]


def busy_before(jobs: Sequence[Job], end: float) -> float:
    """Seconds in ``[0, end]`` during which at least one job is in flight."""
    starts, finishes = schedule(jobs)
    busy, reach = 0.0, 0.0
    for s, f in sorted(zip(starts, finishes, strict=True)):
        s, f = max(s, reach), min(f, end)
        if f > s:
            busy += f - s
            reach = f
    return busy


def schedule(jobs: Sequence[Job]) -> tuple[list[float], list[float]]:
    """Start (latency phase begins) and finish time of every job (same order)."""
    if not jobs:
        return [], []
    run = _Run(jobs)
    t = 0.0
    while run.left:
        run.start(t)
        sharing = run.sharing(t)
        nxt = run.next_event(t, sharing)
        run.advance(sharing, max(0.0, nxt - t))
        t = nxt
        run.retire(t)
    return run.started, run.done


def _launch_times(jobs: Sequence[Job]) -> list[float]:
    """When each job is launched: when it is ready, but never before the one before it."""
    launch: list[float] = []
    for job in jobs:
        launch.append(max(job.ready, launch[-1] if launch else job.ready))
    return launch


class _Run:
    """The state of one `schedule`: each communicator's queue, the job it runs, and every
    running job's end of latency and link work left."""

    def __init__(self, jobs: Sequence[Job]) -> None:
        self.jobs = jobs
        self.launch = _launch_times(jobs)
        self.queues: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            self.queues.setdefault(job.comm, []).append(i)
        self.heads = dict.fromkeys(self.queues, 0)
        self.free_at = dict.fromkeys(self.queues, 0.0)
        self.running: dict[int, int] = {}  # comm -> job index
        self.lat_end: dict[int, float] = {}
        self.remaining: dict[int, float] = {}
        self.started = [0.0] * len(jobs)
        self.done = [0.0] * len(jobs)
        self.left = len(jobs)

    def _waiting(self) -> Iterator[tuple[int, int]]:
        """(communicator, its next job) for each idle communicator with jobs left."""
        for comm, q in self.queues.items():
            if comm not in self.running and self.heads[comm] < len(q):
                yield comm, q[self.heads[comm]]

    def start(self, t: float) -> None:
        """Start the next job of every idle communicator whose job is launched by ``t``."""
        for comm, i in self._waiting():
            if self.launch[i] <= t + _EPS and self.free_at[comm] <= t + _EPS:
                self.running[comm] = i
                self.started[i] = t
                self.heads[comm] += 1
                self.lat_end[i] = t + self.jobs[i].latency
                self.remaining[i] = self.jobs[i].work

    def sharing(self, t: float) -> list[int]:
        """The running jobs past their latency at ``t``: those sharing the link."""
        return [i for i in self.running.values() if self.lat_end[i] <= t + _EPS]

    def next_event(self, t: float, sharing: list[int]) -> float:
        """The next end of a latency phase, end of link work, or launch onto a free communicator."""
        k = len(sharing)
        candidates = [self.lat_end[i] for i in self.running.values() if self.lat_end[i] > t + _EPS]
        candidates += [t + self.remaining[i] * k for i in sharing]
        candidates += [max(self.launch[i], self.free_at[comm]) for comm, i in self._waiting()]
        return min(candidates)

    def advance(self, sharing: list[int], dt: float) -> None:
        """``dt`` seconds of link time, shared evenly by the ``sharing`` jobs."""
        k = len(sharing)
        for i in sharing:
            self.remaining[i] -= dt / k

    def retire(self, t: float) -> None:
        """Finish, at ``t``, the running jobs with no latency or link work left."""
        for comm, i in list(self.running.items()):
            if self.lat_end[i] <= t + _EPS and self.remaining[i] <= _EPS * max(
                1.0, self.jobs[i].work
            ):
                self.done[i] = t
                self.free_at[comm] = t
                del self.running[comm]
                self.left -= 1
