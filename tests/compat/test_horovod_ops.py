"""longboat.horovod.torch collectives on 2 real Gloo ranks, against values computed here.

One spawn runs every op (``_ops``); the tests below check its recorded results against
what a single process computes from both ranks' inputs.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests._dist import run_ranks

WORLD = 2


def _x(rank: int) -> torch.Tensor:
    return torch.arange(6.0).view(2, 3) * (rank + 1) + rank


def _coef(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).view(shape) + 3.0 * rank + 1.0


def _rows(rank: int) -> torch.Tensor:
    return torch.arange(2.0 * (rank + 1)).view(rank + 1, 2) + 10.0 * rank  # 1 row, then 2


def _ops(rank: int, world: int) -> dict:
    import longboat.horovod.torch as hvd

    out: dict = {"before": [hvd.is_initialized(), hvd.gloo_built(), hvd.mpi_built()]}
    try:
        hvd.size()
    except ValueError as e:
        out["size_before_init"] = str(e)
    hvd.init()
    hvd.init()  # idempotent
    ctl = hvd.controller()
    out["who"] = [
        hvd.size(),
        hvd.rank(),
        hvd.local_size(),
        hvd.local_rank(),
        hvd.cross_size(),
        hvd.cross_rank(),
        hvd.is_homogeneous(),
    ]
    x = _x(rank)
    out["avg"] = hvd.allreduce(x, name="avg")
    out["sum_positional"] = hvd.allreduce(x, None, "sum_pos", hvd.Compression.none, hvd.Sum)
    with pytest.warns(DeprecationWarning):
        out["average_false"] = hvd.allreduce(x, False, "average_false")
    for op in (hvd.Min, hvd.Max, hvd.Product):
        out[op.name] = hvd.allreduce(x, name=op.name, op=op)
    out["scaled"] = hvd.allreduce(x, name="scaled", prescale_factor=2.0, postscale_factor=0.25)
    inplace = x.clone()
    out["inplace_is_input"] = hvd.allreduce_(inplace, name="inplace", op=hvd.Sum) is inplace
    out["inplace"] = inplace
    out["async"] = hvd.synchronize(hvd.allreduce_async(x, name="async", op=hvd.Sum))
    y = x.clone()
    hvd.synchronize(hvd.allreduce_async_(y, name="async_", op=hvd.Sum))
    out["async_"] = y
    ints = torch.tensor([rank + 1, 10], dtype=torch.int64)
    out["ints"] = hvd.allreduce(ints, name="ints", op=hvd.Sum)
    out["fp16"] = hvd.allreduce(x, name="fp16", compression=hvd.Compression.fp16)
    out["grouped"] = hvd.grouped_allreduce([x, 2 * x], name="grouped", op=hvd.Sum)
    out["grouped_async"] = hvd.synchronize(hvd.grouped_allreduce_async([x, x + 1], name="ga"))
    pair = [x.clone(), 3 * x]
    hvd.grouped_allreduce_(pair, name="g_", op=hvd.Sum)
    out["grouped_"] = pair
    pair2 = [x.clone(), 3 * x]
    hvd.synchronize(hvd.grouped_allreduce_async_(pair2, name="ga_", op=hvd.Sum))
    out["grouped_async_"] = pair2

    # different submission orders meet by name
    a, b = torch.full((3,), 1.0 + rank), torch.full((5,), 10.0 * (rank + 1))
    if rank == 0:
        ha = hvd.allreduce_async(a, name="order.a", op=hvd.Sum)
        hb = hvd.allreduce_async(b, name="order.b", op=hvd.Sum)
    else:
        hb = hvd.allreduce_async(b, name="order.b", op=hvd.Sum)
        time.sleep(0.05)  # rank 1 submits "order.a" cycles later
        ha = hvd.allreduce_async(a, name="order.a", op=hvd.Sum)
    out["order"] = [hvd.synchronize(ha), hvd.synchronize(hb)]

    out["gather"] = hvd.allgather(_rows(rank), name="gather")
    out["gather_async"] = hvd.synchronize(hvd.allgather_async(_rows(rank), name="gather_async"))
    out["bcast"] = hvd.broadcast(x, root_rank=1, name="bcast")
    out["bcast_input_kept"] = x
    z = x.clone()
    hvd.broadcast_(z, 1, "bcast_")
    out["bcast_"] = z
    out["bcast_async"] = hvd.synchronize(hvd.broadcast_async(x, 1, "bcast_async"))
    z2 = x.clone()
    hvd.synchronize(hvd.broadcast_async_(z2, 0, "bcast_async_"))
    out["bcast_async_"] = z2
    t = torch.arange(3.0) + 10 * rank
    out["a2a"], out["a2a_splits"] = hvd.alltoall(t, splits=[1, 2] if rank == 0 else [2, 1])
    out["a2a_even"] = hvd.alltoall(torch.arange(4.0) + 10 * rank, name="a2a_even")
    rs = torch.arange(10.0).view(5, 2) * (rank + 1)
    out["rs"] = hvd.reducescatter(rs, name="rs")
    out["rs_sum"] = hvd.synchronize(hvd.reducescatter_async(rs, name="rs_sum", op=hvd.Sum))
    handle = hvd.allreduce_async(x, name="poll", op=hvd.Sum)
    deadline = time.monotonic() + 60
    while not hvd.poll(handle) and time.monotonic() < deadline:
        time.sleep(0.001)
    out["polled"] = hvd.poll(handle)
    out["poll"] = hvd.synchronize(handle)
    hvd.barrier()

    # errors on every rank, not hangs
    for key, tensor in (
        ("shape_err", torch.zeros(2 + rank)),
        ("dtype_err", torch.zeros(2, dtype=torch.float32 if rank == 0 else torch.float64)),
    ):
        try:
            hvd.allreduce(tensor, name=key)
        except hvd.HorovodInternalError as e:
            out[key] = str(e)
    try:
        if rank == 0:
            hvd.allreduce(x, name="kind_err")
        else:
            hvd.allgather(x, name="kind_err")
    except hvd.HorovodInternalError as e:
        out["kind_err"] = str(e)
    try:
        hvd.allreduce(x, name="adasum", op=hvd.Adasum)
    except NotImplementedError as e:
        out["adasum"] = str(e)

    # the response cache: a repeated identical request travels as an integer id
    full, cached = ctl.stats.full_requests, ctl.stats.cached_requests
    out["avg_again"] = hvd.allreduce(x, name="avg")
    out["cache"] = [ctl.stats.full_requests - full, ctl.stats.cached_requests - cached]

    # autograd through allreduce, allgather, broadcast (loss: the sum over ranks)
    w = x.clone().requires_grad_()
    (hvd.allreduce(w, name="ad.ar", op=hvd.Sum) * _coef(rank, (2, 3))).sum().backward()
    out["grad_allreduce"] = w.grad
    w = x.clone().requires_grad_()
    (hvd.allreduce(w, name="ad.avg") * _coef(rank, (2, 3))).sum().backward()
    out["grad_allreduce_avg"] = w.grad
    v = _rows(rank).requires_grad_()
    (hvd.allgather(v, name="ad.ag") * _coef(rank, (3, 2))).sum().backward()
    out["grad_allgather"] = v.grad
    w = x.clone().requires_grad_()
    (hvd.broadcast(w, 1, name="ad.bc") * _coef(rank, (2, 3))).sum().backward()
    out["grad_broadcast"] = w.grad

    # join: rank 1 joins at once; rank 0's allreduce completes with rank 1 contributing zeros
    if rank == 0:
        out["join_extra"] = hvd.allreduce(x, name="join_extra", op=hvd.Sum)
    out["join_last"] = hvd.join()

    # shutdown, then init again: a fresh negotiation (names, caches) on the same job
    hvd.shutdown()
    hvd.shutdown()
    out["after_shutdown"] = hvd.is_initialized()
    try:
        hvd.allreduce(x, name="after")
    except ValueError as e:
        out["op_after_shutdown"] = str(e)
    hvd.init()
    out["reinit"] = hvd.allreduce(x, name="avg")
    out["reinit_unnamed"] = hvd.allreduce(x)
    out["reinit_cache"] = hvd.controller().stats.cached_requests
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_ops, WORLD, timeout=150)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_queries_and_init(ranks):
    for rank, out in enumerate(ranks):
        assert out["before"] == [False, True, False]
        assert "hvd.init()" in out["size_before_init"]
        assert out["who"] == [2, rank, 2, rank, 1, 0, True]


def test_allreduce_forms(ranks):
    x0, x1 = _x(0), _x(1)
    s = x0 + x1
    for out in ranks:
        _close(out["avg"], s / 2)
        _close(out["sum_positional"], s)
        _close(out["average_false"], s)
        _close(out["Min"], torch.minimum(x0, x1))
        _close(out["Max"], torch.maximum(x0, x1))
        _close(out["Product"], x0 * x1)
        _close(out["scaled"], (2 * x0 + 2 * x1) / 2 * 0.25)
        assert out["inplace_is_input"] is True
        for key in ("inplace", "async", "async_", "poll"):
            _close(out[key], s)
        assert out["polled"] is True
        assert out["ints"].dtype == torch.int64 and out["ints"].tolist() == [3, 20]
        assert out["fp16"].dtype == torch.float32
        torch.testing.assert_close(out["fp16"], s / 2, rtol=1e-3, atol=1e-3)


def test_grouped_allreduce_forms(ranks):
    x0, x1 = _x(0), _x(1)
    for out in ranks:
        _close(out["grouped"][0], x0 + x1)
        _close(out["grouped"][1], 2 * (x0 + x1))
        _close(out["grouped_async"][0], (x0 + x1) / 2)
        _close(out["grouped_async"][1], (x0 + x1) / 2 + 1)
        for key in ("grouped_", "grouped_async_"):
            _close(out[key][0], x0 + x1)
            _close(out[key][1], 3 * (x0 + x1))


def test_different_submission_orders_meet_by_name(ranks):
    for out in ranks:
        _close(out["order"][0], torch.full((3,), 3.0))
        _close(out["order"][1], torch.full((5,), 30.0))


def test_allgather_variable_first_dimension(ranks):
    expected = torch.cat([_rows(0), _rows(1)])
    for out in ranks:
        _close(out["gather"], expected)
        _close(out["gather_async"], expected)


def test_broadcast_forms(ranks):
    for rank, out in enumerate(ranks):
        _close(out["bcast"], _x(1))
        _close(out["bcast_input_kept"], _x(rank))  # broadcast() leaves its input alone
        _close(out["bcast_"], _x(1))
        _close(out["bcast_async"], _x(1))
        _close(out["bcast_async_"], _x(0))


def test_alltoall_and_reducescatter(ranks):
    t0, t1 = torch.arange(3.0), torch.arange(3.0) + 10
    expected = {0: (torch.cat([t0[:1], t1[:2]]), [1, 2]), 1: (torch.cat([t0[1:], t1[2:]]), [2, 1])}
    rs = torch.arange(10.0).view(5, 2) * 3  # rank 0's + rank 1's
    for rank, out in enumerate(ranks):
        _close(out["a2a"], expected[rank][0])
        assert out["a2a_splits"].tolist() == expected[rank][1]
        e0, e1 = torch.arange(4.0), torch.arange(4.0) + 10
        _close(
            out["a2a_even"], torch.cat([e0[2 * rank : 2 * rank + 2], e1[2 * rank : 2 * rank + 2]])
        )
        rows = rs[:3] if rank == 0 else rs[3:]  # 5 rows: the first rank gets the extra one
        _close(out["rs_sum"], rows)
        _close(out["rs"], rows / 2)


def test_mismatches_raise_on_every_rank(ranks):
    for out in ranks:
        assert "Mismatched ALLREDUCE tensor shapes for 'shape_err'" in out["shape_err"]
        assert "rank 0 sent [2]" in out["shape_err"] and "rank 1 sent [3]" in out["shape_err"]
        assert "Mismatched ALLREDUCE data types for 'dtype_err'" in out["dtype_err"]
        assert "float32" in out["dtype_err"] and "float64" in out["dtype_err"]
        assert "Mismatched collective operations for 'kind_err'" in out["kind_err"]
        assert "ALLGATHER" in out["kind_err"]
        assert "Adasum" in out["adasum"]


def test_repeated_request_travels_as_a_cache_id(ranks):
    for out in ranks:
        _close(out["avg_again"], out["avg"])
        assert out["cache"] == [0, 1]


def test_autograd_matches_single_process(ranks):
    xs = [_x(r).requires_grad_() for r in range(WORLD)]
    total = sum((sum(xs) * _coef(r, (2, 3))).sum() for r in range(WORLD))
    total.backward()
    vs = [_rows(r).requires_grad_() for r in range(WORLD)]
    gathered = torch.cat(vs)
    sum((gathered * _coef(r, (3, 2))).sum() for r in range(WORLD)).backward()
    bc = sum(_coef(r, (2, 3)) for r in range(WORLD))
    for rank, out in enumerate(ranks):
        _close(out["grad_allreduce"], xs[rank].grad)
        _close(out["grad_allreduce_avg"], xs[rank].grad / WORLD)
        # Horovod averages the gradients of allgather and broadcast over the ranks
        _close(out["grad_allgather"], vs[rank].grad / WORLD)
        _close(out["grad_broadcast"], bc / WORLD if rank == 1 else torch.zeros(2, 3))


def test_join_zeros_for_the_joined_rank_and_names_the_last(ranks):
    _close(ranks[0]["join_extra"], _x(0))
    assert [out["join_last"] for out in ranks] == [0, 0]


def test_init_again_after_shutdown(ranks):
    for out in ranks:
        assert out["after_shutdown"] is False
        assert "hvd.init()" in out["op_after_shutdown"]
        _close(out["reinit"], (_x(0) + _x(1)) / 2)
        _close(out["reinit_unnamed"], (_x(0) + _x(1)) / 2)
        assert out["reinit_cache"] == 0  # the cache started empty again
