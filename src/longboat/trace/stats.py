"""Overlap statistics of a timeline: step time, communication, how much of it was hidden, idle.

Per rank, over the window from its first ``forward`` (its first event when it has none; so
start-up such as a parameter-server trainer's init and first barrier is left out) to its last
event:

- compute: union of spans with category ``compute`` (forward, backward) or ``optimizer``, minus
  the ``wait`` spans inside them (a forward blocked on a parameter-server lookup is not computing);
- comm: union of the spans on the ``comm*`` lanes (a communicator busy with a bucket) and on the
  ``ps*`` lanes (a parameter-server call in flight);
- hidden: the part of comm that overlaps compute; ``hidden_fraction = hidden / comm``;
- exposed comm: ``comm - hidden`` (what the step waited for);
- data: union of ``data`` spans (waiting for input);
- idle: the window minus everything above.

Step time is the median gap between consecutive ``forward`` starts (the window when only one).
Times are in milliseconds, totals over the window and per step.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

Interval = tuple[float, float]

COMPUTE_CATS = ("compute", "optimizer")


def is_comm_lane(lane: str) -> bool:
    """``comm0``.. (communicators) and ``ps``, ``ps1``.. (parameter-server calls)."""
    return lane.startswith("comm") or lane == "ps" or (lane[:2] == "ps" and lane[2:].isdigit())


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time as ``intervals``."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: Sequence[Interval]) -> float:
    """Total length of disjoint intervals."""
    return sum(e - s for s, e in intervals)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two sorted disjoint interval lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The parts of sorted disjoint intervals ``a`` outside sorted disjoint intervals ``b``."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


@dataclass(frozen=True)
class RankStats:
    """One rank's figures (milliseconds)."""

    rank: int
    steps: int
    step_ms: float
    window_ms: float
    compute_ms: float
    comm_ms: float
    hidden_ms: float
    exposed_comm_ms: float
    data_ms: float
    idle_ms: float

    @property
    def hidden_fraction(self) -> float:
        """Fraction of communication time overlapped by computation (1.0 without comm)."""
        return self.hidden_ms / self.comm_ms if self.comm_ms > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"hidden_fraction": self.hidden_fraction}


def rank_stats(events: Sequence[dict[str, Any]]) -> list[RankStats]:
    """Statistics per rank (``pid``) of Chrome trace events as the recorder writes them."""
    lane_of: dict[tuple[int, int], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            lane_of[(e["pid"], e["tid"])] = e["args"]["name"]
    spans: dict[int, dict[str, list[Interval]]] = defaultdict(lambda: defaultdict(list))
    forwards: dict[int, list[float]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        pid, start = e["pid"], float(e["ts"])
        interval = (start, start + float(e.get("dur", 0.0)))
        lane = lane_of.get((pid, e["tid"]), "")
        if is_comm_lane(lane):
            kind = "comm"
        elif lane == "data" or e.get("cat") == "data":
            kind = "data"
        elif e.get("cat") in COMPUTE_CATS:
            kind = "compute"
        elif e.get("cat") == "wait":
            kind = "wait"
        else:
            kind = "other"  # e.g. waits: busy-looking, but neither compute nor comm
        spans[pid][kind].append(interval)
        spans[pid]["all"].append(interval)
        if e.get("name") == "forward":
            forwards[pid].append(start)
    return [_one(pid, spans[pid], sorted(forwards[pid])) for pid in sorted(spans)]


def _one(rank: int, spans: dict[str, list[Interval]], forwards: list[float]) -> RankStats:
    every = union(spans["all"])
    window = (every[0][0], every[-1][1]) if every else (0.0, 0.0)
    if forwards:
        window = (max(window[0], forwards[0]), window[1])

    def within(kind: str) -> list[Interval]:
        return intersect(union(spans[kind]), [window])

    compute, comm, data = (within(k) for k in ("compute", "comm", "data"))
    compute = subtract(compute, within("wait"))
    busy = union(compute + comm + data)
    hidden = length(intersect(comm, compute))
    gaps = [b - a for a, b in zip(forwards, forwards[1:], strict=False)]
    width = window[1] - window[0]
    ms = 1e-3  # trace times are microseconds
    return RankStats(
        rank=rank,
        steps=max(len(forwards), 1),
        step_ms=(statistics.median(gaps) if gaps else width) * ms,
        window_ms=width * ms,
        compute_ms=length(compute) * ms,
        comm_ms=length(comm) * ms,
        hidden_ms=hidden * ms,
        exposed_comm_ms=(length(comm) - hidden) * ms,
        data_ms=length(data) * ms,
        idle_ms=(width - length(busy)) * ms,
    )


def summary_table(stats: Sequence[RankStats]) -> str:
    """A plain-text table: one line per rank and a mean line."""
    head = (
        f"{'rank':>5} {'steps':>5} {'step ms':>9} {'compute ms':>10} {'comm ms':>9} "
        f"{'hidden':>7} {'exposed ms':>10} {'data ms':>8} {'idle ms':>8}"
    )
    lines = [head]

    def row(label: str, s: RankStats) -> str:
        return (
            f"{label:>5} {s.steps:>5} {s.step_ms:>9.2f} {s.compute_ms:>10.2f} {s.comm_ms:>9.2f} "
            f"{s.hidden_fraction:>7.1%} {s.exposed_comm_ms:>10.2f} {s.data_ms:>8.2f} "
            f"{s.idle_ms:>8.2f}"
        )

    lines += [row(str(s.rank), s) for s in stats]
    if len(stats) > 1:
        lines.append(row("mean", mean(stats)))
    return "\n".join(lines)


def mean(stats: Sequence[RankStats]) -> RankStats:
    """Field-wise mean over ranks (rank -1)."""
    means = {
        k: statistics.fmean(getattr(s, k) for s in stats)
        for k in RankStats.__dataclass_fields__
        if k not in ("rank", "steps")
    }
    steps = round(statistics.fmean(s.steps for s in stats))
    return RankStats(rank=-1, steps=steps, **means)
