"""`longboat timeline trace.json [-o overlap.png]`: overlap statistics and picture of a recorded run.

Reads a merged trace (or merges the per-rank ``trace.rank<r>.json`` files next to it first),
prints per rank: step time, computation, communication, the fraction of communication hidden
behind computation, exposed communication, input waits and idle time.
"""

from __future__ import annotations

import argparse
import json

from longboat.trace import load, rank_stats, summary_table
from longboat.trace.stats import mean


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace file written with Strategy(timeline=...)")
    p.add_argument("-o", "--output", default=None, help="write the overlap picture (PNG) here")
    p.add_argument(
        "--last-steps",
        type=int,
        default=3,
        help="steps shown in the picture (the last N; 0 = the whole run; default 3)",
    )
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        events = load(args.trace)
    except (FileNotFoundError, json.JSONDecodeError, KeyError) as exc:
        print(f"longboat timeline: cannot read {args.trace}: {exc}")
        return 2
    stats = rank_stats(events)
    if not stats:
        print(f"longboat timeline: {args.trace} holds no spans (was any step recorded?)")
        return 2
    if args.json:
        print(json.dumps({"ranks": [s.to_dict() for s in stats], "mean": mean(stats).to_dict()}))
    else:
        print(f"{args.trace}: {len(stats)} rank(s); times in ms, totals over the recorded run")
        print(summary_table(stats))
    if args.output:
        from longboat.trace.plot import plot

        out = plot(events, args.output, last_steps=args.last_steps or None)
        if not args.json:
            print(f"overlap picture: {out}")
    return 0
