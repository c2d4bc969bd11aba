"""One rank's shared-memory segment: a file in /dev/shm mapped into every rank of a node.

A segment is a plain tmpfs file opened with ``os.open`` and mapped with ``mmap`` (not
``multiprocessing.shared_memory``, whose resource tracker would unlink or warn about segments
that other processes own). Layout, all integers native int64 (little-endian on x86-64):

=========  ===========================================================================
offset     field
=========  ===========================================================================
0          magic ``LBSHM\\0\\1\\0`` (written last at creation: a half-made file is invalid)
8          token: random per group instance (a stale file from another run never matches)
16         generation: 0, 1, 2 ... one per re-creation when a bigger tensor arrives
24         owner pid
32         owner start time (clock ticks since boot, /proc/<pid>/stat field 22; 0 unknown)
40         capacity: bytes in each data area
64         ``written`` sequence number (own cache line)
128        ``reduced`` sequence number (own cache line)
192        abort: 1 + group rank of a rank that failed (written by it into every segment)
200        1 + group rank of the dead rank that made it fail (0: another error)
4096       input area 0, input area 1 (double buffer, by op parity), result area
=========  ===========================================================================

Sequence numbers are single aligned 8-byte stores and loads; on x86-64 (TSO) a store of the
counter after the data stores is seen after them by every other core, which is all the
protocol needs.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
import time
from functools import cache
from pathlib import Path

import torch

from longboat.cluster.env import variable

MAGIC = int.from_bytes(b"LBSHM\x00\x01\x00", "little")
NAME_PREFIX = "lb-shm-"
HEADER_BYTES = 4096
PAGE = 4096

# int64 slot indices in the header
SLOT_MAGIC, SLOT_TOKEN, SLOT_GEN, SLOT_PID, SLOT_START, SLOT_CAPACITY = range(6)
SLOT_WRITTEN = 64 // 8
SLOT_REDUCED = 128 // 8
SLOT_ABORT = 192 // 8
SLOT_ABORT_DEAD = SLOT_ABORT + 1
_HEAD = struct.Struct("=6q")


def shm_dir() -> Path:
    """Where segments live: LONGBOAT_SHM_DIR, else /dev/shm."""
    return Path(variable("LONGBOAT_SHM_DIR", default="/dev/shm"))


def segment_path(prefix: str, rank: int, generation: int) -> Path:
    """The file of ``rank``'s segment, generation ``generation``, of group ``prefix``."""
    return shm_dir() / f"{prefix}-{rank}-{generation}"


def segment_bytes(capacity: int) -> int:
    """File size for ``capacity`` bytes per data area (two input areas and a result area)."""
    return HEADER_BYTES + 3 * capacity


@cache
def _has_proc() -> bool:
    return Path("/proc/self/stat").exists()


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None if it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text[text.rfind(")") + 2 :].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def pid_alive(pid: int, start_time: int = 0) -> bool:
    """True while process ``pid`` runs (and, if ``start_time`` is known, is the same process)."""
    if pid <= 0 or pid > 1 << 31:
        return False
    if _has_proc():
        now = process_start_time(pid)
        return now is not None and (start_time == 0 or now == start_time)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _my_start_time() -> int:
    return (process_start_time(os.getpid()) or 0) if _has_proc() else 0


def read_header(path: Path) -> tuple[int, ...] | None:
    """The first six header fields of the file at ``path``; None if unreadable or too short."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEAD.size)
    except OSError:
        return None
    return _HEAD.unpack(raw) if len(raw) == _HEAD.size else None


class Segment:
    """A mapped segment: header counters plus byte views of the data areas."""

    def __init__(self, path: Path, mm: mmap.mmap, capacity: int):
        self.path = path
        self.capacity = capacity
        self._mm = mm
        self.slots = memoryview(mm)[:HEADER_BYTES].cast("q")
        self._bytes = torch.frombuffer(mm, dtype=torch.uint8)
        head = self.slots.tolist()[:6]
        self.pid, self.start_time = head[SLOT_PID], head[SLOT_START]

    @classmethod
    def create(
        cls, prefix: str, rank: int, generation: int, token: int, capacity: int, seq: int
    ) -> Segment:
        """Create (replacing a stale file of the same name) and publish a new segment."""
        path = segment_path(prefix, rank, generation)
        size = segment_bytes(capacity)
        fd = _create_exclusive(path)
        try:
            _reserve(fd, path, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        head = memoryview(mm)[:HEADER_BYTES].cast("q")
        head[SLOT_PID], head[SLOT_START] = os.getpid(), _my_start_time()
        head[SLOT_TOKEN], head[SLOT_GEN], head[SLOT_CAPACITY] = token, generation, capacity
        head[SLOT_WRITTEN] = head[SLOT_REDUCED] = seq
        head[SLOT_MAGIC] = MAGIC  # last: the segment is valid from here on
        head.release()
        return cls(path, mm, capacity)

    @classmethod
    def attach(
        cls, prefix: str, rank: int, generation: int, token: int, capacity: int
    ) -> Segment | None:
        """Map a peer's segment if it exists and is this group's; None otherwise (yet)."""
        path = segment_path(prefix, rank, generation)
        expected = (MAGIC, token, generation, capacity)
        head = read_header(path)
        if head is None or (head[0], head[1], head[2], head[5]) != expected:
            return None
        size = segment_bytes(capacity)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size < size:
                return None
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        seg = cls(path, mm, capacity)
        if tuple(seg.slots[i] for i in (0, 1, 2, 5)) != expected:  # replaced in between
            seg.close()
            return None
        return seg

    @property
    def is_open(self) -> bool:
        """False after close()."""
        return self._mm is not None

    def area(self, index: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        """The first ``count`` elements of data area ``index`` (0, 1: inputs; 2: result)."""
        start = HEADER_BYTES + index * self.capacity
        return self._bytes[start : start + count * dtype.itemsize].view(dtype)

    def close(self, unlink: bool = False) -> None:
        """Drop the mapping (and with ``unlink`` remove the file); safe to call twice.

        No explicit ``munmap``: ``torch.frombuffer`` views do not pin the buffer, so unmapping
        under a live view would crash. The mapping goes when its last view does.
        """
        if unlink:
            _unlink(self.path)
        if self._mm is None:
            return
        self.slots.release()
        self._bytes = self._mm = None


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _reserve(fd: int, path: Path, size: int) -> None:
    """Size the file, allocating its pages now: a full tmpfs fails here, not with SIGBUS later."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            free = os.statvfs(path.parent)
            raise OSError(
                errno.ENOSPC,
                f"no room in {path.parent} for a {size / 2**20:.1f} MiB shared-memory segment "
                f"({free.f_bavail * free.f_frsize / 2**20:.0f} MiB free): enlarge it (docker: "
                "--shm-size=1g) or point LONGBOAT_SHM_DIR at a bigger tmpfs",
            ) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _create_exclusive(path: Path) -> int:
    """``O_CREAT|O_EXCL`` open; a stale file in the way (dead owner, not ours) is removed."""
    for _ in range(3):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            head = read_header(path)
            if head is not None and head[0] == MAGIC and pid_alive(head[3], head[4]):
                raise FileExistsError(
                    f"shared-memory segment {path} belongs to live process {head[3]}; "
                    "two groups were given the same segment prefix"
                ) from None
            _unlink(path)
    raise FileExistsError(f"could not create shared-memory segment {path}: it keeps reappearing")


def mapped_segments() -> dict[str, int]:
    """Bytes this process maps of each shm segment file, by file name (a file already unlinked
    but still mapped counts too), read from ``/proc/self/maps``; empty where there is none."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return {}
    where, out = f"{shm_dir().resolve()}/", {}
    for line in lines:
        fields = line.split(maxsplit=5)
        path = fields[5].removesuffix(" (deleted)") if len(fields) == 6 else ""
        name = path.removeprefix(where)
        if path.startswith(where) and name.startswith(NAME_PREFIX) and "/" not in name:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out[name] = out.get(name, 0) + end - start
    return out


def remove_group(prefix: str) -> list[Path]:
    """Unlink every segment file of group ``prefix`` (any rank, any generation)."""
    found = sorted(shm_dir().glob(f"{prefix}-*"))
    for path in found:
        _unlink(path)
    return found


def cleanup_stale_segments(
    directory: str | Path | None = None, grace_s: float = 10.0
) -> list[Path]:
    """Remove ``lb-*`` segments whose owner process is dead; return the removed paths.

    A file with a valid header is removed when its owner pid is gone (or is another process
    now). A ``lb-shm-*`` file without a valid header (garbage, or a crash during creation) is
    removed once it is older than ``grace_s`` seconds. Anything else is left alone.
    """
    removed = []
    for path in sorted(Path(directory or shm_dir()).glob("lb-*")):
        if _is_stale(path, grace_s):
            _unlink(path)
            removed.append(path)
    return removed


def _is_stale(path: Path, grace_s: float) -> bool:
    head = read_header(path)
    if head is not None and head[0] == MAGIC:
        return not pid_alive(head[3], head[4])
    if not path.name.startswith(NAME_PREFIX):
        return False
    try:
        return time.time() - path.stat().st_mtime > grace_s
    except FileNotFoundError:
        return False
