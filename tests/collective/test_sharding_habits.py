"""Sharding read the way DDP users read a model between steps: an EMA of
``AveragedModel(model.module)``, weight norms and ``parameters_to_vector`` over
``model.module.parameters()`` after every step. At stage 1 and 2 with the defaults (and through
the module object and the optimizer's param groups too), and with ``comm_overlap`` on through
``model.module``, every read equals one process on the global batch; the bucket line names the
reduce-scatter at stage 2. One spawn."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parameters_to_vector
from torch.optim.swa_utils import AveragedModel

from tests._dist import run_ranks

WORLD, STEPS, BATCH = 2, 4, 8
RUNS = {
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage1-overlap": {"stage": 1, "comm_overlap": True},
    "stage2-overlap": {"stage": 2, "comm_overlap": True},
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3)
    ).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, BATCH, 6, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (STEPS, BATCH), generator=g)


def _reads(module: nn.Module, ema: AveragedModel) -> dict[str, torch.Tensor]:
    """What a DDP user reads after a step: the EMA updated from ``module``, weight norms, the
    flat vector."""
    ema.update_parameters(module)
    return {
        "ema": parameters_to_vector(ema.module.parameters()).detach().clone(),
        "norms": torch.stack([p.detach().norm() for p in module.parameters()]),
        "vector": parameters_to_vector(module.parameters()).detach().clone(),
    }


def reference() -> list[dict[str, torch.Tensor]]:
    """One process on the global batch, read the same way after every step."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ema = AveragedModel(model)
    x, y = _data()
    out = []
    for i in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(x[i]), y[i]).backward()
        optimizer.step()
        out.append(_reads(model, ema))
    return out


@contextlib.contextmanager
def _logged(name: str) -> Iterator[list[str]]:
    """The messages logger ``name`` emits inside the block."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(name).addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger(name).removeHandler(handler)


def _train(rank: int, configs: dict[str, Any]) -> dict[str, Any]:
    import longboat as lb

    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    strategy = lb.Strategy(fuse_grad_size_in_MB=0.001)  # several buckets, parameters cut
    strategy.sharding, strategy.sharding_configs = True, configs
    with _logged("longboat.collective") as lines:
        dmodel, dopt = lb.distribute(model, optimizer, strategy)
    ema = AveragedModel(dmodel.module)
    x, y = _data()
    half = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    out: dict[str, list] = {"module": [], "own object": [], "param groups": [], "log": lines}
    for i in range(STEPS):
        dopt.zero_grad()
        F.cross_entropy(dmodel(x[i][half]), y[i][half]).backward()
        dopt.step()
        if not configs.get("comm_overlap"):  # whole however they are reached
            out["own object"].append(parameters_to_vector(model.parameters()).clone())
            grouped = [p for g in dopt.param_groups for p in g["params"]]
            out["param groups"].append(parameters_to_vector(grouped).clone())
        out["module"].append(_reads(dmodel.module, ema))
    return out


def _all(rank: int, world: int) -> dict[str, Any]:
    import longboat as lb

    lb.init()
    return {name: _train(rank, configs) for name, configs in RUNS.items()}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(_all, WORLD, timeout=300)


@pytest.mark.parametrize("run", list(RUNS))
def test_reads_through_model_module_after_every_step_equal_one_process(runs, run):
    expected = reference()
    for rank, r in enumerate(runs):
        for step, (got, want) in enumerate(zip(r[run]["module"], expected, strict=True)):
            for what, value in want.items():
                assert not got[what].isnan().any(), f"rank {rank}, {run}, step {step}: {what}"
                torch.testing.assert_close(
                    got[what],
                    value,
                    rtol=1e-7,
                    atol=1e-9,
                    msg=lambda m, w=what, s=step, k=rank: f"rank {k}, {run}, step {s}: {w}: {m}",
                )


@pytest.mark.parametrize("run", ["stage1", "stage2"])
def test_at_the_defaults_the_module_object_and_param_groups_are_whole_after_the_step(runs, run):
    expected = [e["vector"] for e in reference()]
    for r in runs:
        for key in ("own object", "param groups"):
            for got, want in zip(r[run][key], expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize(
    ("run", "collective"), [("stage1", "allreduce"), ("stage2", "reduce-scatter")]
)
def test_the_bucket_line_names_the_collective_and_the_cap_as_written(runs, run, collective):
    """Stage 2 reduce-scatters its buckets, and the cap reads as the Strategy gave it."""
    (line,) = [m for m in runs[0][run]["log"] if "gradient tensors" in m]
    assert f" {collective} bucket" in line and "(0.001 MB cap, " in line, line
