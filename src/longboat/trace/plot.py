"""The overlap picture: per rank, one row for compute and one per communicator
(or, for a parameter-server trainer, per ``ps`` lane of calls in flight)."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from longboat.trace.stats import is_comm_lane, rank_stats

_COLOURS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "optimizer": "#8172b2",
    "data": "#937860",
    "wait": "#c44e52",
    "comm": "#dd8452",
    "ps step": "#cfc8e6",  # a parameter-server trainer's whole step (mostly communication)
}


def _colour(lane: str, event: dict[str, Any]) -> str:
    if is_comm_lane(lane):
        return _COLOURS["comm"]
    if event.get("cat") == "wait":
        return _COLOURS["wait"]
    if event.get("cat") == "step":
        return _COLOURS["ps step"]
    return _COLOURS.get(event.get("name", ""), _COLOURS.get(lane, "#999999"))


_Row = tuple[int, int]  # (pid, tid): one rank's lane


def _lanes(events: Sequence[dict[str, Any]]) -> dict[_Row, str]:
    """Each row's lane name, from the trace's ``thread_name`` metadata."""
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }


def _spans_by_row(events: Sequence[dict[str, Any]]) -> dict[_Row, list[dict[str, Any]]]:
    """The complete (``X``) events of each row, in trace order."""
    by_row: dict[_Row, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_row[(e["pid"], e["tid"])].append(e)
    return by_row


def _ends_after(span: dict[str, Any], start: float) -> bool:
    return span["ts"] + span.get("dur", 0) >= start


def _draw_row(
    ax: Any, y: int, lane: str, spans: list[dict[str, Any]], start: float, used: set[str]
) -> None:
    """One row's spans from ``start`` on, as bars; adds the colours drawn to ``used``."""
    # waits last: drawn over the forward they interrupt (parameter-server lookups)
    for e in sorted(spans, key=lambda x: x.get("cat") == "wait"):
        if not _ends_after(e, start):
            continue
        x0 = (max(e["ts"], start) - start) / 1e3
        colour = _colour(lane, e)
        used.add(colour)
        ax.broken_barh(
            [(x0, e.get("dur", 0) / 1e3)],
            (y - 0.4, 0.8),
            facecolor=colour,
            edgecolor="white",
            linewidth=0.6,
        )


def _label(
    ax: Any, events: Sequence[dict[str, Any]], title: str, used: set[str], rows: int
) -> None:
    """The axis label, the title (by default with the share of communication hidden) and the
    legend of the colours drawn."""
    from matplotlib.patches import Patch

    ax.set_xlabel("time (ms)")
    stats = rank_stats(events)
    hidden = sum(s.hidden_ms for s in stats) / max(sum(s.comm_ms for s in stats), 1e-9)
    ax.set_title(title or f"compute and communication per rank ({hidden:.0%} of comm hidden)")
    ax.legend(
        handles=[Patch(color=c, label=n) for n, c in _COLOURS.items() if c in used],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18 if rows > 4 else -0.3),
        ncol=len(used) or 1,
        fontsize="small",
    )


def plot(
    events: Sequence[dict[str, Any]],
    out: str | os.PathLike[str],
    *,
    last_steps: int | None = 3,
    title: str = "",
) -> Path:
    """Draw the rows of every rank into a PNG at ``out``.

    ``last_steps``: show only the last N steps of the run (the whole run when None), so that
    individual buckets stay visible.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    lane_of = _lanes(events)
    by_row = _spans_by_row(events)
    start = _window_start(events, last_steps)
    rows = sorted(k for k in by_row if any(_ends_after(x, start) for x in by_row[k]))
    if not rows:
        raise ValueError("the trace has no spans to draw: was the timeline recording any steps?")
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.6))
    used: set[str] = set()
    for y, key in enumerate(rows):
        _draw_row(ax, y, lane_of[key], by_row[key], start, used)
    ax.set_yticks(range(len(rows)), [f"rank {p} {lane_of[(p, t)]}" for p, t in rows])
    ax.invert_yaxis()
    _label(ax, events, title, used, len(rows))
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _window_start(events: Sequence[dict[str, Any]], last_steps: int | None) -> float:
    """Start time of the last ``last_steps`` forwards of rank 0's (or the first rank's) run."""
    spans = [e for e in events if e.get("ph") == "X"]
    first = min((e["ts"] for e in spans), default=0.0)
    if last_steps is None:
        return first
    pid = min((e["pid"] for e in spans), default=0)
    forwards = sorted(e["ts"] for e in spans if e["pid"] == pid and e.get("name") == "forward")
    if len(forwards) <= last_steps:
        return first
    return forwards[-last_steps]
