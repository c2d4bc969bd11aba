"""ring: equals dist.all_reduce, bitwise identical across ranks, exact byte counts."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist

from longboat.comm.algorithms.ring import chunk_bounds, expected_bytes
from tests._dist import run_ranks

SIZES = (0, 1, 7, 1023, 1_000_003)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def _input(rank: int, numel: int, dtype: torch.dtype, seed: int, small_ints: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 131 + rank)
    if small_ints or not dtype.is_floating_point:
        return torch.randint(-8, 9, (numel,), generator=g).to(dtype)  # sums are exact
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _ring_order_reference(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The documented order: chunk c = ((x_c + x_{c+1}) + x_{c+2}) + ... + x_{c-1}."""
    n = len(inputs)
    out = torch.empty_like(inputs[0])
    for c, (lo, hi) in enumerate(chunk_bounds(inputs[0].numel(), n)):
        acc = inputs[c][lo:hi].clone()
        for k in range(1, n):
            acc = inputs[(c + k) % n][lo:hi] + acc
        out[lo:hi] = acc
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _rank_body(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    from longboat.comm.algorithms.ring import make_ring

    fn = make_ring(dist.group.WORLD)
    tiny = make_ring(dist.group.WORLD, segment_bytes=40)  # many uneven pipeline segments
    failures: list[str] = []
    digests: dict[str, str] = {}
    counters: list[tuple[int, int, int, int]] = []  # numel, element size, sent, received
    for numel in SIZES:
        dtypes = DTYPES if numel < 1_000_000 else (torch.float32, torch.bfloat16, torch.int64)
        for dtype in dtypes:
            case = f"{numel}/{dtype}"
            # exact data: must equal the backend's allreduce bit for bit
            x = _input(rank, numel, dtype, numel, small_ints=True)
            expected = x.clone()
            dist.all_reduce(expected)
            got = x.clone()
            fn(got).wait()
            if not torch.equal(got, expected):
                failures.append(f"{case}: differs from dist.all_reduce")
            counters.append((numel, x.element_size(), *_last(fn)))
            # random floats: the documented summation order, identical bits on every rank
            if dtype.is_floating_point:
                inputs = [_input(r, numel, dtype, numel + 1, False) for r in range(world)]
                got = inputs[rank].clone()
                fn(got).wait()
                if not torch.equal(got, _ring_order_reference(inputs)):
                    failures.append(f"{case}: not the documented summation order")
                digests[case] = _digest(got)
                ref = sum(i.double() for i in inputs)
                if not torch.allclose(got.double(), ref, rtol=2e-2, atol=0.1):
                    failures.append(f"{case}: far from the float64 sum")
    for numel in (1023, 4 * 105):
        x = _input(rank, numel, torch.float32, 7, small_ints=True)
        expected = x.clone()
        dist.all_reduce(expected)
        tiny(x).wait()
        if not torch.equal(x, expected):
            failures.append(f"segmented {numel}: differs from dist.all_reduce")
    # non-contiguous input, and the cumulative counters
    base = _input(rank, 6 * 5, torch.float32, 3, small_ints=True).view(6, 5)
    strided = base.t()
    expected = strided.clone()
    dist.all_reduce(expected)
    fn(strided).wait()
    if not torch.equal(base.t(), expected):
        failures.append("non-contiguous tensor differs from dist.all_reduce")
    with pytest.raises(TypeError, match="does not support torch.uint8"):
        fn(torch.zeros(3, dtype=torch.uint8))
    state = fn.state
    totals = (state.bytes_sent, state.bytes_received, state.calls)
    fn.close()
    tiny.close()
    return {"failures": failures, "digests": digests, "counters": counters, "totals": totals}


def _last(fn) -> tuple[int, int]:
    return fn.state.last_bytes_sent, fn.state.last_bytes_received


def _check_counts(world: int, results: list[dict]) -> None:
    for rank, res in enumerate(results):
        sent_total = received_total = 0
        for numel, esize, sent, received in res["counters"]:
            k = numel * esize
            sent_total += sent
            received_total += received
            if numel % world == 0:
                assert sent == received == 2 * k * (world - 1) // world, (rank, numel)
            else:  # rank r sends all but chunks r+1, r+2 twice over; receives all but r, r+1
                sizes = [numel // world + (c < numel % world) for c in range(world)]
                want_sent = esize * (
                    2 * numel - sizes[(rank + 1) % world] - sizes[(rank + 2) % world]
                )
                want_recv = esize * (2 * numel - sizes[rank] - sizes[(rank + 1) % world])
                assert (sent, received) == (want_sent, want_recv), (rank, numel, esize)
                assert (sent, received) == expected_bytes(numel, esize, world, rank)
        assert res["totals"][0] >= sent_total and res["totals"][1] >= received_total


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_matches_all_reduce_with_exact_bytes(world: int) -> None:
    results = run_ranks(_rank_body, world, timeout=120)
    for rank, res in enumerate(results):
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"
    assert all(res["digests"] == results[0]["digests"] for res in results)
    assert len(results[0]["digests"]) == 4 * 4 + 2  # every float case was compared
    _check_counts(world, results)


def test_chunk_bounds_cover_any_size() -> None:
    assert chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert chunk_bounds(0, 2) == [(0, 0), (0, 0)]
    assert expected_bytes(8, 4, 4, 0) == (2 * 32 * 3 // 4,) * 2
    assert expected_bytes(10, 1, 1, 0) == (0, 0)
