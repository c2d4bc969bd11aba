"""DGC compressor on 2 real Gloo ranks, against references computed from every rank's inputs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from longboat.comm.algorithms import make
from longboat.comm.compress import make_compressor, ring_bytes
from longboat.comm.compress.dgc import kept, sparsity_at
from longboat.registry import COMPRESSORS
from tests._dist import run_ranks

WORLD = 2
SHAPE = (128, 160)  # 20480 entries: above the default min_numel
BIAS = 128


def _inputs(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(SHAPE[0] * SHAPE[1] + BIAS, generator=g) / WORLD


def _rank(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    assert group is not None
    inner = make("native", group)
    out: dict[str, Any] = {}
    layout = [(0, torch.Size(SHAPE)), (SHAPE[0] * SHAPE[1], torch.Size([BIAS]))]
    # momentum 0: sent + what every rank still holds = everything the ranks put in
    comp = make_compressor("dgc", inner, group, {"sparsity": [0.99], "momentum": 0.0})
    buf = torch.zeros(SHAPE[0] * SHAPE[1] + BIAS)
    comp.set_layout(buf, layout)
    sent = torch.zeros_like(buf, dtype=torch.float64)
    truth = torch.zeros_like(sent)
    for step in range(6):
        buf.copy_(_inputs(step, rank))
        comp(buf).wait()
        sent += buf
        truth += sum(_inputs(step, r) for r in range(world))
        if step == 0:  # first step: each rank's top-k of its own input, summed
            expected = torch.zeros_like(buf)
            n = SHAPE[0] * SHAPE[1]
            for r in range(world):
                x = _inputs(0, r)[:n]
                top = torch.topk(x.abs(), kept(n, 0.99)).indices
                expected[top] += x[top]
            expected[n:] = sum(_inputs(0, r)[n:] for r in range(world))
            out["first_step_err"] = float((buf - expected).abs().max())
            out["first_bytes"] = comp.stats.last_bytes_sent
    residual = comp.residual(buf)
    dist.all_reduce(residual)
    out["identity_err"] = float((sent + residual - truth).abs().max())
    out["result"] = buf.clone()
    comp.close()

    # warm-up: rampup_begin_step plain allreduces first, exact
    comp = make_compressor("dgc", inner, group, {"rampup_begin_step": 2, "momentum": 0.9})
    comp.set_layout(buf, layout)
    exact = []
    for step in range(2):
        buf.copy_(_inputs(step, rank))
        comp(buf).wait()
        exact.append(torch.equal(buf, _inputs(step, 0) + _inputs(step, 1)))
    out["warmup_exact"] = exact
    out["warmup_active"] = comp.state.sparse_active
    buf.copy_(_inputs(2, rank))
    comp(buf).wait()
    out["after_active"] = comp.state.sparse_active
    out["sparse_bytes"] = comp.stats.last_bytes_sent
    # flags-style exact allreduce on the same worker, untouched by compression
    flags = torch.ones(7)
    comp.exact(flags).wait()
    out["exact_flags"] = flags.tolist()
    comp.close()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_rank, WORLD, timeout=120)


def test_first_step_sums_each_ranks_top_k(ranks: list[dict[str, Any]]):
    for out in ranks:
        assert out["first_step_err"] < 1e-6
    assert torch.equal(ranks[0]["result"], ranks[1]["result"])


def test_error_feedback_loses_nothing(ranks: list[dict[str, Any]]):
    for out in ranks:
        assert out["identity_err"] < 1e-4


def test_warmup_is_plain_allreduce_then_sparse(ranks: list[dict[str, Any]]):
    for out in ranks:
        assert out["warmup_exact"] == [True, True]
        assert out["warmup_active"] is False
        assert out["after_active"] is True
        assert out["exact_flags"] == [2.0] * 7


def test_bytes_at_sparsity_0999_below_one_percent(ranks: list[dict[str, Any]]):
    n = SHAPE[0] * SHAPE[1]
    dense = ring_bytes((n + BIAS) * 4, WORLD)
    pairs = (WORLD - 1) * 2 * kept(n, 0.999) * 4
    for out in ranks:
        assert out["sparse_bytes"] == pairs + ring_bytes(BIAS * 4, WORLD)
        assert out["sparse_bytes"] < 0.01 * dense


def test_sparsity_schedule_follows_fleet():
    cfg = {"rampup_begin_step": 5, "rampup_step": 4, "sparsity": [0.75, 0.9, 0.99, 0.999]}
    got = [sparsity_at(s, cfg) for s in range(12)]
    assert got == [None] * 5 + [0.75, 0.9, 0.99] + [0.999] * 4


def test_bad_config_is_named():
    group = object()
    with pytest.raises(ValueError, match="sparsity"):
        make_compressor("dgc", lambda t: None, group, {"sparsity": [1.5]})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown config key"):
        make_compressor("dgc", lambda t: None, group, {"ratio": 0.1})  # type: ignore[arg-type]


def test_dgc_declares_what_it_needs_from_the_engine():
    entry = COMPRESSORS.entry("dgc")
    assert entry.momentum and not entry.elastic and entry.state == "residuals and momentum"
    assert entry.cost is not None


def test_the_engine_reads_the_declaration_not_the_name():
    """A compressor of another name declaring DGC's traits gets DGC's treatment: the optimizer's
    momentum in its config, no autotuning, no elastic rebuild."""
    from longboat.collective import autotune, engine, rebuild
    from longboat.collective.plan import CompressionPlan

    def factory(inner: Any, group: Any, config: Any) -> Any:
        return make_compressor("none", inner, group)

    with COMPRESSORS.scoped():
        COMPRESSORS.register("toy_momentum", momentum=True, elastic=False, state="its momentum")(
            factory
        )
        plan = SimpleNamespace(compression=CompressionPlan(name="toy_momentum"), local_sgd=None)
        sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
        assert engine._compressor_config(plan, sgd)["momentum"] == 0.9  # type: ignore[arg-type]
        assert autotune.untunable(plan, 2) == (  # type: ignore[arg-type]
            "toy_momentum keeps its momentum in one reducer's compressors"
        )
        with pytest.raises(rebuild.RebuildError, match="toy_momentum keeps its momentum per rank"):
            rebuild.check_rebuildable(SimpleNamespace(plan=plan, tuner=None))  # type: ignore[arg-type]
        plain = SimpleNamespace(compression=CompressionPlan(name="none"), local_sgd=None)
        assert "momentum" not in engine._compressor_config(plain, sgd)  # type: ignore[arg-type]
        assert autotune.untunable(plain, 2) is None  # type: ignore[arg-type]
