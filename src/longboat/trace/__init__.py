"""See what the cluster does: timeline recorder, overlap statistics and picture, stall inspector.

    strategy = lb.Strategy(timeline="trace.json")   # or LONGBOAT_TIMELINE=trace.json
    for x, y in lb.trace.data(loader):              # optional: record waits for input
        ...
    # trace.rank<r>.json per rank, written as the run goes (bounded memory),
    # merged into trace.json by rank 0 at exit
    # longboat timeline trace.json -o overlap.png

Parameter-server trainers (``mode="ps"``) record the same way, with their calls to the servers
on the ``ps`` lanes (`longboat.trace.ps`). The stall inspector is on by default
(``stall_warning_seconds`` = 60): gradient buckets, the other collectives longboat issues
(``waiting``), and parameter-server replies; it logs its report before the job timeout ends a
wait.
"""

import sys

from longboat.trace.config import TraceConfig
from longboat.trace.observer import Observer, attach, current_observer, data, save
from longboat.trace.ps import PSObserver
from longboat.trace.recorder import Recorder, load, merge, rank_path
from longboat.trace.stall import (
    STALL_EXIT_CODE,
    CollectiveWatch,
    StallWatch,
    collective_watch,
    missing_report,
    waiting,
)
from longboat.trace.stats import RankStats, rank_stats, summary_table

trace = sys.modules[__name__]  # so that `lb.trace` resolves through longboat's lazy exports

__all__ = [
    "STALL_EXIT_CODE",
    "CollectiveWatch",
    "Observer",
    "PSObserver",
    "RankStats",
    "Recorder",
    "StallWatch",
    "TraceConfig",
    "attach",
    "collective_watch",
    "current_observer",
    "data",
    "load",
    "merge",
    "missing_report",
    "rank_path",
    "rank_stats",
    "save",
    "summary_table",
    "waiting",
]
