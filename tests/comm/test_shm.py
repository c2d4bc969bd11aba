"""shm allreduce: equals Gloo and a rank-order reference, cleans up, survives stale files."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from longboat.comm.algorithms.shm import SUPPORTED
from longboat.comm.shm_segment import (
    MAGIC,
    Segment,
    cleanup_stale_segments,
    remove_group,
    segment_bytes,
    segment_path,
    shm_dir,
)
from tests._dist import run_ranks

DTYPES = list(SUPPORTED)
SIZES = [1, 7, 1023, 100_000, 1_000_003]


def _dead_pid() -> int:
    """The pid of a process that has already exited."""
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    return int(out.stdout)


def _files(prefix: str) -> list[str]:
    return sorted(p.name for p in shm_dir().glob(f"{prefix}-*"))


@pytest.fixture
def prefix():
    """A made-up segment prefix; whatever a test leaves under it is removed afterwards."""
    name = f"lb-shm-t{uuid.uuid4().hex[:10]}"
    yield name
    remove_group(name)


def _plant(path: Path, token: int, pid: int, generation: int = 0, capacity: int = 65536) -> None:
    """A segment file with a valid-looking header (magic, ``token``, dead or live ``pid``)."""
    head = torch.zeros(6, dtype=torch.int64)
    head[:] = torch.tensor([MAGIC, token, generation, pid, 0, capacity])
    path.write_bytes(head.numpy().tobytes() + b"\xff" * (segment_bytes(capacity) - 48))


# ---- multi-rank ------------------------------------------------------------------------------
def _inputs(size: int, dtype: torch.dtype, rank: int, integral: bool) -> torch.Tensor:
    """Rank ``rank``'s input; integral values sum exactly in any order (even in bfloat16)."""
    g = torch.Generator().manual_seed(size * 131 + DTYPES.index(dtype) * 7 + rank + integral)
    if integral or not dtype.is_floating_point:
        low, high = (0, 80) if dtype == torch.uint8 else (-40, 40)
        return torch.randint(low, high, (size,), generator=g).to(dtype)
    return (torch.randn(size, generator=g) * 100).to(dtype)


def _rank_order_sum(size: int, dtype: torch.dtype, world: int) -> torch.Tensor:
    out = _inputs(size, dtype, 0, False) + _inputs(size, dtype, 1, False)
    for r in range(2, world):
        out += _inputs(size, dtype, r, False)
    return out


def _check_sizes(reduce, rank: int, world: int, tag: str) -> dict[str, list]:
    """Every size x dtype: exact vs Gloo, bitwise vs the rank-order reference, plus digests."""
    bad, digests = [], []
    for size in SIZES:
        for dtype in DTYPES:
            exact = _inputs(size, dtype, rank, True)
            gloo = exact.clone()
            dist.all_reduce(gloo)
            reduce(exact)
            if not torch.equal(exact, gloo):
                bad.append(f"{tag} {size} {dtype} differs from gloo")
            mine = _inputs(size, dtype, rank, False)
            reduce(mine)
            if not torch.equal(mine, _rank_order_sum(size, dtype, world)):
                bad.append(f"{tag} {size} {dtype} differs from the rank-order sum")
            digests.append(hashlib.sha256(mine.view(torch.uint8).numpy().tobytes()).hexdigest())
    return {"bad": bad, "digests": digests}


def _correctness(rank: int, world: int, planted_prefix: str) -> dict:
    from longboat.comm import algorithms
    from longboat.comm.algorithms import shm

    dist.init_process_group("gloo")
    fn = algorithms.make("shm", dist.group.WORLD)  # left open: exit hooks must unlink it
    assert isinstance(fn, shm.ShmAllreduce)
    # tiny pieces and direct threshold: reduce-scatter path, many pieces, remainders
    small = shm.ShmComm(prefix=planted_prefix, piece_bytes=256 << 10, small_bytes=256)
    out = {"prefix": fn.comm.prefix, "bad": []}
    for tag, reduce in (("async", lambda t: fn(t).wait()), ("pieces", small.allreduce)):
        found = _check_sizes(reduce, rank, world, tag)
        out["bad"] += found["bad"]
        out[f"digests_{tag}"] = found["digests"]
    out["bad"] += _check_misc(fn, small, rank, world)
    dist.barrier()
    out["files_live"] = _files(fn.comm.prefix)
    out["generation"] = fn.comm._gen
    out["small_generation"] = small._gen
    small.close()
    dist.barrier()
    out["files_after_close"] = _files(planted_prefix)
    return out


def _check_misc(fn, small, rank: int, world: int) -> list[str]:
    """Empty tensors, non-contiguous views, several ops in flight, unsupported dtypes."""
    bad = []
    for dtype in DTYPES:
        empty = torch.empty(0, dtype=dtype)
        if fn(empty).wait().numel() != 0 or small.allreduce(empty) is not None:
            bad.append(f"empty {dtype}")
    base = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    view = base.t()  # non-contiguous: staged through a contiguous copy
    small.allreduce(view)
    expect = torch.arange(12.0).reshape(3, 4) * sum(range(1, world + 1))
    if not torch.equal(base, expect):
        bad.append("non-contiguous")
    tensors = [torch.full((n,), float(rank + 1)) for n in (5, 300_000, 3, 2_000_000)]
    for handle in [fn(t) for t in tensors]:  # in flight together, completed in order
        handle.wait()
    total = world * (world + 1) / 2
    if not all(bool((t == total).all()) for t in tensors):
        bad.append("several in flight")
    try:
        small.allreduce(torch.zeros(3, dtype=torch.bool))
        bad.append("bool accepted")
    except TypeError as exc:
        if "torch.bool" not in str(exc) and "bool" not in str(exc):
            bad.append(f"bool message: {exc}")
    return bad


@pytest.mark.parametrize("world", [2, 3])
def test_matches_gloo_and_reference_and_cleans_up(world, prefix):
    dead = _dead_pid()
    # stale files under names this run will use: garbage, and a dead owner's valid segment
    segment_path(prefix, 1, 0).write_bytes(os.urandom(5000))
    segment_path(prefix, 0, 1).write_bytes(b"\0" * 100)
    _plant(segment_path(prefix, world - 1, 1), token=12345, pid=dead, generation=1)
    group_prefix = ""
    try:
        results = run_ranks(_correctness, world, prefix, timeout=150)
        group_prefix = results[0]["prefix"]
        for r, res in enumerate(results):
            assert res["bad"] == [], f"rank {r}: {res['bad']}"
            for key in ("digests_async", "digests_pieces"):
                assert res[key] == results[0][key], f"rank {r} differs from rank 0 ({key})"
        # while open: exactly one segment per rank, of the latest generation (old ones unlinked)
        gen = results[0]["generation"]
        assert gen >= 3 and results[0]["small_generation"] == 1
        assert results[0]["files_live"] == sorted(f"{group_prefix}-{r}-{gen}" for r in range(world))
        assert results[0]["files_after_close"] == []
        assert group_prefix.startswith("lb-shm-") and group_prefix != prefix
        # after exit: nothing of either group left (the open one was closed by exit hooks)
        assert _files(group_prefix) == []
        assert _files(prefix) == []
    finally:
        if group_prefix:
            remove_group(group_prefix)


def _dies(rank: int, world: int, prefix: str, out_dir: str) -> None:
    from longboat.comm.algorithms import shm

    dist.init_process_group("gloo")
    comm = shm.ShmComm(prefix=prefix, timeout=30, small_bytes=1024)
    fn = shm.ShmAllreduce(comm)
    tensor = torch.ones(100_000)
    for _ in range(3):
        fn(tensor).wait()
    if rank == 1:  # wrote its input, passed the barrier: dies before reducing
        comm._reduce_chunk = lambda *args: os._exit(17)
    start = time.monotonic()
    try:
        fn(tensor).wait()
        report = {"error": None}
    except Exception as exc:
        report = {"error": f"{type(exc).__name__}: {exc}"}
    report["seconds"] = time.monotonic() - start
    report["files"] = _files(prefix)
    try:
        fn(tensor).wait()
    except RuntimeError as exc:
        report["after"] = str(exc)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(report))
    fn.close()


def test_dead_rank_raises_names_it_and_removes_all_segments(prefix, tmp_path):
    failure = run_ranks(_dies, 3, prefix, str(tmp_path), timeout=90, allow_failure=True)
    assert failure.exitcodes == {0: 0, 1: 17, 2: 0}
    for rank in (0, 2):
        report = json.loads(Path(tmp_path, f"{rank}.json").read_text())
        assert report["error"] is not None and "PeerDiedError" in report["error"]
        assert "group rank 1 " in report["error"] and "died" in report["error"]
        assert report["files"] == []
        assert "unusable after an error" in report["after"]
    assert not Path(tmp_path, "1.json").exists()
    assert _files(prefix) == []


def _late(rank: int, world: int, prefix: str, flags: str) -> str:
    from longboat.comm.algorithms.shm import ShmComm

    dist.init_process_group("gloo")
    comm = ShmComm(prefix=prefix, timeout=1.0 if rank == 0 else 60.0, small_bytes=1024)
    gave_up = Path(flags, "rank0-done")
    if rank == 1:
        # rank 0 gives up meanwhile and flags the abort in rank 1's segment (then the file says
        # so); at most 30 s
        deadline = time.monotonic() + 30
        while not gave_up.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    start = time.monotonic()
    try:
        comm.allreduce(torch.ones(4096))  # reduce-scatter: rank 1 waits for 'reduced' too
        message = "no error"
    except (TimeoutError, RuntimeError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    finally:
        if rank == 0:
            gave_up.touch()
    return f"{message} after {time.monotonic() - start:.1f}s"


def test_timeout_names_the_late_rank_and_aborts_the_others(prefix, tmp_path):
    first, second = run_ranks(_late, 2, prefix, str(tmp_path), timeout=60)
    assert first.startswith("TimeoutError") and "waited 1s for 'written' #1" in first
    assert "rank 1 at #0" in first and "LONGBOAT_TIMEOUT" in first
    # rank 1 (60 s timeout) stops at once: rank 0's abort flag, not its own timeout
    assert second.startswith("PeerFailedError") and "group rank 0 (global rank 0) failed" in second
    assert float(second.rsplit(" after ", 1)[1].rstrip("s")) < 5
    assert _files(prefix) == []


# ---- single process ------------------------------------------------------------------------
def test_attach_rejects_stale_and_garbage_files(prefix):
    _plant(segment_path(prefix, 0, 0), token=111, pid=os.getpid())  # another run's token
    assert Segment.attach(prefix, 0, 0, 222, 65536) is None
    segment_path(prefix, 1, 0).write_bytes(os.urandom(300))  # garbage, too short
    assert Segment.attach(prefix, 1, 0, 222, 65536) is None
    assert Segment.attach(prefix, 2, 0, 222, 65536) is None  # missing
    seg = Segment.attach(prefix, 0, 0, 111, 65536)
    assert seg is not None and seg.pid == os.getpid()
    seg.close()


def test_create_replaces_dead_owner_but_never_a_live_one(prefix):
    _plant(segment_path(prefix, 0, 0), token=1, pid=_dead_pid())
    seg = Segment.create(prefix, 0, 0, token=2, capacity=65536, seq=5)
    assert seg.slots[1] == 2 and seg.slots[8] == 5 and seg.pid == os.getpid()
    with pytest.raises(FileExistsError, match="live process"):
        Segment.create(prefix, 0, 0, token=3, capacity=65536, seq=0)
    seg.close(unlink=True)
    assert _files(prefix) == []


def test_cleanup_stale_segments(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    _plant(tmp_path / "lb-shm-a-0-0", token=1, pid=dead)
    _plant(tmp_path / "lb-shm-b-0-0", token=1, pid=live)
    (tmp_path / "lb-shm-c-0-0").write_bytes(b"garbage")
    (tmp_path / "lb-shm-d-0-0").write_bytes(b"garbage")
    os.utime(tmp_path / "lb-shm-d-0-0", (time.time() - 60, time.time() - 60))
    (tmp_path / "lb-other").write_bytes(b"not ours")
    os.utime(tmp_path / "lb-other", (time.time() - 60, time.time() - 60))
    removed = cleanup_stale_segments(tmp_path, grace_s=10)
    assert sorted(p.name for p in removed) == ["lb-shm-a-0-0", "lb-shm-d-0-0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "lb-other",
        "lb-shm-b-0-0",
        "lb-shm-c-0-0",
    ]


def test_groups_spanning_nodes_are_refused(monkeypatch):
    import longboat.cluster as cluster
    from longboat.cluster.topology import Topology
    from longboat.comm.algorithms.shm import check_one_node

    monkeypatch.setattr(cluster, "is_initialized", lambda: True)
    monkeypatch.setattr(cluster, "topology", lambda: Topology((0, 0, 1, 1), 0))
    check_one_node(None, [0, 1], torch.device("cpu"))  # same node: fine
    with pytest.raises(ValueError, match=r"ranks \[1, 2\] are on nodes \[0, 1\]"):
        check_one_node(None, [1, 2], torch.device("cpu"))


def test_chunks_cover_every_element_once():
    from longboat.comm.algorithms.shm import capacity_for, chunk_bounds

    for numel in (0, 1, 7, 16, 17, 1023, 1_000_003):
        for parts in (2, 3, 5):
            bounds = chunk_bounds(numel, parts, 16)
            assert bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
            assert all(lo % 16 == 0 or lo == numel for lo, _ in bounds)
    assert capacity_for(10, 8 << 20) == 64 << 10
    assert capacity_for(5 << 20, 8 << 20) == 8 << 20
    assert capacity_for(9 << 20, 8 << 20) == 9 << 20
