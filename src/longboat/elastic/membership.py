"""What a node's launcher and its ranks tell each other in an elastic job, through files.

The launcher (torch's elastic agent, see `longboat.launch.elastic_agent`) runs the c10d
rendezvous; the ranks it started keep running across rendezvous rounds. After each round it
writes ``membership.json`` into the node's elastic directory (``LONGBOAT_ELASTIC_DIR``,
``<log dir>/.elastic``): the round's token, world size, this node's ranks and the store the
ranks re-form their process group on. A rank that loses a peer writes ``request-<local
rank>`` (the token it saw and why) and the launcher joins the next round; a rank's committed
step count goes to ``commits-<local rank>`` (read by ``longboat emulate``'s step triggers, and
by the ranks of later rounds: a job never silently resumes below it); a rank that ends the job
on purpose writes ``stop-<local rank>`` so that its launcher does not restart it.

Files are written whole (temporary file + rename): a reader sees the old or the new content.
Nothing read here is unpickled; everything is JSON or a decimal number.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from longboat.cluster.env import variable

ENV_DIR = "LONGBOAT_ELASTIC_DIR"
MEMBERSHIP_FILE = "membership.json"


@dataclass(frozen=True)
class Membership:
    """One rendezvous round as this node's launcher saw it.

    ``ranks`` maps each local rank to its global rank in the round; ``store`` is the
    ``HOST:PORT`` of the rendezvous store and ``token`` names the round in it; ``nodes`` lists
    the nodes' addresses in group-rank order; ``left``/``joined`` compare with the round before,
    and ``reason`` says why the round happened.
    """

    token: str
    world_size: int
    group_rank: int
    group_world_size: int
    ranks: dict[int, int]
    store: str
    nodes: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)
    reason: str = ""

    def rank_of(self, local_rank: int) -> int:
        """The global rank of ``local_rank`` in this round."""
        try:
            return self.ranks[local_rank]
        except KeyError:
            raise ElasticError(
                f"local rank {local_rank} has no rank in round {self.token} "
                f"(this node's ranks: {sorted(self.ranks)})"
            ) from None


class ElasticError(RuntimeError):
    """An elastic job cannot go on (no membership in time, too many resets, ...)."""


def elastic_dir(env: dict[str, str] | None = None) -> Path | None:
    """This node's elastic directory, or None outside an elastic job."""
    raw = variable(ENV_DIR, env)
    return Path(raw) if raw else None


def require_elastic_dir() -> Path:
    """This node's elastic directory; ElasticError outside an elastic job."""
    directory = elastic_dir()
    if directory is None:
        raise ElasticError("not an elastic job: start it with longboat launch --nnodes MIN:MAX")
    return directory


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_membership(directory: Path, membership: Membership) -> None:
    """Publish ``membership`` to the node's ranks."""
    directory.mkdir(parents=True, exist_ok=True)
    data = asdict(membership)
    data["ranks"] = {str(k): v for k, v in membership.ranks.items()}
    _write_whole(directory / MEMBERSHIP_FILE, json.dumps(data, sort_keys=True))


def read_membership(directory: Path) -> Membership | None:
    """The membership last published in ``directory``, or None if there is none yet."""
    try:
        data: dict[str, Any] = json.loads((directory / MEMBERSHIP_FILE).read_text())
    except FileNotFoundError:
        return None
    data["ranks"] = {int(k): int(v) for k, v in data["ranks"].items()}
    return Membership(**data)


def request_regroup(directory: Path, local_rank: int, token: str, reason: str) -> None:
    """Ask the launcher for a new round: this rank lost a peer in round ``token``."""
    payload = json.dumps({"token": token, "reason": reason[:500]})
    _write_whole(directory / f"request-{local_rank}", payload)


def regroup_requests(directory: Path, token: str) -> list[str]:
    """Reasons of this node's ranks asking to leave round ``token`` (older requests ignored)."""
    reasons = []
    for path in sorted(directory.glob("request-*")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("token") == token:
            reasons.append(str(data.get("reason", "")))
    return reasons


def write_ack(directory: Path, local_rank: int, token: str) -> None:
    """This rank formed its process group in round ``token``."""
    _write_whole(directory / f"ack-{local_rank}", token)


def acknowledged(directory: Path, token: str) -> set[int]:
    """Local ranks of this node that formed their process group in round ``token``."""
    done = set()
    for path in directory.glob("ack-*"):
        try:
            if path.read_text() == token:
                done.add(int(path.name.partition("-")[2]))
        except (OSError, ValueError):
            continue
    return done


def write_commits(directory: Path, local_rank: int, commits: int) -> None:
    """Record this rank's committed step count (read by ``longboat emulate`` and by the
    ranks of a later round: the job never silently resumes below it)."""
    _write_whole(directory / f"commits-{local_rank}", str(int(commits)))


def highest_commits(directories: Iterable[Path]) -> int:
    """The highest committed step count recorded in any of ``directories`` (-1 if none).
    Missing, unreadable or partial files are skipped."""
    best = -1
    for directory in directories:
        try:
            paths = list(directory.glob("commits-*"))
        except OSError:
            continue
        for path in paths:
            try:
                text = path.read_text().strip()
            except OSError:
                continue
            if text.isdigit():
                best = max(best, int(text))
    return best


def write_stop(directory: Path, local_rank: int, reason: str) -> None:
    """This rank ends the job on purpose: its launcher must not restart it (restarting
    cannot help), and prints ``reason`` as the job's one line."""
    _write_whole(directory / f"stop-{local_rank}", reason[:2000])


def stop_reason(directory: Path) -> str:
    """Why a rank of this node ended the job on purpose ('' if none did)."""
    for path in sorted(directory.glob("stop-*")):
        with contextlib.suppress(OSError):
            return path.read_text()
    return ""


def clear_round_files(directory: Path) -> None:
    """Remove what an earlier job with the same log directory left: memberships, requests,
    acknowledgements, commit counts and stops. A launcher calls it once, before its ranks
    start: a new job starts from its own commit 0."""
    if not directory.is_dir():
        return
    for pattern in (MEMBERSHIP_FILE, "request-*", "ack-*", "commits-*", "stop-*"):
        for path in directory.glob(pattern):
            with contextlib.suppress(OSError):
                path.unlink()


def connect_store(membership: Membership, timeout: timedelta) -> Any:
    """A client of the rendezvous store, namespaced by the round: the ranks' process group
    forms there, so it lives as long as the rendezvous (not on any one rank)."""
    import torch.distributed as dist

    host, _, port = membership.store.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/longboat/elastic/{membership.token}", store)
