"""The default allreduce choice ('topology'): the rule, the user's settings winning, and exact
training under it on one emulated node and on two."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from longboat.cluster.topology import comm_defaults
from longboat.strategy import Strategy, selection
from tests._dist import join_as_emulated_nodes, run_ranks
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

# ---- the rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("node_of", "backend", "spans_world", "expected"),
    [
        ((0,), "gloo", True, ("native", 32.0, 1)),
        ((0,), "nccl", True, ("native", 32.0, 1)),
        ((0, 0), "gloo", True, ("shm", 32.0, 1)),
        ((0, 0, 0, 0), "gloo", False, ("shm", 32.0, 1)),
        ((0, 0), "nccl", True, ("native", 32.0, 1)),
        ((0, 1), "gloo", True, ("native", 2.0, 2)),
        ((0, 1, 2, 3), "gloo", True, ("native", 2.0, 2)),
        ((0, 0, 1, 1), "gloo", True, ("hierarchical", 2.0, 2)),
        ((0, 1, 0, 1), "gloo", True, ("hierarchical", 2.0, 2)),
        ((0, 0, 1, 1), "gloo", False, ("native", 2.0, 2)),  # sub-groups need the world
        ((0, 0, 0, 1), "gloo", True, ("native", 2.0, 2)),  # unequal nodes
        ((0, 0, 1, 1), "nccl", True, ("native", 32.0, 1)),
        ((0, 1), "nccl", True, ("native", 32.0, 1)),
    ],
)
def test_rule(
    node_of: tuple[int, ...], backend: str, spans_world: bool, expected: tuple[str, float, int]
) -> None:
    found = comm_defaults(node_of, backend, spans_world)
    assert (found.algorithm, found.fuse_grad_size_in_MB, found.nccl_comm_num) == expected
    assert found.describe().startswith(f"{expected[0]} (")


def test_resolution_keeps_the_users_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    # no cluster: nothing to resolve against
    assert selection.selected_algorithm(Strategy(env={})) == "topology"
    assert selection.comm_num(Strategy(env={})) == 1
    monkeypatch.setattr(selection, "topology_defaults", lambda: comm_defaults((0, 1), "gloo"))
    default = Strategy(env={})
    assert selection.selected_algorithm(default) == "native"
    assert (selection.fuse_grad_size_mb(default), selection.comm_num(default)) == (2.0, 2)
    assert selection.describe_algorithm(default) == "native (one rank per node)"
    explicit = Strategy(env={}, allreduce_algorithm="ring", fuse_grad_size_in_MB=32.0)
    assert selection.selected_algorithm(explicit) == "ring"
    assert selection.describe_algorithm(explicit) == "ring (set by the strategy)"
    assert (selection.fuse_grad_size_mb(explicit), selection.comm_num(explicit)) == (32.0, 2)
    env = Strategy(env={"LONGBOAT_NCCL_COMM_NUM": "1"})
    assert selection.comm_num(env) == 1


def test_hierarchical_switch_accepts_the_default() -> None:
    s = Strategy(env={}, use_hierarchical_allreduce=True)
    s.check()
    assert selection.selected_algorithm(s) == "hierarchical"
    with pytest.raises(ValueError, match="use_hierarchical_allreduce"):
        Strategy(env={}, use_hierarchical_allreduce=True, allreduce_algorithm="shm").check()


# ---- training under the default ------------------------------------------------------------

CONFIGS = (Config(optimizer="sgd"), Config(optimizer="adam"))


def _train_default(rank: int, world: int, ranks_per_node: int) -> dict[str, Any]:
    """Emulate nodes of ``ranks_per_node`` consecutive ranks; train each config under
    ``lb.Strategy()``; the parameters and what the defaults resolved to."""
    import longboat as lb
    from longboat import cluster

    join_as_emulated_nodes(rank, ranks_per_node, world)
    out: dict[str, Any] = {"line": cluster.cluster().describe()}
    for cfg in CONFIGS:
        model = build_model(cfg, seed=rank)  # distribute must broadcast rank 0's
        dmodel, dopt = lb.distribute(model, build_optimizer(cfg, model), lb.Strategy())
        x, y = data(cfg)
        for i in range(STEPS):
            dopt.zero_grad()
            loss = F.cross_entropy(
                dmodel(shard(x[i], rank, world), rank=rank), shard(y[i], rank, world)
            )
            loss.backward()
            dopt.step()
        out[cfg.name] = params_of(model)
        out["comms"] = len(dmodel.reducer._fns)
    strategy = lb.Strategy()
    out["chosen"] = [
        selection.selected_algorithm(strategy),
        selection.fuse_grad_size_mb(strategy),
        selection.comm_num(strategy),
    ]
    return out


@pytest.mark.parametrize(
    ("world", "ranks_per_node", "expected"),
    [
        (2, 2, ["shm", 32.0, 1]),
        (4, 2, ["hierarchical", 2.0, 2]),
        (2, 1, ["native", 2.0, 2]),
    ],
    ids=["1node-x2", "2nodes-x2", "2nodes-x1"],
)
def test_default_training_matches_single_process(
    world: int, ranks_per_node: int, expected: list[Any]
) -> None:
    segments = tempfile.mkdtemp(prefix="lb-test-shm-", dir="/dev/shm")
    try:
        results = run_ranks(
            _train_default, world, ranks_per_node, timeout=400, env={"LONGBOAT_SHM_DIR": segments}
        )
        assert os.listdir(segments) == []  # every shm segment was removed
    finally:
        shutil.rmtree(segments, ignore_errors=True)
    for cfg in CONFIGS:
        expected_params = reference(cfg, world)
        for rank, result in enumerate(results):
            for name, value in expected_params.items():
                torch.testing.assert_close(
                    result[cfg.name][name], value, rtol=1e-5, atol=1e-6,
                    msg=lambda m, n=name, r=rank, c=cfg.name: f"{c}: rank {r}: {n}: {m}",
                )  # fmt: skip
    for result in results:
        assert result["chosen"] == expected
        assert result["comms"] == expected[2]
    assert f"allreduce: {expected[0]} (" in results[0]["line"]
