"""SyncBatchNorm on 2-3 Gloo ranks equals nn.BatchNorm on the concatenated global batch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from longboat.collective.sync_bn import SyncBatchNorm, _SyncBatchNormFn, convert_sync_batchnorm
from tests._dist import run_ranks

C = 3
_BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}

# (local batch sizes, per-sample shape after C, momentum, steps, process-group ranks or None)
Case = tuple[list[int], tuple[int, ...], float | None, int, list[int] | None]
CASES_2: list[Case] = [
    ([4, 4], (5, 5), 0.1, 2, None),
    ([3, 4], (5, 5), None, 3, None),  # cumulative average over 3 steps
    ([6, 2], (), 0.3, 1, None),  # (N, C) input, like BatchNorm1d
    ([2, 2], (2, 3, 2), 0.1, 1, None),  # (N, C, D, H, W), like BatchNorm3d
]
CASES_3: list[Case] = [
    ([2, 5, 1], (4, 4), 0.1, 2, None),  # unequal, one rank with a single sample
    ([3, 0, 5], (4, 4), 0.1, 2, None),  # rank 1 has no samples at all
    ([4, 9, 2], (3, 3), 0.1, 1, [0, 2]),  # subgroup: ranks 0 and 2 only
]


def _data(sizes: list[int], shape: tuple[int, ...], step: int) -> tuple[torch.Tensor, ...]:
    """Global input (offset and scaled per channel) and upstream gradient for one step."""
    g = torch.Generator().manual_seed(1000 * step + sum(sizes))
    full = (sum(sizes), C, *shape)
    bcast = (1, C) + (1,) * len(shape)
    x = torch.randn(full, generator=g) * torch.tensor([0.5, 2.0, 1.0]).view(bcast)
    x = x + torch.tensor([3.0, -1.0, 0.0]).view(bcast)
    return x, torch.randn(full, generator=g)


def _affine(bn: nn.Module) -> None:
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.5, -0.5, 0.8]))
        bn.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))


def _local(t: torch.Tensor, sizes: list[int], r: int) -> torch.Tensor:
    start = sum(sizes[:r])
    return t[start : start + sizes[r]]


def _run_case(rank: int, case: Case) -> dict[str, Any] | None:
    sizes, shape, momentum, steps, ranks = case
    group = dist.new_group(ranks) if ranks is not None else None  # collective: all ranks call
    if ranks is not None and rank not in ranks:
        return None
    bn = SyncBatchNorm(C, momentum=momentum, process_group=group)
    _affine(bn)
    out: dict[str, Any] = {"y": [], "dx": [], "dw": [], "db": []}
    for step in range(steps):
        x, dy = _data(sizes, shape, step)
        x = _local(x, sizes, rank).requires_grad_()
        bn.weight.grad = bn.bias.grad = None
        y = bn(x)
        y.backward(_local(dy, sizes, rank))
        for k, v in (("y", y), ("dx", x.grad), ("dw", bn.weight.grad), ("db", bn.bias.grad)):
            out[k].append(v.detach())
    out.update(mean=bn.running_mean, var=bn.running_var, n=bn.num_batches_tracked)
    return out


def _cases_rank(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any] | None]:
    import longboat as lb

    lb.init()
    return [_run_case(rank, case) for case in cases]


def _reference(case: Case) -> dict[str, Any]:
    sizes, shape, momentum, steps, ranks = case
    sizes = [sizes[r] for r in ranks] if ranks is not None else sizes
    bn = _BN[2 + len(shape)](C, momentum=momentum)
    _affine(bn)
    out: dict[str, Any] = {"y": [], "dx": [], "dw": [], "db": []}
    for step in range(steps):
        x, dy = _data(case[0], shape, step)
        if ranks is not None:  # the subgroup's global batch: its members' slices only
            x = torch.cat([_local(x, case[0], r) for r in ranks])
            dy = torch.cat([_local(dy, case[0], r) for r in ranks])
        x.requires_grad_()
        bn.weight.grad = bn.bias.grad = None
        y = bn(x)
        y.backward(dy)
        for k, v in (("y", y), ("dx", x.grad), ("dw", bn.weight.grad), ("db", bn.bias.grad)):
            out[k].append(v.detach())
    out.update(mean=bn.running_mean, var=bn.running_var, n=bn.num_batches_tracked, sizes=sizes)
    return out


def _check(cases: list[Case], results: list[list[dict[str, Any] | None]]) -> None:
    for i, case in enumerate(cases):
        ref = _reference(case)
        members = case[4] if case[4] is not None else range(len(results))
        per_rank = [results[r][i] for r in members]
        assert all(results[r][i] is None for r in range(len(results)) if r not in members)
        for step in range(case[3]):
            for idx, got in enumerate(per_rank):
                assert got is not None
                for k in ("y", "dx"):
                    want = _local(ref[k][step], ref["sizes"], idx)
                    torch.testing.assert_close(got[k][step], want, rtol=1e-5, atol=1e-6)
            for k in ("dw", "db"):  # local sums: over ranks they add up to the global sum
                total = sum(got[k][step] for got in per_rank)  # type: ignore[index]
                torch.testing.assert_close(total, ref[k][step], rtol=1e-5, atol=1e-5)
        for got in per_rank:
            assert got is not None
            torch.testing.assert_close(got["mean"], ref["mean"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["var"], ref["var"], rtol=1e-5, atol=1e-6)
            assert int(got["n"]) == int(ref["n"]) == case[3]


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    """Everything the 2-rank tests check, from one spawn: the cases, the mean loss / eval /
    bf16 / size-1 group checks and the training run (each with its own modules and groups)."""
    import longboat as lb

    lb.init()
    return {
        "cases": [_run_case(rank, case) for case in CASES_2],
        "misc": _misc(rank, world),
        "train": _train_both(rank, world),
        "buffers": _buffers_vs_ddp(rank, world),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_two_ranks, 2)


def test_two_ranks_match_batchnorm_on_global_batch(two_ranks: list[dict[str, Any]]) -> None:
    _check(CASES_2, [r["cases"] for r in two_ranks])


def test_three_ranks_unequal_and_empty_local_batches() -> None:
    _check(CASES_3, run_ranks(_cases_rank, 3, CASES_3))


# --- mean loss, eval mode, bf16, size-1 groups: one 2-rank run -----------------------------


def _loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2 * torch.arange(1.0, C + 1).view(1, C, 1, 1)).mean()


def _misc(rank: int, world: int) -> dict[str, Any]:
    sizes = [4] * world
    x, target = _data(sizes, (5, 5), 7)
    out: dict[str, Any] = {}

    # Mean loss per rank; the reducer's average of weight/bias grads must be the global one.
    bn = SyncBatchNorm(C)
    _affine(bn)
    xl = _local(x, sizes, rank).requires_grad_()
    _loss(bn(xl), _local(target, sizes, rank)).backward()
    out.update(dx=xl.grad, dw=bn.weight.grad.clone(), db=bn.bias.grad.clone())

    # Eval mode: running statistics, no communication at all.
    real = dist.all_reduce

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("SyncBatchNorm communicated in eval mode")

    dist.all_reduce = forbidden  # type: ignore[assignment]
    try:
        bn.eval()
        y_eval = bn(_local(x, sizes, rank))
        y_eval.sum().backward()
        bn.train()
        with pytest.raises(AssertionError, match="communicated"):  # the patch does bite
            bn(_local(x, sizes, rank))
    finally:
        dist.all_reduce = real  # type: ignore[assignment]
    want = F.batch_norm(
        _local(x, sizes, rank), bn.running_mean, bn.running_var, bn.weight, bn.bias, eps=bn.eps
    )
    out["eval_equal"] = torch.equal(y_eval, want)

    # bf16 input: statistics from the exact bf16 values in float32 or better.
    bnh = SyncBatchNorm(C)
    _affine(bnh)
    xh = _local(x, sizes, rank).bfloat16().requires_grad_()
    yh = bnh(xh)
    yh.backward(torch.ones_like(yh))
    out.update(yh=yh.detach(), dxh=xh.grad, mean_h=bnh.running_mean, var_h=bnh.running_var)

    # A group of size 1 is plain BatchNorm on the local batch, bit for bit.
    singles = [dist.new_group([r]) for r in range(world)]
    solo, plain = SyncBatchNorm(C, process_group=singles[rank]), nn.BatchNorm2d(C)
    xs = _local(x, sizes, rank)
    out["solo_equal"] = torch.equal(solo(xs), plain(xs)) and torch.equal(
        solo.running_var, plain.running_var
    )
    return out


def test_mean_loss_eval_bf16_and_size_one_groups(two_ranks: list[dict[str, Any]]) -> None:
    world, sizes = 2, [4, 4]
    got = [r["misc"] for r in two_ranks]
    x, target = _data(sizes, (5, 5), 7)
    bn = nn.BatchNorm2d(C)
    _affine(bn)
    x.requires_grad_()
    _loss(bn(x), target).backward()  # single process: mean over the global batch

    for r, g in enumerate(got):
        # Input grad on rank r is d(sum_r L_r)/dx = world * d(mean loss)/dx, which is what makes
        # upstream weight grads right once the reducer divides their sum by world.
        torch.testing.assert_close(g["dx"], world * _local(x.grad, sizes, r), rtol=1e-5, atol=1e-6)
        assert g["eval_equal"] and g["solo_equal"]
    for k, p in (("dw", bn.weight), ("db", bn.bias)):
        average = sum(g[k] for g in got) / world  # what the data-parallel reducer produces
        torch.testing.assert_close(average, p.grad, rtol=1e-5, atol=1e-6)

    xh = x.detach().bfloat16().float().requires_grad_()  # the exact values the ranks saw
    bnf = nn.BatchNorm2d(C)
    _affine(bnf)
    yf = bnf(xh)
    yf.backward(torch.ones_like(yf))
    for r, g in enumerate(got):
        assert g["yh"].dtype == g["dxh"].dtype == torch.bfloat16
        assert g["mean_h"].dtype == torch.float32
        torch.testing.assert_close(g["mean_h"], bnf.running_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g["var_h"], bnf.running_var, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g["yh"].float(), _local(yf, sizes, r), rtol=1e-2, atol=1e-2)
        want_dx = _local(xh.grad, sizes, r)
        torch.testing.assert_close(g["dxh"].float(), want_dx, rtol=1e-2, atol=1e-2)


# --- short training run ---------------------------------------------------------------------

STEPS, BATCH = 10, 8


def _net() -> nn.Module:
    torch.manual_seed(0)
    features = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 6, 3)
    )
    return nn.Sequential(
        features, nn.BatchNorm2d(6, momentum=None), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4 * 4, 3)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 3, 6, 6, generator=g) + 1.0, torch.randint(
        0, 3, (BATCH,), generator=g
    )


def _train(model: nn.Module, rank: int, world: int) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    local = BATCH // world
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(
            model(x[rank * local : (rank + 1) * local]), y[rank * local : (rank + 1) * local]
        ).backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_both(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    model = convert_sync_batchnorm(_net())
    assert sum(isinstance(m, SyncBatchNorm) for m in model.modules()) == 2
    return {"sync": _train(model, rank, world), "plain": _train(_net(), rank, world)}


def test_training_equals_single_process_batchnorm(two_ranks: list[dict[str, Any]]) -> None:
    got = [r["train"] for r in two_ranks]
    want = _train(_net(), 0, 1)
    for state in (g["sync"] for g in got):
        assert state.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(state[k], want[k], rtol=1e-5, atol=1e-5, msg=k)
    # Plain BatchNorm on the local halves drifts away: the comparison above can fail.
    plain = got[0]["plain"]
    assert not torch.allclose(plain["0.1.running_mean"], want["0.1.running_mean"], atol=1e-3)
    assert not torch.allclose(plain["4.weight"], want["4.weight"], atol=1e-3)


def _buffers_vs_ddp(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """Plain BatchNorm, each rank on its half: longboat with and without broadcast_buffers,
    and DDP with its default broadcast_buffers=True, on the same shards."""
    import longboat as lb

    local = BATCH // world

    def run(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        for step in range(STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            out = model(x[rank * local : (rank + 1) * local])
            F.cross_entropy(out, y[rank * local : (rank + 1) * local]).backward()
            opt.step()
        inner = model.module
        return {k: v.detach().clone() for k, v in inner.state_dict().items()}

    out = {}
    for name, fields in (("longboat", {"broadcast_buffers": True}), ("longboat_local", {})):
        net = _net()
        model, opt = lb.distribute(
            net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), lb.Strategy(**fields)
        )
        out[name] = run(model, opt)
    net = _net()
    ddp = nn.parallel.DistributedDataParallel(net)
    out["ddp"] = run(ddp, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    return out


def test_broadcast_buffers_matches_ddp(two_ranks: list[dict[str, Any]]) -> None:
    """Strategy(broadcast_buffers=True): parameters and BatchNorm statistics on every rank as
    under DDP's default; without it rank 1 keeps statistics of its own data."""
    for rank, result in enumerate(r["buffers"] for r in two_ranks):
        got, want = result["longboat"], result["ddp"]
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{rank} {k}")
        if rank == 1:
            local = result["longboat_local"]["0.1.running_mean"]
            assert not torch.allclose(local, want["0.1.running_mean"], atol=1e-4)


# --- single process --------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, eps=1e-3, momentum=None))
        self.bn3 = nn.BatchNorm3d(4, affine=False)
        self.sync = nn.SyncBatchNorm(4, track_running_stats=False)


def test_convert_replaces_nested_batchnorms_and_keeps_values() -> None:
    model = nn.Sequential(_Block(), nn.BatchNorm2d(4))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-1, 1)
            if getattr(m, "running_mean", None) is not None:
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.num_batches_tracked.fill_(5)
    model[1].bias.requires_grad_(False)
    model[0].inner[1].eval()
    before = copy.deepcopy(model)
    linear = model[0].inner[0]

    out = convert_sync_batchnorm(model, process_group=None)
    assert out is model and out[0].inner[0] is linear
    pairs = [
        (out[0].inner[1], before[0].inner[1]),
        (out[0].bn3, before[0].bn3),
        (out[0].sync, before[0].sync),
        (out[1], before[1]),
    ]
    for new, old in pairs:
        assert type(new) is SyncBatchNorm and new.process_group is None
        for attr in (
            "num_features",
            "eps",
            "momentum",
            "affine",
            "track_running_stats",
            "training",
        ):
            assert getattr(new, attr) == getattr(old, attr), attr
        for (kn, vn), (ko, vo) in zip(
            new.state_dict().items(), old.state_dict().items(), strict=True
        ):
            assert kn == ko and torch.equal(vn, vo)
        assert [p.requires_grad for p in new.parameters()] == [
            p.requires_grad for p in old.parameters()
        ]
    assert not out[1].bias.requires_grad
    assert out[0].inner[1].training is False

    root = nn.BatchNorm2d(4).eval()
    converted = convert_sync_batchnorm(root)
    assert isinstance(converted, SyncBatchNorm) and converted.weight is root.weight
    x = torch.randn(2, 4, 3, 3)
    assert torch.equal(converted(x), root(x))
    assert convert_sync_batchnorm(converted) is converted


@pytest.mark.parametrize("momentum", [0.1, None])
def test_without_process_group_it_is_batchnorm(momentum: float | None) -> None:
    assert not dist.is_initialized()
    sync, plain = SyncBatchNorm(C, momentum=momentum), nn.BatchNorm2d(C, momentum=momentum)
    _affine(sync)
    _affine(plain)
    for step in range(3):
        x, dy = _data([4], (5, 5), step)
        xs, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        ys, yp = sync(xs), plain(xp)
        ys.backward(dy)
        yp.backward(dy)
        assert torch.equal(ys, yp) and torch.equal(xs.grad, xp.grad)
    assert torch.equal(sync.running_var, plain.running_var)
    assert torch.equal(sync.weight.grad, plain.weight.grad)


def test_function_gradcheck_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync path's analytic gradients, with a one-rank (identity) allreduce."""
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)
    x = torch.randn(5, C, 2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, dtype=torch.float64, requires_grad=True)
    b = torch.randn(C, dtype=torch.float64, requires_grad=True)

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _SyncBatchNormFn.apply(x, w, b, None, None, 1e-5, 0.1, None)

    assert torch.autograd.gradcheck(fn, (x, w, b))
    assert torch.autograd.gradcheck(lambda x: fn(x, None, None), (x,))


def test_errors_name_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    bn = SyncBatchNorm(C)
    with pytest.raises(ValueError, match="num_features=3"):
        bn(torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"\(N, C\)"):
        bn(torch.randn(3))
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        _SyncBatchNormFn.apply(torch.randn(1, C), None, None, None, None, 1e-5, 0.1, None)


def _one_rank_sync(monkeypatch: pytest.MonkeyPatch, bn: SyncBatchNorm) -> None:
    """Force the synchronised path in one process: a 2-rank group whose allreduce is identity."""
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)
    monkeypatch.setattr(bn, "_group_size", lambda: 2)


def test_float64_accumulation_keeps_float32_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Channel means of 1e3 with unit spread: naive float32 E[x^2] - E[x]^2 loses the variance."""
    bn = SyncBatchNorm(C, momentum=1.0)
    _one_rank_sync(monkeypatch, bn)
    x = torch.randn(64, C, 8, 8, generator=torch.Generator().manual_seed(0)) + 1000.0
    y = bn(x)
    x64 = x.double()
    var = x64.var(dim=(0, 2, 3), unbiased=False)
    want = (x64 - x64.mean(dim=(0, 2, 3)).view(1, C, 1, 1)) / (var + bn.eps).sqrt().view(1, C, 1, 1)
    torch.testing.assert_close(bn.running_var.double(), x64.var(dim=(0, 2, 3)), rtol=1e-6, atol=0)
    torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-4)
    naive = (x * x).mean(dim=(0, 2, 3)) - x.mean(dim=(0, 2, 3)) ** 2
    assert not torch.allclose(naive.double(), var, rtol=1e-2)  # what float32 sums would give


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_sync_path_matches_batchnorm(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    sync, plain = SyncBatchNorm(C).cuda(), nn.BatchNorm2d(C).cuda()
    _one_rank_sync(monkeypatch, sync)
    x, dy = (t.cuda() for t in _data([8], (5, 5), 0))
    xs = x.to(dtype).requires_grad_()
    xp = x.to(dtype).float().requires_grad_()
    ys, yp = sync(xs), plain(xp)
    ys.backward(dy.to(dtype))
    yp.backward(dy.to(dtype).float())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    assert ys.dtype == xs.grad.dtype == dtype
    torch.testing.assert_close(ys.float(), yp, **tol)
    torch.testing.assert_close(xs.grad.float(), xp.grad, **tol)
    torch.testing.assert_close(sync.running_var, plain.running_var, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sync.weight.grad, plain.weight.grad, rtol=1e-4, atol=1e-3)
