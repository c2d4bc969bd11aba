"""See what the cluster does: timeline recorder, overlap statistics and picture, stall inspector.

    strategy = lb.Strategy(timeline="trace.json")   # or LONGBOAT_TIMELINE=trace.json
    for x, y in lb.trace.data(loader):              # optional: record waits for input
        ...
    # at exit: trace.rank<r>.json per rank, merged into trace.json by rank 0
    # longboat timeline trace.json -o overlap.png

The stall inspector is on by default (``stall_warning_seconds`` = 60).
"""

import sys

from longboat.trace.observer import Observer, attach, data, save
from longboat.trace.recorder import Recorder, load, merge, rank_path
from longboat.trace.stall import STALL_EXIT_CODE, StallWatch, missing_report
from longboat.trace.stats import RankStats, rank_stats, summary_table

trace = sys.modules[__name__]  # so that `lb.trace` resolves through longboat's lazy exports

__all__ = [
    "STALL_EXIT_CODE",
    "Observer",
    "RankStats",
    "Recorder",
    "StallWatch",
    "attach",
    "data",
    "load",
    "merge",
    "missing_report",
    "rank_path",
    "rank_stats",
    "save",
    "summary_table",
]
