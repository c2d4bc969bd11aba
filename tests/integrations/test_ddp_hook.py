"""lb.ddp_comm_hook: longboat's algorithms and compressors inside torch's DDP.

One 2-rank spawn trains the same model under DDP without a hook and with longboat's hook for
several Strategies; exact algorithms must equal plain DDP (and the single-process run on the
global batch), lossy compressors stay close to it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._dist import run_ranks

STEPS, BATCH = 6, 16
EXACT = {
    "default": {},
    "ring": {"allreduce_algorithm": "ring"},
    "native, no serial": {"allreduce_algorithm": "native", "sync_nccl_allreduce": False},
}
LOSSY = {
    "bf16": {"gradient_compression": "bf16"},
    "powersgd": {
        "gradient_compression": "powersgd",
        "powersgd_configs": {"rank": 2, "start_step": 2, "min_compression_bytes": 0},
    },
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3)
    )


class _Reordered(nn.Module):
    """Layers registered in another order than backward reaches them: DDP's first buckets
    follow registration, and after iteration 1 it rebuilds them in gradient order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.middle, self.first, self.last = nn.Linear(32, 32), nn.Linear(12, 32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.middle(torch.tanh(self.first(x)))))


def _rebuilt(rank: int, world: int) -> dict[str, Any]:
    """PowerSGD through the hook while DDP rebuilds its buckets: what each backward's buckets
    held, the buckets the hook state follows, and the layouts the compressor keeps."""
    import longboat as lb

    ddp = nn.parallel.DistributedDataParallel(_Reordered(), bucket_cap_mb=0.004)
    state, hook = lb.ddp_comm_hook(lb.Strategy(**LOSSY["powersgd"]))
    seen: list[dict[int, list[tuple[int, ...]]]] = []  # per backward: index -> shapes

    def recording(state: Any, bucket: Any) -> Any:
        if bucket.index() == 0:  # DDP reduces its buckets in index order
            seen.append({})
        seen[-1][bucket.index()] = sorted(tuple(g.shape) for g in bucket.gradients())
        return hook(state, bucket)

    recording.__annotations__ = hook.__annotations__  # DDP checks them as objects
    ddp.register_comm_hook(state, recording)
    params = _train(ddp, rank, world)
    kept = state.compressor.state._layouts.values()  # PowerSGD's, by bucket buffer
    return {
        "first": seen[0],
        "last": seen[-1],
        "followed": state.buckets(),
        "compressor": sorted(sorted(tuple(shape) for _, shape in layout) for layout in kept),
        "params": params,
    }


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 12, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _train(model: nn.Module, rank: int, world: int) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per = BATCH // world
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(
            model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]
        ).backward()
        opt.step()
    inner = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def _ranks(rank: int, world: int) -> dict[str, Any]:
    import longboat as lb

    lb.init()
    out: dict[str, Any] = {
        "plain": _train(nn.parallel.DistributedDataParallel(_model()), rank, world)
    }
    for name, fields in {**EXACT, **LOSSY}.items():
        ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)  # several buckets
        state, hook = lb.ddp_comm_hook(lb.Strategy(**fields))
        ddp.register_comm_hook(state, hook)
        out[name] = _train(ddp, rank, world)
        out[f"{name} calls"] = state.compressor.stats.calls  # the hook reduced the buckets
        out[f"{name} algorithm"] = state.plan.comm.algorithm
    out["rebuilt"] = _rebuilt(rank, world)
    with pytest.raises(ValueError, match="dgc cannot run as a DDP communication hook"):
        lb.ddp_comm_hook(lb.Strategy(dgc=True))
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_ranks, 2, timeout=120)


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("name", list(EXACT))
def test_exact_algorithms_equal_plain_ddp_and_one_process(ranks: list[dict[str, Any]], name: str):
    single = _train(_model(), 0, 1)
    assert ranks[0][f"{name} calls"] > STEPS  # every bucket went through it (2 a step after the first)
    assert ranks[0]["default algorithm"] == "shm"  # one CPU node: the topology's choice
    for result in ranks:
        assert _diff(result[name], result["plain"]) < 1e-6, name
        assert _diff(result[name], single) < 1e-5, name


@pytest.mark.parametrize("name", list(LOSSY))
def test_compressors_stay_close_and_ranks_agree(ranks: list[dict[str, Any]], name: str):
    assert _diff(ranks[0][name], ranks[1][name]) == 0.0  # every rank applies the same update
    assert 0.0 < _diff(ranks[0][name], ranks[0]["plain"]) < 5e-2


def test_hook_state_follows_ddp_rebuilding_its_buckets(ranks: list[dict[str, Any]]) -> None:
    """Keyed by bucket.index() and reset when DDP rebuilds: the compressor keeps the layouts
    of the live buckets, one each, none of the buckets DDP dropped."""
    for result in ranks:
        got = result["rebuilt"]
        assert got["first"] != got["last"], got  # DDP did rebuild its buckets
        assert got["followed"] == sorted(got["last"])
        assert got["compressor"] == sorted(got["last"].values())
    assert _diff(ranks[0]["rebuilt"]["params"], ranks[1]["rebuilt"]["params"]) == 0.0
    single = _train(_Reordered(), 0, 1)
    assert 0.0 < _diff(ranks[0]["rebuilt"]["params"], single) < 5e-2
