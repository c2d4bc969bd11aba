"""What `longboat launch` prints when a job fails, and when the agent restarts it."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from longboat.launch.elastic_agent import MembershipChange
from longboat.launch.exits import GroupFailure, stopped_ranks
from longboat.launch.logs import log_name as _log_name
from longboat.launch.supervisor import Restart
from longboat.trace.stall import STALL_EXIT_CODE

TAIL_LINES = 20
STALL_MARK = "Missing ranks:"
_BLOCK = 1 << 16
#: how far from the end of a log the stall report is looked for (a stall ends a job soon after)
STALL_SCAN_BYTES = 8 << 20


def failure_summary(
    report: GroupFailure,
    log_dir: str,
    host: str,
    servers: int = 0,
    names: Mapping[int, str] | None = None,
) -> str:
    """The first failed rank and how it ended, the later ones, the ranks the launcher stopped,
    the last stall report of each failed rank that logged one (a rank the stall inspector shut
    down, or one whose wait the job timeout ended), and the first rank's log tail. ``names``:
    each rank's log file name where it is not ``log_name(rank, servers)``."""

    def log_name(rank: int, servers: int) -> str:
        return names[rank] if names and rank in names else _log_name(rank, servers)

    first = report.first
    reports = []  # (rank, its log, its last stall report) of every failed rank that logged one
    for cause in report.causes:
        path = os.path.join(log_dir, log_name(cause.rank, servers))
        found = last_line_with(path, STALL_MARK, STALL_SCAN_BYTES)
        if found or cause.exitcode == STALL_EXIT_CODE:
            reports.append((cause.rank, path, found))
    failed = {c.rank for c in report.causes}
    stalled = sorted({r for _, _, found in reports for r in missing_ranks(found)} - failed)
    ended = f"rank {first.rank} {first.how()} on host {host}"
    if stalled:  # the ranks others waited for come first: they are where to look
        who = f"rank {stalled[0]}" if len(stalled) == 1 else f"ranks {', '.join(map(str, stalled))}"
        lines = [
            f"longboat launch: {who} stopped responding (the stall report below names "
            f"{'it' if len(stalled) == 1 else 'them'} missing; look at "
            f"{'its' if len(stalled) == 1 else 'their'} logs); waiting for "
            f"{'it' if len(stalled) == 1 else 'them'}, {ended}"
        ]
    else:
        lines = [f"longboat launch: {ended}"]
    later = [f"rank {c.rank} {c.how()}" for c in report.causes[1:]]
    if later:
        lines.append("then: " + "; ".join(later))
    if report.stopped:
        lines.append("stopped by the launcher as a consequence: " + stopped_ranks(report.stopped))
    for rank, path, found in reports:
        label = f'last "{STALL_MARK}" line of {path}'
        lines.append(f"--- stall report of rank {rank} ({label}) ---")
        lines.append(found or "(none found in the log)")
    for rank in stalled:
        path = os.path.join(log_dir, log_name(rank, servers))
        lines.append(f"--- last {TAIL_LINES} lines of {path} (a rank the others waited for) ---")
        lines.append(tail(path))
    path = os.path.join(log_dir, log_name(first.rank, servers))
    lines.append(f"--- last {TAIL_LINES} lines of {path} ---")
    lines.append(tail(path))
    return "\n".join(lines)


def missing_ranks(stall_report: str | None) -> list[int]:
    """The ranks a stall report's ``Missing ranks: r: [...]; s: [...]`` names."""
    if not stall_report or STALL_MARK not in stall_report:
        return []
    listed = stall_report.split(STALL_MARK, 1)[1]
    return [int(r) for r in re.findall(r"(?:^|;)\s*(\d+): \[", listed)]


def restart_line(restart: Restart) -> str:
    """One console line per restart: why, which attempt, and how long the group was down."""
    if restart.failure is None:
        return (
            "longboat launch: restarted the group for a node joining the rendezvous (not counted "
            f"as an attempt); workers started again after {restart.resume_s:.2f} s"
        )
    first = restart.failure.first
    stopped = restart.failure.stopped
    return (
        f"longboat launch: restart attempt {restart.attempt} of {restart.max_restarts} after "
        f"rank {first.rank} {first.how()}"
        + (f" (stopped by the launcher: {stopped_ranks(stopped)})" if stopped else "")
        + f"; workers started again {restart.resume_s:.2f} s after the failure was seen"
    )


def membership_line(change: MembershipChange) -> str:
    """One console line per membership change of an elastic job: who left or joined, why,
    the new world size and how long the round took."""
    m = change.membership
    moved = [f"{', '.join(m.left)} left"] if m.left else []
    moved += [f"{', '.join(m.joined)} joined"] if m.joined else []
    what = "; ".join(moved) or "same nodes, new round"
    return (
        f"longboat launch: membership changed: {what} ({m.reason}); world size "
        f"{change.old_world_size} -> {m.world_size} on {m.group_world_size} "
        f"node{'s' if m.group_world_size != 1 else ''}, this node is node {m.group_rank}; "
        f"rendezvous took {change.seconds:.2f} s"
    )


def tail(path: str, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file, or why there are none."""
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().rstrip().splitlines()[-lines:]) or "(empty log)"
    except OSError:
        return "(no log was written)"


def last_line_with(path: str, mark: str, max_bytes: int | None = None) -> str | None:
    """The last line of ``path`` containing ``mark``, read from the end (logs can be large),
    looking at most ``max_bytes`` back when given."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError:
        return None
    needle = mark.encode()
    with f:
        end = f.seek(0, os.SEEK_END)
        stop = 0 if max_bytes is None else max(0, end - max_bytes)
        rest = b""
        while end > stop:
            start = max(stop, end - _BLOCK)
            f.seek(start)
            chunk = f.read(end - start) + rest
            lines = chunk.split(b"\n")
            rest = lines.pop(0) if start > stop else b""  # may continue in the previous block
            for line in reversed(lines):
                if needle in line:
                    return line.decode(errors="replace").rstrip()
            end = start
    return None
