"""hvd.DistributedOptimizer and the broadcast/gather helpers on 2 real Gloo ranks.

Training results are compared with single-process training on the global batch
(``tests.collective._workloads.reference``); one spawn runs every scenario.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from torch.nn import functional as F

from tests._dist import run_ranks
from tests.collective._workloads import (
    STEPS,
    Config,
    build_model,
    build_optimizer,
    data,
    params_of,
    reference,
    shard,
)

WORLD = 2
SGD = Config(optimizer="sgd")
SCENARIOS = {  # name -> (config, DistributedOptimizer keyword arguments)
    "k2": (replace(SGD, k_steps=2), {"backward_passes_per_step": 2}),
    "fp16": (SGD, {"compression": "fp16"}),
    "groups3": (SGD, {"groups": 3}),
    "unfused": (SGD, {}),  # HOROVOD_FUSION_THRESHOLD=0 for this one
}


class Opaque:
    """Not in the safe object format."""


def _train(rank: int, world: int, cfg: Config, kwargs: dict) -> tuple[dict, object]:
    import longboat.horovod.torch as hvd

    if kwargs.get("compression") == "fp16":
        kwargs = {**kwargs, "compression": hvd.Compression.fp16}
    model = build_model(cfg, seed=rank)  # different per rank: broadcast_parameters fixes it
    opt = hvd.DistributedOptimizer(
        build_optimizer(cfg, model), named_parameters=model.named_parameters(), **kwargs
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    x, y = data(cfg)
    k = kwargs.get("backward_passes_per_step", 1)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(k):
            i = step * k + micro
            out = model(shard(x[i], rank, world), rank=rank)
            (F.cross_entropy(out, shard(y[i], rank, world)) / k).backward()
        opt.step()
    return params_of(model), opt


def _small() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _errors(rank: int, out: dict) -> None:
    import longboat.horovod.torch as hvd

    model = _small()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="Found duplicates: 0.weight"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named + named[:1]
        )
    with pytest.raises(ValueError, match="were not named"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named[:1]
        )
    with pytest.raises(ValueError, match="op != Average"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum, gradient_predivide_factor=2
        )
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    x = torch.ones(2, 4)
    # synchronize() by hand, then step() inside skip_synchronize(): no second reduction
    model(x).sum().backward()
    opt.synchronize()
    out["manual_sync_grads"] = [p.grad.clone() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    model(x * (rank + 1)).sum().backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()
    opt.zero_grad()
    model(x).sum().backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    with pytest.raises(AssertionError, match="more than backward_passes_per_step"):
        model(x).sum().backward()
    opt.synchronize()
    # ranks that built different models are told so, on every rank
    other = torch.nn.Linear(4, 3 + rank)
    try:
        hvd.DistributedOptimizer(
            torch.optim.SGD(other.parameters(), lr=0.1), named_parameters=other.named_parameters()
        )
    except ValueError as e:
        out["model_mismatch"] = str(e)


def _flush(rank: int, out: dict) -> None:
    """Reducer.flush() through the facade (synchronize() after 1 of 3 passes) and directly
    on a reducer from the public build_reducer."""
    import longboat.horovod.torch as hvd
    from longboat.collective.engine import build_reducer
    from longboat.collective.live import live_placement
    from longboat.collective.plan import resolve
    from longboat.strategy import Strategy

    x = torch.ones(2, 4) * (rank + 1)
    model = _small()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=3,
    )
    model(x).sum().backward()
    opt.synchronize()  # fewer than 3 passes: reduces what accumulated
    out["partial_sync_grads"] = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()

    model = _small()
    plan = resolve(Strategy(), live_placement())
    reducer, _ = build_reducer(list(model.named_parameters()), plan, None)
    try:
        reducer.flush()
    except RuntimeError as e:
        out["flush_unprepared"] = str(e)
    reducer.prepare(sync=False, divisor=WORLD)
    model(x).sum().backward()  # accumulates locally: nothing is communicated
    out["local_grads"] = [p.grad.clone() for p in model.parameters()]
    reducer.prepare(sync=True, divisor=WORLD)
    reducer.flush()
    out["flushed_grads"] = [p.grad.clone() for p in model.parameters()]
    reducer.remove_hooks()


def _objects(rank: int, out: dict) -> None:
    import longboat.horovod.torch as hvd

    out["bobj"] = hvd.broadcast_object({"epoch": 3 + rank, "t": torch.ones(2) * rank}, 1)
    out["gobj"] = hvd.allgather_object({"rank": rank, "items": list(range(rank + 1))})
    try:
        hvd.broadcast_object(Opaque() if rank == 0 else None, 0, name="opaque")
    except ValueError as e:
        out["refused_bcast"] = str(e)
    try:
        hvd.allgather_object(Opaque() if rank == 1 else 1, name="opaque_gather")
    except ValueError as e:
        out["refused_gather"] = str(e)
    # optimizer state: rank 0 has trained a step with lr 0.01, rank 1 is fresh with lr 0.5
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 if rank == 0 else 0.5)
    if rank == 0:
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["adam_state"] = {
        f"{i}.{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items()
    }
    out["adam_lr"] = opt.param_groups[0]["lr"]
    out["params_untouched"] = all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )


EMB_ROWS, EMB_DIM, EMB_STEPS, EMB_BATCH = 10, 3, 3, 8


def _emb_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Per step: a global batch of row indices (with repeats) and per-element weights."""
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, EMB_ROWS, (EMB_STEPS, EMB_BATCH), generator=g)
    coef = torch.randn(EMB_STEPS, EMB_BATCH, EMB_DIM, generator=g)
    return idx, coef


def _emb_model() -> torch.nn.Embedding:
    torch.manual_seed(3)
    return torch.nn.Embedding(EMB_ROWS, EMB_DIM, sparse=True)


def _emb_loss(emb: torch.nn.Embedding, idx: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    return (emb(idx) * coef).mean()


def _sparse_adam(rank: int, world: int, passes: int) -> dict:
    """nn.Embedding(sparse=True) + SparseAdam with sparse_as_dense=True; ``passes`` backward
    passes per step, each on an equal share of the rank's half of the global batch."""
    import longboat.horovod.torch as hvd

    emb = _emb_model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
        named_parameters=emb.named_parameters(),
        sparse_as_dense=True,
        backward_passes_per_step=passes,
    )
    idx, coef = _emb_data()
    grads_sparse = []
    for step in range(EMB_STEPS):
        opt.zero_grad()
        mine = shard(idx[step], rank, world), shard(coef[step], rank, world)
        for m in range(passes):
            part = [t.chunk(passes)[m] for t in mine]
            (_emb_loss(emb, *part) / passes).backward()
        opt.synchronize()
        grads_sparse.append(emb.weight.grad.is_sparse)
        with opt.skip_synchronize():
            opt.step()
    return {"weight": emb.weight.detach().clone(), "grads_sparse": grads_sparse}


def _parameter_names(rank: int, out: dict) -> None:
    """Horovod's ``_parameter_names``, generated and given, on a two-group optimizer."""
    import longboat.horovod.torch as hvd

    model = _small()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    out["names_generated"] = {tuple(p.shape): n for p, n in opt._parameter_names.items()}
    out["names_all"] = hvd.allgather_object(sorted(opt._parameter_names.values()))
    model = _small()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    out["names_given"] = {
        n: any(p is q for q in model.parameters()) for p, n in opt._parameter_names.items()
    }


class _Lookup(torch.nn.Module):
    """A table read at frozen integer positions (a parameter without gradient)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        where = torch.tensor([1, 3], dtype=torch.int32)
        self.where = torch.nn.Parameter(where, requires_grad=False)
        self.table = torch.nn.Parameter(torch.arange(4.0) * (rank + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[self.where.long()] * x


def _frozen(rank: int, out: dict) -> None:
    """named_parameters and the optimizer hold a frozen parameter too, as Horovod allows: it
    is neither refused as foreign nor reduced; the state broadcasts leave it without
    gradient, the trainable one with the same zero gradient on every rank."""
    import longboat.horovod.torch as hvd

    model = _Lookup(rank)
    sgd = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-6
    )
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    out["frozen_broadcast"] = (
        opt.param_groups[0]["params"][0].grad is None,
        bool(torch.equal(hvd.broadcast(grad, root_rank=0), grad)),
    )
    opt.zero_grad()
    model(torch.full((2,), float(rank + 1))).sum().backward()  # ranks' gradients differ
    opt.step()
    out["frozen_after"] = (model.where.detach().clone(), model.table.detach().clone())


def _guarded(out: dict, key: str, fn, *args) -> None:
    """Run one scenario; record its error instead of failing every test of the module."""
    try:
        result = fn(*args)
    except Exception as e:  # noqa: BLE001 - reported by the test that reads it
        out[f"{key}.error"] = f"{type(e).__name__}: {e}"
    else:
        if result is not None:
            out[key] = result


def _all(rank: int, world: int) -> dict:
    import os

    import longboat.horovod.torch as hvd

    hvd.init()
    out: dict = {}
    for name, (cfg, kwargs) in SCENARIOS.items():
        if name == "unfused":
            os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
        params, opt = _train(rank, world, cfg, kwargs)
        os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)
        out[name] = params
        reducer = opt._hvd_reducer
        out[f"{name}.buckets"] = reducer.num_buckets
        out[f"{name}.compressed"] = opt._hvd_compressors[0].stats.compressed_calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no stray warnings in the plain flow
        _errors(rank, out)
        _flush(rank, out)
    _objects(rank, out)
    for passes in (1, 2):
        _guarded(out, f"sparse_adam{passes}", _sparse_adam, rank, world, passes)
    _guarded(out, "names", _parameter_names, rank, out)
    _guarded(out, "frozen", _frozen, rank, out)
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_all, WORLD, timeout=170)


@pytest.mark.parametrize("name", ["k2", "groups3", "unfused"])
def test_training_equals_single_process(ranks, name):
    cfg, _ = SCENARIOS[name]
    expected = reference(cfg, WORLD)
    init = params_of(build_model(cfg, seed=0))
    assert any(not torch.allclose(init[n], expected[n]) for n in init)  # it really trained
    for out in ranks:
        for key in expected:
            torch.testing.assert_close(out[name][key], expected[key], rtol=1e-5, atol=1e-6)


def test_groups_and_fusion_shape_the_buckets(ranks):
    n_params = len(params_of(build_model(SGD, seed=0)))
    for out in ranks:
        assert out["groups3.buckets"] == 3
        assert out["unfused.buckets"] == n_params
        assert out["k2.buckets"] < n_params  # fused by the core planner


def test_fp16_compression_is_used_and_stays_close(ranks):
    expected = reference(SGD, WORLD)
    for out in ranks:
        assert out["fp16.compressed"] > 0 and out["k2.compressed"] == 0
        for key in expected:
            torch.testing.assert_close(out["fp16"][key], expected[key], rtol=0, atol=2e-3)


def test_horovod_errors_and_manual_synchronize(ranks):
    for out in ranks:
        assert "Mismatched DistributedOptimizer parameters" in out["model_mismatch"]
        assert "rank 1" in out["model_mismatch"]
    model = _small()
    model(torch.ones(2, 4)).sum().backward()
    single = [p.grad for p in model.parameters()]
    for out in ranks:
        for got, ref in zip(out["manual_sync_grads"], single, strict=True):
            torch.testing.assert_close(got, ref)


def test_flush_reduces_outside_backward(ranks):
    singles = []
    for r in range(WORLD):
        model = _small()
        model(torch.ones(2, 4) * (r + 1)).sum().backward()
        singles.append([p.grad for p in model.parameters()])
    average = [sum(gs) / WORLD for gs in zip(*singles, strict=True)]
    for rank, out in enumerate(ranks):
        assert "prepare(sync=True" in out["flush_unprepared"]
        for got, own in zip(out["local_grads"], singles[rank], strict=True):
            torch.testing.assert_close(got, own)  # sync=False: still this rank's own
        for key in ("partial_sync_grads", "flushed_grads"):
            for got, ref in zip(out[key], average, strict=True):
                torch.testing.assert_close(got, ref)


def test_broadcast_and_allgather_objects(ranks):
    for out in ranks:
        assert out["bobj"]["epoch"] == 4
        torch.testing.assert_close(out["bobj"]["t"], torch.ones(2))
        assert out["gobj"] == [{"rank": 0, "items": [0]}, {"rank": 1, "items": [0, 1]}]
        assert "safe object format" in out["refused_bcast"] or "rank 0" in out["refused_bcast"]
        assert "Opaque" in ranks[0]["refused_bcast"]
        assert "[1]" in ranks[0]["refused_gather"] and "Opaque" in ranks[1]["refused_gather"]


def test_broadcast_optimizer_state(ranks):
    root, other = ranks
    assert root["adam_state"].keys() == other["adam_state"].keys() and root["adam_state"]
    for key, value in root["adam_state"].items():
        torch.testing.assert_close(other["adam_state"][key], value)
    assert other["adam_lr"] == 0.01
    assert root["params_untouched"] and other["params_untouched"]


def _sparse_adam_reference() -> torch.Tensor:
    """Single-process SparseAdam on each step's global batch."""
    emb = _emb_model()
    opt = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1)
    idx, coef = _emb_data()
    for step in range(EMB_STEPS):
        opt.zero_grad()
        _emb_loss(emb, idx[step], coef[step]).backward()
        opt.step()
    return emb.weight.detach()


@pytest.mark.parametrize("passes", [1, 2])
def test_sparse_as_dense_gives_sparse_adam_sparse_gradients(ranks, passes):
    """sparse_as_dense reduces densely, then hands SparseAdam a sparse gradient again."""
    expected = _sparse_adam_reference()
    assert not torch.allclose(expected, _emb_model().weight.detach())  # it really trained
    for out in ranks:
        assert f"sparse_adam{passes}.error" not in out, out[f"sparse_adam{passes}.error"]
        got = out[f"sparse_adam{passes}"]
        assert got["grads_sparse"] == [True] * EMB_STEPS
        torch.testing.assert_close(got["weight"], expected, rtol=1e-5, atol=1e-6)


def test_parameter_names_as_horovod(ranks):
    for out in ranks:
        assert "names.error" not in out, out["names.error"]
        assert out["names_generated"] == {
            (3, 4): "allreduce.noname.0.0",
            (3,): "allreduce.noname.0.1",
            (2, 3): "allreduce.noname.1.0",
            (2,): "allreduce.noname.1.1",
        }
        assert out["names_all"][0] == out["names_all"][1]
        assert out["names_given"] == {
            "0.weight": True,
            "0.bias": True,
            "2.weight": True,
            "2.bias": True,
        }


def test_a_frozen_named_parameter_is_not_foreign_nor_reduced(ranks):
    for out in ranks:
        assert "frozen.error" not in out, out["frozen.error"]
        assert out["frozen_broadcast"] == (True, True)
        where, table = out["frozen_after"]
        assert where.tolist() == [1, 3]
        moved = (table - torch.arange(4.0)).abs()  # from rank 0's table, broadcast
        assert moved[[1, 3]].min() > 1e-2 and moved[[0, 2]].max() < 1e-5  # the entries read
    torch.testing.assert_close(ranks[0]["frozen_after"][1], ranks[1]["frozen_after"][1])
