"""longboat.horovod.torch behaves like Horovod in its corners, on 2 real Gloo ranks.

One spawn (``_run``) exercises every corner in one session per rank — dtypes, a failing op that
must not poison later ones, scale factors on integers, duplicate names, gradient conventions,
join, broadcast_optimizer_state, sparse gradients, grouped allgather/reducescatter and process
sets — and records what it saw. The tests compare those records with expectations computed
here, in one process, from Horovod's documented behaviour.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests._dist import run_ranks

WORLD = 2
DTYPES = [
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _val(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Four values per rank, non-negative (uint8) and small (int8 sums stay in range)."""
    if dtype == torch.bool:
        return torch.tensor([True, rank == 0, False, rank == 1])
    return torch.tensor([1 + rank, 2, 3 * rank, 5 - rank], dtype=torch.int64).to(dtype)


def _coef(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(float(math.prod(shape))).view(shape) * (rank + 2) - rank


def _rows(rank: int) -> torch.Tensor:
    return torch.arange(2.0 * (rank + 1)).view(rank + 1, 2) + 5.0 * rank  # 1 row, then 2


def _dtypes(hvd, rank: int, out: dict) -> None:
    for dtype in DTYPES:
        key, x = _name(dtype), _val(rank, dtype)
        out[f"{key}.sum"] = hvd.allreduce(x, name=f"{key}.sum", op=hvd.Sum)
        out[f"{key}.min"] = hvd.allreduce(x, name=f"{key}.min", op=hvd.Min)
        out[f"{key}.max"] = hvd.allreduce(x, name=f"{key}.max", op=hvd.Max)
        if dtype != torch.bool:
            out[f"{key}.avg"] = hvd.allreduce(x, name=f"{key}.avg", op=hvd.Average)
        y = x.clone()
        hvd.allreduce_(y, name=f"{key}.inplace", op=hvd.Sum)
        out[f"{key}.inplace"] = y
        out[f"{key}.gather"] = hvd.allgather(x, name=f"{key}.gather")
        out[f"{key}.bcast"] = hvd.broadcast(x, root_rank=1, name=f"{key}.bcast")
        out[f"{key}.a2a"] = hvd.alltoall(x, name=f"{key}.a2a")
        out[f"{key}.rs"] = hvd.reducescatter(x, name=f"{key}.rs", op=hvd.Sum)


def _failures(hvd, rank: int, out: dict) -> None:
    """A failed op raises where it was called; the next ops and shutdown still work."""
    try:
        hvd.allreduce(torch.zeros(2 + rank), name="bad.shape")
    except hvd.HorovodInternalError as e:
        out["bad_shape"] = str(e)
    out["after_bad_shape"] = hvd.allreduce(torch.full((3,), float(rank)), name="after1", op=hvd.Sum)
    # a collective that raises while running (injected on both ranks), not in negotiation
    ctl = hvd.controller()

    def explode(resp):
        del ctl._allgather  # once
        raise RuntimeError("injected failure")

    ctl._allgather = explode
    try:
        hvd.allgather(torch.ones(1), name="bad.run")
    except hvd.HorovodInternalError as e:
        out["bad_run"] = str(e)
    out["after_bad_run"] = hvd.allgather(torch.full((1,), float(rank)), name="after2")
    # Horovod: starting an op under a name still in flight is a ValueError
    handle = hvd.allreduce_async(torch.ones(2), name="dup", op=hvd.Sum)
    try:
        hvd.allreduce_async(torch.ones(2), name="dup", op=hvd.Sum)
    except ValueError as e:
        out["dup"] = str(e)
    out["dup_first"] = hvd.synchronize(handle)


def _integers(hvd, rank: int, out: dict) -> None:
    x = torch.tensor([5, -5, 7, 3], dtype=torch.int32) * (rank + 1)
    out["int_scaled"] = hvd.allreduce(
        x, name="int.scaled", op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0
    )
    out["int16_scaled"] = hvd.allreduce(
        x.to(torch.int16), name="int16.scaled", op=hvd.Sum, prescale_factor=0.5
    )
    a = torch.tensor([-3, 3, 1, -1], dtype=torch.int64) if rank == 0 else torch.zeros(4).long()
    out["int_avg"] = hvd.allreduce(a, name="int.avg", op=hvd.Average)
    rs = torch.tensor([[-3], [3], [1], [-1]], dtype=torch.int32) * (1 - rank)
    out["int_rs_avg"] = hvd.reducescatter(rs, name="int.rs", op=hvd.Average)


def _gradients(hvd, rank: int, out: dict) -> None:
    w = torch.arange(6.0).view(2, 3).add(rank).requires_grad_()
    (hvd.broadcast(w, 1, name="g.bc") * _coef(rank, (2, 3))).sum().backward()
    out["grad_bcast"] = w.grad
    v = _rows(rank).requires_grad_()
    (hvd.allgather(v, name="g.ag") * _coef(rank, (3, 2))).sum().backward()
    out["grad_gather"] = v.grad
    for op in (hvd.Sum, hvd.Average):
        x = torch.arange(8.0).view(4, 2).mul(rank + 1).requires_grad_()
        (hvd.reducescatter(x, name=f"g.rs.{op.name}", op=op) * _coef(rank, (2, 2))).sum().backward()
        out[f"grad_rs_{op.name}"] = x.grad


def _join(hvd, rank: int, out: dict) -> None:
    """Rank 1 joins at once; rank 0's allreduces see zeros from it, the rest raise."""
    if rank == 0:
        x = torch.tensor([2.0, 4.0, -6.0])
        out["join_sum"] = hvd.allreduce(x, name="j.sum", op=hvd.Sum)
        out["join_avg"] = hvd.allreduce(x, name="j.avg", op=hvd.Average)
        for kind, call in (
            ("allgather", lambda: hvd.allgather(x, name="j.ag")),
            ("broadcast", lambda: hvd.broadcast(x, 0, name="j.bc")),
            ("alltoall", lambda: hvd.alltoall(torch.ones(2), name="j.a2a")),
            ("reducescatter", lambda: hvd.reducescatter(torch.ones(2), name="j.rs")),
        ):
            try:
                call()
            except hvd.HorovodInternalError as e:
                out[f"join_{kind}"] = str(e)
    out["join_last"] = hvd.join()
    out["after_join"] = hvd.allreduce(torch.ones(2) * (rank + 1), name="j.after", op=hvd.Sum)


def _optimizer_state(hvd, rank: int, out: dict) -> None:
    """Rank 0 has trained a step; rank 1's fresh optimizer gets its state from a local step on
    zero gradients (which stay), then rank 0's values."""
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 if rank == 0 else 0.7, momentum=0.9)
    if rank == 0:
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["opt_grads"] = [p.grad for p in model.parameters()]
    out["opt_lr"] = opt.param_groups[0]["lr"]
    out["opt_state"] = [opt.state[p]["momentum_buffer"] for p in model.parameters()]


def _sparse(hvd, rank: int, out: dict) -> None:
    idx = torch.tensor([[0, 2]]) if rank == 0 else torch.tensor([[2, 3, 3]])
    val = torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([10.0, 20.0, 5.0])
    t = torch.sparse_coo_tensor(idx, val, (5,))
    out["sparse_sum"] = hvd.synchronize(hvd.sparse_allreduce_async(t, "sp.sum", hvd.Sum))
    out["sparse_avg"] = hvd.sparse_allreduce_async(t, "sp.avg", hvd.Average)()
    # DistributedOptimizer with a sparse embedding and sparse_as_dense=False
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 2, sparse=True)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(emb.parameters(), lr=1.0), named_parameters=emb.named_parameters()
    )
    tokens = torch.tensor([0, 1, 1]) if rank == 0 else torch.tensor([1, 4])
    (emb(tokens) * _coef(rank, (len(tokens), 2))).sum().backward()
    opt.synchronize()
    out["sparse_opt_is_sparse"] = emb.weight.grad.is_sparse
    out["sparse_opt_grad"] = emb.weight.grad.to_dense()
    with opt.skip_synchronize():
        opt.step()
    out["sparse_opt_weight"] = emb.weight.detach().clone()


def _grouped(hvd, rank: int, out: dict) -> None:
    a, b = _rows(rank), torch.arange(3.0).view(3, 1) * (rank + 1)
    out["grouped_gather"] = hvd.grouped_allgather([a, b], name="gg")
    out["grouped_gather_async"] = hvd.synchronize(hvd.grouped_allgather_async([b, a]))
    c, d = torch.arange(4.0).view(4, 1) * (rank + 1), torch.arange(6.0).view(3, 2) + rank
    out["grouped_rs"] = hvd.grouped_reducescatter([c, d], name="grs", op=hvd.Sum)
    out["grouped_rs_avg"] = hvd.synchronize(
        hvd.grouped_reducescatter_async([c, d], name="grs.avg", op=hvd.Average)
    )


def _process_sets_dynamic(hvd, rank: int, out: dict) -> None:
    hvd.init(process_sets="dynamic")
    sets = [hvd.add_process_set([0]), hvd.add_process_set(hvd.ProcessSet([1]))]
    mine, other = sets[rank], sets[1 - rank]
    out["ps_ids"] = [s.process_set_id for s in sets]
    out["ps_info"] = [mine.size(), mine.rank(), mine.included(), other.included(), other.rank()]
    out["ps_global"] = [hvd.global_process_set.size(), hvd.global_process_set.ranks]
    x = torch.tensor([1.0, 2.0]) * (rank + 1)
    out["ps_allreduce"] = hvd.allreduce(x, name="ps.ar", op=hvd.Sum, process_set=mine)
    out["ps_gather"] = hvd.allgather(x, name="ps.ag", process_set=mine)
    out["ps_bcast"] = hvd.broadcast(x, root_rank=rank, name="ps.bc", process_set=mine)
    out["ps_rs"] = hvd.reducescatter(x, name="ps.rs", op=hvd.Sum, process_set=mine)
    out["ps_a2a"] = hvd.alltoall(x, name="ps.a2a", process_set=mine)
    hvd.barrier(process_set=mine)
    # the same name on a set and on the global set are different ops
    out["ps_same_name_global"] = hvd.allreduce(x, name="ps.ar", op=hvd.Sum)
    for key, call in (
        ("ps_not_member", lambda: hvd.allreduce(x, process_set=other)),
        ("ps_bad_root", lambda: hvd.broadcast(x, root_rank=1 - rank, process_set=mine)),
    ):
        try:
            call()
        except ValueError as e:
            out[key] = str(e)
    # the optimizer and broadcast_parameters on a process set
    torch.manual_seed(rank)
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        process_set=mine,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=rank, process_set=mine)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    out["ps_opt_grad"] = [p.grad.clone() for p in model.parameters()]
    # outside its process set, Horovod's DistributedOptimizer reduces nothing
    lone = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(lone.parameters(), lr=0.1), process_set=other)
    (lone(torch.ones(1, 2)) * (rank + 1)).sum().backward()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    out["ps_opt_outside"] = [p.grad.clone() for p in lone.parameters()]
    # registering differently on the ranks fails on every rank instead of hanging
    try:
        hvd.add_process_set([rank])
    except ValueError as e:
        out["ps_order"] = str(e)
    try:
        hvd.add_process_set([0, 1])
    except ValueError as e:
        out["ps_all_ranks"] = str(e)
    out["ps_removed"] = [hvd.remove_process_set(sets[0]), hvd.remove_process_set(sets[1])]
    out["ps_removed_global"] = hvd.remove_process_set(hvd.global_process_set)
    try:
        hvd.allreduce(x, process_set=mine)
    except ValueError as e:
        out["ps_after_remove"] = str(e)
    again = hvd.add_process_set([1])
    out["ps_again_id"] = again.process_set_id
    if rank == 1:
        out["ps_again"] = hvd.allreduce(x, name="again", op=hvd.Sum, process_set=again)
    hvd.shutdown()
    # static process sets: registered by hvd.init on every rank
    evens = hvd.ProcessSet([0])
    hvd.init(process_sets=[evens, hvd.ProcessSet([1])])
    out["ps_static"] = [evens.process_set_id, evens.included()]
    if rank == 0:
        out["ps_static_ar"] = hvd.allreduce(x, name="st", op=hvd.Sum, process_set=evens)
    out["ps_static_global"] = hvd.allreduce(x, name="st", op=hvd.Sum)
    hvd.shutdown()


def _run(rank: int, world: int) -> dict:
    import longboat.horovod.torch as hvd

    out: dict = {}
    hvd.init()
    _dtypes(hvd, rank, out)
    _failures(hvd, rank, out)
    _integers(hvd, rank, out)
    _gradients(hvd, rank, out)
    _join(hvd, rank, out)
    _optimizer_state(hvd, rank, out)
    _sparse(hvd, rank, out)
    _grouped(hvd, rank, out)
    try:
        hvd.add_process_set([0])
    except ValueError as e:
        out["ps_not_dynamic"] = str(e)
    hvd.shutdown()
    out["shutdown_after_failures"] = not hvd.is_initialized()
    _process_sets_dynamic(hvd, rank, out)
    _broken_session(hvd, rank, out)
    return out


def _broken_session(hvd, rank: int, out: dict) -> None:
    """A session whose control group broke (as when a peer dies): ops raise, shutdown() still
    returns and init() starts afresh."""
    hvd.init()
    hvd.controller()._fail_all(hvd.HorovodInternalError("simulated lost peer"), broken=True)
    try:
        hvd.allreduce(torch.ones(1), name="broken")
    except hvd.HorovodInternalError as e:
        out["broken_op"] = str(e)
    hvd.shutdown()
    hvd.init()
    out["after_broken"] = hvd.allreduce(torch.ones(2) * (rank + 1), name="fresh", op=hvd.Sum)
    hvd.shutdown()


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_run, WORLD, timeout=300)


def _close(a, b, tol=1e-6):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _exact(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.tolist() == expected.tolist(), (got, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_every_horovod_dtype_on_every_collective(ranks, dtype):
    v0, v1 = _val(0, dtype), _val(1, dtype)
    if dtype == torch.bool:  # non-zero is True: Sum/Max are "any", Min "all"
        total, low, high = v0 | v1, v0 & v1, v0 | v1
    else:
        wide = v0.double() + v1.double()
        total = wide.to(dtype)
        low, high = torch.minimum(v0, v1), torch.maximum(v0, v1)
    for rank, out in enumerate(ranks):
        key = _name(dtype)
        _exact(out[f"{key}.sum"], total)
        _exact(out[f"{key}.inplace"], total)
        _exact(out[f"{key}.min"], low)
        _exact(out[f"{key}.max"], high)
        if dtype != torch.bool:
            avg = (v0.double() + v1.double()) / 2
            if not dtype.is_floating_point:
                avg = avg.trunc()  # Horovod: integer averages round toward zero
            _exact(out[f"{key}.avg"], avg.to(dtype))
        _exact(out[f"{key}.gather"], torch.cat([v0, v1]))
        _exact(out[f"{key}.bcast"], v1)
        _exact(
            out[f"{key}.a2a"], torch.cat([v0[2 * rank : 2 * rank + 2], v1[2 * rank : 2 * rank + 2]])
        )
        _exact(out[f"{key}.rs"], total[2 * rank : 2 * rank + 2])


def test_a_failed_op_does_not_poison_later_ops_or_shutdown(ranks):
    for out in ranks:
        assert "Mismatched ALLREDUCE tensor shapes for 'bad.shape'" in out["bad_shape"]
        _close(out["after_bad_shape"], torch.full((3,), 1.0))
        assert "injected failure" in out["bad_run"] and "'bad.run'" in out["bad_run"]
        _close(out["after_bad_run"], torch.tensor([0.0, 1.0]))
        assert "'dup'" in out["dup"] and "currently being processed" in out["dup"]
        _close(out["dup_first"], torch.full((2,), 2.0))
        assert out["shutdown_after_failures"] is True


def test_shutdown_and_init_after_a_broken_session(ranks):
    for out in ranks:
        assert "simulated lost peer" in out["broken_op"]
        _close(out["after_broken"], torch.full((2,), 3.0))


def test_integer_scale_factors_and_average_round_toward_zero(ranks):
    xs = [[5 * (r + 1), -5 * (r + 1), 7 * (r + 1), 3 * (r + 1)] for r in range(WORLD)]
    pre = [sum(math.trunc(xs[r][i] * 0.5) for r in range(WORLD)) for i in range(4)]
    scaled = [math.trunc(p * 3.0) for p in pre]
    for rank, out in enumerate(ranks):
        _exact(out["int_scaled"], torch.tensor(scaled, dtype=torch.int32))
        _exact(out["int16_scaled"], torch.tensor(pre, dtype=torch.int16))
        _exact(out["int_avg"], torch.tensor([-1, 1, 0, 0]))  # floor would give [-2, 1, 0, -1]
        expected_rs = [[-1], [1]] if rank == 0 else [[0], [0]]
        _exact(out["int_rs_avg"], torch.tensor(expected_rs, dtype=torch.int32))


def test_gradient_conventions(ranks):
    # broadcast: the gradients averaged over the ranks, only on the root
    bc = sum(_coef(r, (2, 3)) for r in range(WORLD)) / WORLD
    _close(ranks[0]["grad_bcast"], torch.zeros(2, 3))
    _close(ranks[1]["grad_bcast"], bc)
    # allgather: the gradients averaged over the ranks, this rank's rows
    avg = sum(_coef(r, (3, 2)) for r in range(WORLD)) / WORLD
    _close(ranks[0]["grad_gather"], avg[:1])
    _close(ranks[1]["grad_gather"], avg[1:])
    # reducescatter: every rank's output gradient gathered; times the size for Sum
    gathered = torch.cat([_coef(r, (2, 2)) for r in range(WORLD)])
    for out in ranks:
        _close(out["grad_rs_Sum"], gathered * WORLD)
        _close(out["grad_rs_Average"], gathered)


def test_join(ranks):
    x = torch.tensor([2.0, 4.0, -6.0])
    _close(ranks[0]["join_sum"], x)  # the joined rank contributes zeros
    _close(ranks[0]["join_avg"], x / WORLD)  # and still counts in the average
    for kind in ("allgather", "broadcast", "alltoall", "reducescatter"):
        assert f"{kind.capitalize()} is not supported with Join" in ranks[0][f"join_{kind}"]
    assert [out["join_last"] for out in ranks] == [0, 0]
    for out in ranks:
        _close(out["after_join"], torch.full((2,), 3.0))


def test_broadcast_optimizer_state_leaves_zero_gradients(ranks):
    root, other = ranks
    assert other["opt_lr"] == root["opt_lr"] == 0.1
    for g in other["opt_grads"]:
        assert g is not None and not g.any()  # zeros, not None
    # rank 0's momentum after one step on the gradient of sum(Linear(ones)): ones
    expected = [torch.ones(2, 3), torch.ones(2)]
    for a, b, e in zip(root["opt_state"], other["opt_state"], expected, strict=True):
        _close(a, e)
        _close(b, e)


def test_sparse_allreduce_gathers_indices_and_values(ranks):
    dense_sum = torch.tensor([1.0, 0.0, 12.0, 25.0, 0.0])
    for out in ranks:
        assert out["sparse_sum"].is_sparse
        _close(out["sparse_sum"].to_dense(), dense_sum)
        _close(out["sparse_avg"].to_dense(), dense_sum / WORLD)


def test_sparse_gradients_without_sparse_as_dense(ranks):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 2)
    start = emb.weight.detach().clone()
    grads = []
    for rank, tokens in enumerate((torch.tensor([0, 1, 1]), torch.tensor([1, 4]))):
        emb.weight.grad = None
        (emb(tokens) * _coef(rank, (len(tokens), 2))).sum().backward()
        grads.append(emb.weight.grad.clone())
    avg = sum(grads) / WORLD
    for out in ranks:
        assert out["sparse_opt_is_sparse"] is True
        _close(out["sparse_opt_grad"], avg)
        _close(out["sparse_opt_weight"], start - avg)


def test_grouped_allgather_and_reducescatter(ranks):
    a = [_rows(r) for r in range(WORLD)]
    b = [torch.arange(3.0).view(3, 1) * (r + 1) for r in range(WORLD)]
    c = sum(torch.arange(4.0).view(4, 1) * (r + 1) for r in range(WORLD))
    d = sum(torch.arange(6.0).view(3, 2) + r for r in range(WORLD))
    d_rows = [d[:2], d[2:]]  # 3 rows over 2 ranks: the first rank gets the extra one
    for rank, out in enumerate(ranks):
        _close(out["grouped_gather"][0], torch.cat(a))
        _close(out["grouped_gather"][1], torch.cat(b))
        _close(out["grouped_gather_async"][0], torch.cat(b))
        _close(out["grouped_gather_async"][1], torch.cat(a))
        _close(out["grouped_rs"][0], c[2 * rank : 2 * rank + 2])
        _close(out["grouped_rs"][1], d_rows[rank])
        _close(out["grouped_rs_avg"][0], c[2 * rank : 2 * rank + 2] / WORLD)
        _close(out["grouped_rs_avg"][1], d_rows[rank] / WORLD)


def test_process_sets(ranks):
    for rank, out in enumerate(ranks):
        x = torch.tensor([1.0, 2.0]) * (rank + 1)
        assert "dynamic process sets" in out["ps_not_dynamic"]
        assert out["ps_ids"] == [1, 2]
        assert out["ps_info"] == [1, 0, True, False, -1]
        assert out["ps_global"] == [2, [0, 1]]
        for key in ("ps_allreduce", "ps_gather", "ps_bcast", "ps_rs", "ps_a2a"):
            _close(out[key], x)  # a one-rank set: each op is the identity
        _close(out["ps_same_name_global"], torch.tensor([3.0, 6.0]))
        assert f"rank {rank} is not part of" in out["ps_not_member"]
        assert "is not a rank of" in out["ps_bad_root"]
        for g in out["ps_opt_grad"]:  # averaged over the set (this rank alone)
            assert g.abs().sum() > 0
        _close(out["ps_opt_grad"][0], torch.ones(1, 2))
        _close(out["ps_opt_grad"][1], torch.ones(1))
        _close(out["ps_opt_outside"][0], torch.full((1, 2), rank + 1.0))  # this rank's own
        assert "same order with the same ranks" in out["ps_order"]
        assert "rank 0: add_process_set([0])" in out["ps_order"]
        assert "hvd.global_process_set" in out["ps_all_ranks"]
        assert out["ps_removed"] == [True, True] and out["ps_removed_global"] is False
        assert "is not registered" in out["ps_after_remove"]
        assert out["ps_again_id"] not in (None, 0, 1, 2)  # a new id
        assert out["ps_static"] == [1, rank == 0]
        _close(out["ps_static_global"], torch.tensor([3.0, 6.0]))
    _close(ranks[1]["ps_again"], torch.tensor([2.0, 4.0]))
    _close(ranks[0]["ps_static_ar"], torch.tensor([1.0, 2.0]))
