"""A rank's last commit kept on its node, outside the rank process.

Every rank of an elastic job holds its committed state in memory, so a failure that kills
every rank at once (an out-of-memory kill, a job-wide NCCL error) would lose it all. At every
commit `State` also hands its snapshot to `NodeCopy`, which keeps it in files of the node's
copy directory (shared memory under ``/dev/shm``, owned by the launcher, which removes it when
it ends): a rank restarted on the node (one rank, or all of them after a job-wide crash) takes
the newest copy there and is a holder of the state again.

A rank's copy alternates between two slots: a data file the tensors are copied into through
a memory map (no serialisation, no disk), and a small description of the rest (the tree's
structure, plain values) written after it; a pointer file, replaced atomically, names the
slot of the newest complete copy. A rank killed while it writes one slot leaves the other,
the previous commit, intact. State in host memory is copied at the commit itself (a memcpy,
like the in-memory snapshot), so a commit is on the node before ``commit()`` returns; state on
a device is copied to pinned host memory without blocking the host and written by a
background thread (at most one copy pending; a newer commit replaces it).

Unsharded state is the same on every rank, so local rank 0 alone writes it; with a sharded
optimizer every rank writes its own slices. Descriptions are read with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
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
_ALIGN = 64
_TENSOR = "__node_copy_tensor__"


def copy_dir() -> Path | None:
    """This node's copy directory: the launcher's, else ``<elastic dir>/copies``; None
    outside an elastic job."""
    given = variable(ENV_COPY_DIR)
    if given:
        return Path(given)
    directory = elastic_dir()
    return directory / "copies" if directory is not None else None


def _pointer(directory: Path, local_rank: int) -> Path:
    return directory / f"state-{local_rank}.current"


def _slot_files(directory: Path, local_rank: int, slot: int) -> tuple[Path, Path]:
    stem = directory / f"state-{local_rank}-{slot}"
    return stem.with_suffix(".bin"), stem.with_suffix(".meta")


def newest_slot(directory: Path, local_rank: int) -> int | None:
    """The slot ``local_rank``'s pointer names, or None without one."""
    try:
        return int(_pointer(directory, local_rank).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def newest(directory: Path, local_rank: int) -> tuple[int, dict[str, Any]] | None:
    """The commit count and content of ``local_rank``'s newest complete copy, or None."""
    try:
        slot, commits = (int(v) for v in _pointer(directory, local_rank).read_text().split())
        data_path, meta_path = _slot_files(directory, local_rank, slot)
        meta = torch.load(meta_path, weights_only=True)
        size = int(meta["bytes"])
        data = torch.from_file(str(data_path), shared=False, size=size, dtype=torch.uint8)
        return commits, _unflatten(meta["tree"], data)
    except FileNotFoundError:
        return None
    except Exception as exc:  # cut short or foreign: nothing usable
        _log.warning("skipping the unreadable node copy of local rank %d: %s", local_rank, exc)
        return None


class _Slots:
    """The two slots of one rank's copy, written alternately (the caller serialises writes)."""

    def __init__(self, directory: Path, local_rank: int) -> None:
        self._dir = directory
        self._local_rank = local_rank
        self._maps: dict[int, torch.Tensor] = {}
        self._next = 0
        with_copy = newest_slot(directory, local_rank)
        if with_copy is not None:  # an earlier rank's copy: never write over it first
            self._next = 1 - with_copy

    def write(self, commits: int, tree: Any) -> None:
        """Copy ``tree`` into the slot the pointer does not name, then point at it."""
        self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        slot = self._next
        flat = _Flat(tree)
        size = max(flat.size, _ALIGN)
        data = self._map(slot, size)
        for tensor, offset in flat.tensors:
            nbytes = tensor.numel() * tensor.element_size()
            view = data[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
        meta_path = _slot_files(self._dir, self._local_rank, slot)[1]
        buffer = io.BytesIO()
        torch.save({"bytes": size, "tree": flat.meta}, buffer)
        _replace(meta_path, buffer.getvalue())
        _replace(_pointer(self._dir, self._local_rank), f"{slot} {commits}".encode())
        self._next = 1 - slot

    def _map(self, slot: int, size: int) -> torch.Tensor:
        mapped = self._maps.get(slot)
        if mapped is None or mapped.numel() != size:
            path = _slot_files(self._dir, self._local_rank, slot)[0]
            with open(path, "wb") as f:
                f.truncate(size)
            mapped = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
            self._maps[slot] = mapped
        return mapped


def _replace(path: Path, content: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.writing")
    tmp.write_bytes(content)
    os.replace(tmp, path)


class _Flat:
    """A tree's dense tensors laid out one after another (each at a 64-byte boundary), and
    the tree's description with each tensor replaced by its offset, dtype and shape."""

    def __init__(self, tree: Any) -> None:
        self.tensors: list[tuple[torch.Tensor, int]] = []
        self.size = 0
        self.meta = self._flatten(tree)

    def _flatten(self, node: Any) -> Any:
        if isinstance(node, torch.Tensor) and node.layout == torch.strided:
            tensor = node.detach()
            self.tensors.append((tensor, self.size))
            placed = [self.size, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
            nbytes = tensor.numel() * tensor.element_size()
            self.size += -(-nbytes // _ALIGN) * _ALIGN
            return {_TENSOR: placed}
        if isinstance(node, dict):
            return {k: self._flatten(v) for k, v in node.items()}
        if isinstance(node, list | tuple):
            items = [self._flatten(v) for v in node]
            return tuple(items) if isinstance(node, tuple) else items
        return node  # plain values, and sparse tensors, travel in the description


def _unflatten(node: Any, data: torch.Tensor) -> Any:
    if isinstance(node, dict) and _TENSOR in node:
        offset, dtype, shape = node[_TENSOR]
        dtype = getattr(torch, dtype)
        count = 1
        for n in shape:
            count *= n
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        return data[offset : offset + nbytes].view(dtype).view(shape).clone()
    if isinstance(node, dict):
        return {k: _unflatten(v, data) for k, v in node.items()}
    if isinstance(node, list | tuple):
        items = [_unflatten(v, data) for v in node]
        return tuple(items) if isinstance(node, tuple) else items
    return node


class NodeCopy:
    """Keeps one rank's committed snapshots in ``directory`` (see the module docstring)."""

    def __init__(self, directory: Path, local_rank: int) -> None:
        self._slots = _Slots(directory, local_rank)
        self._dir = directory
        self._cond = threading.Condition()
        self._trees = (TensorTree(host=True), TensorTree(host=True))
        self._pending: tuple[int, TensorTree] | None = None
        self._writing: TensorTree | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def offer(self, commits: int, snapshot: dict[str, Any]) -> None:
        """Keep ``snapshot`` (of commit ``commits``): written before returning when its
        tensors are in host memory, else queued for the writer thread (replacing a copy still
        waiting)."""
        if _in_host_memory(snapshot):
            with self._cond:
                while self._writing is not None:  # a device copy still being written
                    self._cond.wait()
                self._guarded(commits, snapshot)
            return
        with self._cond:
            tree = self._trees[1] if self._writing is self._trees[0] else self._trees[0]
            tree.save(snapshot)
            self._pending = (commits, tree)
            self._cond.notify()
        if self._thread is None:
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
                if left <= 0:
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
                self._guarded(commits, tree.tree)
            finally:
                with self._cond:
                    self._writing = None
                    self._cond.notify_all()

    def _guarded(self, commits: int, tree: Any) -> None:
        """Write; a full disk must not stop training: say so once."""
        try:
            self._slots.write(commits, tree)
        except Exception as exc:
            if self._error is None:
                self._error = str(exc)
                _log.warning(
                    "could not keep a copy of commit %d on this node in %s (%s); a crash of "
                    "every rank would lose the state",
                    commits,
                    self._dir,
                    exc,
                )


def _in_host_memory(node: Any) -> bool:
    if isinstance(node, torch.Tensor):
        return node.device.type == "cpu"
    if isinstance(node, dict):
        return all(_in_host_memory(v) for v in node.values())
    if isinstance(node, list | tuple):
        return all(_in_host_memory(v) for v in node)
    return True

