"""Bucket timeline: collectives launched in plan order, one at a time per communicator,
sharing the link with the collectives of the other communicators in flight.

Each job is ``(ready, comm, latency, work)``: launched at ``max(ready, previous launch)`` (the
reducer launches buckets strictly in plan order), started when its communicator is free; it
then spends ``latency`` seconds alone, then ``work`` seconds of exclusive link time, progressing
at rate ``1/k`` while ``k`` jobs are in their link phase (processor sharing).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    launch: list[float] = []
    for job in jobs:
        launch.append(max(job.ready, launch[-1] if launch else job.ready))
    queues: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        queues.setdefault(job.comm, []).append(i)
    heads = dict.fromkeys(queues, 0)
    free_at = dict.fromkeys(queues, 0.0)
    running: dict[int, int] = {}  # comm -> job index
    lat_end: dict[int, float] = {}
    remaining: dict[int, float] = {}
    done = [0.0] * len(jobs)
    started = [0.0] * len(jobs)
    t, left = 0.0, len(jobs)
    while left:
        for comm, q in queues.items():
            if comm not in running and heads[comm] < len(q):
                i = q[heads[comm]]
                if launch[i] <= t + _EPS and free_at[comm] <= t + _EPS:
                    running[comm] = i
                    started[i] = t
                    heads[comm] += 1
                    lat_end[i] = t + jobs[i].latency
                    remaining[i] = jobs[i].work
        sharing = [i for i in running.values() if lat_end[i] <= t + _EPS]
        k = len(sharing)
        candidates = [lat_end[i] for i in running.values() if lat_end[i] > t + _EPS]
        candidates += [t + remaining[i] * k for i in sharing]
        for comm, q in queues.items():
            if comm not in running and heads[comm] < len(q):
                candidates.append(max(launch[q[heads[comm]]], free_at[comm]))
        nxt = min(candidates)
        dt = max(0.0, nxt - t)
        for i in sharing:
            remaining[i] -= dt / k
        t = nxt
        for comm, i in list(running.items()):
            if lat_end[i] <= t + _EPS and remaining[i] <= _EPS * max(1.0, jobs[i].work):
                done[i] = t
                free_at[comm] = t
                del running[comm]
                left -= 1
    return started, done
