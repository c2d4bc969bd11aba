"""A rank's last commit kept on its node, outside the rank process.

Every rank of an elastic job holds its committed state in memory, so a failure that kills
every rank at once (an out-of-memory kill, a job-wide NCCL error) would lose it all. At every
commit `State` also hands its snapshot to `NodeCopy`: the snapshot is copied into a host
buffer (device tensors without blocking the host) and a writer thread saves it into the
node's copy directory (``torch.save`` to a temporary file, then a rename), replacing the
rank's older copy. The step never waits for the write; at most one copy is pending, and a
newer commit replaces it. A rank restarted on the node (one rank, or all of them after a
job-wide crash) takes the newest copy there and is a holder of the state again.

The launcher owns the directory (``LONGBOAT_ELASTIC_COPY_DIR``: shared memory under
``/dev/shm`` where there is one) and removes it when it ends. Unsharded state is the same on
every rank, so local rank 0 alone writes it; with a sharded optimizer every rank writes its
own slices. Files are named ``state-<local rank>-<commits>.pt`` and read with
``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch

from longboat.cluster.env import variable
from longboat.elastic.membership import elastic_dir
from longboat.elastic.snapshot import TensorTree
from longboat.log import get_logger

_log = get_logger("longboat.elastic")
ENV_COPY_DIR = "LONGBOAT_ELASTIC_COPY_DIR"
_NAME = re.compile(r"state-(\d+)-(\d+)\.pt")


def copy_dir() -> Path | None:
    """This node's copy directory: the launcher's, else ``<elastic dir>/copies``; None
    outside an elastic job."""
    given = variable(ENV_COPY_DIR)
    if given:
        return Path(given)
    directory = elastic_dir()
    return directory / "copies" if directory is not None else None


def _copies(directory: Path, local_rank: int) -> list[tuple[int, Path]]:
    """``(commits, path)`` of ``local_rank``'s copies in ``directory``, newest first."""
    found = []
    with contextlib.suppress(OSError):
        for path in directory.iterdir():
            match = _NAME.fullmatch(path.name)
            if match and int(match.group(1)) == local_rank:
                found.append((int(match.group(2)), path))
    return sorted(found, reverse=True)


def newest(directory: Path, local_rank: int) -> tuple[int, dict[str, Any]] | None:
    """The commit count and content of ``local_rank``'s newest readable copy, or None."""
    for commits, path in _copies(directory, local_rank):
        try:
            return commits, torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:  # cut short by a full disk, say: an older one may do
            _log.warning("skipping the unreadable node copy %s: %s", path, exc)
    return None


class NodeCopy:
    """Writes one rank's committed snapshots into ``directory`` on a background thread."""

    def __init__(self, directory: Path, local_rank: int) -> None:
        self._dir = directory
        self._local_rank = local_rank
        self._cond = threading.Condition()
        self._trees = (TensorTree(host=True), TensorTree(host=True))
        self._pending: tuple[int, TensorTree] | None = None
        self._writing: TensorTree | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self.written = -1  # commits of the newest copy on disk

    def offer(self, commits: int, snapshot: dict[str, Any]) -> None:
        """Copy ``snapshot`` (of commit ``commits``) to host memory and queue it for writing;
        it replaces a copy still waiting. Returns without waiting for the disk."""
        with self._cond:
            tree = self._trees[1] if self._writing is self._trees[0] else self._trees[0]
            tree.save(snapshot)
            self._pending = (commits, tree)
            self._cond.notify()
        if self._thread is None:
            self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._thread = threading.Thread(
                target=self._run, name="longboat-node-copy", daemon=True
            )
            self._thread.start()

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every offered copy is written; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._writing is not None:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                commits, tree = self._pending
                self._pending, self._writing = None, tree
            try:
                tree.ready()
                self._write(commits, tree.tree)
            except Exception as exc:  # a full disk must not stop training: say so once
                if self._error is None:
                    self._error = str(exc)
                    _log.warning(
                        "could not keep a copy of commit %d on this node in %s (%s); a crash of "
                        "every rank would lose the state",
                        commits,
                        self._dir,
                        exc,
                    )
            finally:
                with self._cond:
                    self._writing = None
                    self._cond.notify_all()

    def _write(self, commits: int, tree: Any) -> None:
        final = self._dir / f"state-{self._local_rank}-{commits}.pt"
        tmp = self._dir / f".{final.name}.{os.getpid()}.writing"
        torch.save(tree, tmp)
        os.replace(tmp, final)
        self.written = commits
        for older, path in _copies(self._dir, self._local_rank):
            if older != commits:
                with contextlib.suppress(OSError):
                    path.unlink()
