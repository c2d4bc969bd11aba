"""Strategy(auto=True): the candidate set, exact training during the trial, a MAX-based choice."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F

from longboat.collective.autotune import candidates, untunable
from longboat.collective.plan import CommPlan, Placement, resolve, resolve_comm
from longboat.strategy import Strategy
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
    train_global_batch,
)

ONE_NODE = ["native", "shm"]


ONE = Placement.of((0, 0), "gloo")  # 2 Gloo ranks on one node


def _key(c: CommPlan) -> tuple[str, float, int]:
    return (c.algorithm, c.bucket_mb, c.communicators)


def _candidates(
    strategy: Strategy, algorithms: list[str], placement: Placement = ONE
) -> list[CommPlan]:
    return candidates(resolve_comm(strategy, placement), algorithms)


# ---- the candidate set ---------------------------------------------------------------------


def test_candidates_defaults_first_then_the_grid() -> None:
    found = _candidates(Strategy(env={}, auto=True), ONE_NODE)
    assert _key(found[0]) == ("shm", 32.0, 1)  # the topology default, resolved
    assert {_key(c) for c in found} == {
        (a, f, n) for a in ONE_NODE for f in (32.0, 8.0, 2.0) for n in (1, 2)
    }
    assert len(found) == 12


def test_topology_defaults_are_tuned_unless_set() -> None:
    two = Placement.of((0, 1), "gloo")  # two nodes of one rank: native, 2 MB x 2
    found = _candidates(Strategy(env={}, auto=True), ["native"], two)
    assert _key(found[0]) == ("native", 2.0, 2)
    assert {_key(c) for c in found} == {("native", f, n) for f in (2.0, 8.0) for n in (1, 2)}
    s = Strategy(env={}, auto=True, fuse_grad_size_in_MB=32, nccl_comm_num=1)
    assert [_key(c) for c in _candidates(s, ["native"], two)] == [("native", 32.0, 1)]


def test_user_set_fields_stay_fixed() -> None:
    s = Strategy(env={}, auto=True, nccl_comm_num=3, fuse_grad_size_in_MB=16)
    found = _candidates(s, ONE_NODE)
    assert [_key(c) for c in found] == [("shm", 16.0, 3), ("native", 16.0, 3)]
    s = Strategy(env={}, auto=True, allreduce_algorithm="ring")
    assert {c.algorithm for c in _candidates(s, ONE_NODE)} == {"ring"}
    s = Strategy(env={}, auto=True, use_hierarchical_allreduce=True)
    assert {c.algorithm for c in _candidates(s, ["native", "hierarchical"])} == {"hierarchical"}
    # set to its default value explicitly still counts as the user's choice
    s = Strategy(env={}, auto=True, nccl_comm_num=1)
    assert {c.communicators for c in _candidates(s, ONE_NODE)} == {1}
    # an environment override is the user's too
    s = Strategy(env={"LONGBOAT_FUSE_GRAD_SIZE_IN_MB": "4"}, auto=True)
    assert {c.bucket_mb for c in _candidates(s, ONE_NODE)} == {4.0}
    # no fusion: the fusion size means nothing, so it is not tried
    s = Strategy(env={}, auto=True, fuse_all_reduce_ops=False)
    assert {c.bucket_mb for c in _candidates(s, ONE_NODE)} == {32.0}


def test_candidate_changes_only_the_tuned_settings() -> None:
    plan = resolve(Strategy(env={}, auto=True, find_unused_parameters=True), ONE)
    changed = plan.comm.with_settings("native", 2.0, 2)
    assert _key(changed) == ("native", 2.0, 2) and changed.reason == "tried by auto"
    assert changed.serial == plan.comm.serial and changed.fuse == plan.comm.fuse
    assert _key(plan.comm) == ("shm", 32.0, 1)  # the plan itself is frozen


@pytest.mark.parametrize(
    ("fields", "world", "reason"),
    [
        ({}, 1, "one rank"),
        ({"localsgd": True}, 2, "local SGD"),
        ({"dgc": True}, 2, "deep-gradient-compression keeps residuals and momentum"),
        ({"gradient_compression": "powersgd"}, 2, "PowerSGD"),
        ({}, 2, None),
        ({"gradient_merge": True, "fp16_allreduce": True}, 2, None),
    ],
)
def test_untunable(fields: dict[str, Any], world: int, reason: str | None) -> None:
    found = untunable(resolve(Strategy(env={}, auto=True, **fields), ONE), world)
    assert found is None if reason is None else reason in found


# ---- two real ranks ------------------------------------------------------------------------


def _train_auto(rank: int, world: int, cfg: Config, slow: bool) -> dict[str, Any]:
    """``cfg``'s training under auto=True with a 1-step trial per candidate (12 candidates fit
    in the 20 steps); ``slow``: a fake clock makes candidate 1 fast on rank 0, very slow on
    rank 1, and candidate 2 a little fast on both."""
    import longboat as lb
    from longboat.collective import autotune

    autotune.TRIAL_STEPS, autotune.WARMUP_STEPS = 1, 0
    if slow:
        fake = _FakeClock(rank)
        autotune.clock = fake
    model = build_model(cfg, seed=rank)  # different init per rank: distribute must broadcast
    opt = build_optimizer(cfg, model)
    strategy = lb.Strategy(auto=True)
    if cfg.k_steps > 1:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": cfg.k_steps, "avg": True}
    dmodel, dopt = lb.distribute(model, opt, strategy)
    tuner = dmodel.tuner
    assert tuner is not None and len(tuner.candidates) == 12
    assert tuner.candidates[0].algorithm == "shm"  # the topology default on one node
    if slow:
        fake.tuner = tuner
    installed = []  # (active candidate, buckets, communicators) at each communicating step
    planned = []  # the model's plan names the reducer it runs
    x, y = data(cfg)
    for i in range(STEPS * cfg.k_steps):
        dopt.zero_grad(set_to_none=cfg.set_to_none)
        out = dmodel(shard(x[i], rank, world), rank=rank)
        if (i + 1) % cfg.k_steps == 0:  # a communicating step
            reducer = dmodel.reducer
            installed.append((tuner.active, reducer.num_buckets, len(reducer._fns)))
            planned.append(dmodel.plan.comm == tuner.candidates[tuner.active])
        F.cross_entropy(out, shard(y[i], rank, world)).backward()
        dopt.step()
    assert tuner.done
    return {
        "params": params_of(model),
        "choice": [tuner.choice.algorithm, tuner.choice.bucket_mb],
        "comms": tuner.choice.communicators,
        "medians": tuner.medians,
        "installed": installed,
        "planned": planned,
        "bytes": dmodel.bytes_sent(),
    }


class _FakeClock:
    """Step time 1 s; candidate 1: 0.5 s on rank 0, 100 s on rank 1; candidate 2: 0.8 s."""

    def __init__(self, rank: int):
        self.rank, self.now, self.tuner = rank, 0.0, None

    def __call__(self) -> float:
        active = 0 if self.tuner is None else self.tuner.active
        self.now += {1: 0.5 if self.rank == 0 else 100.0, 2: 0.8}.get(active, 1.0)
        return self.now


EXACT = {"sgd": Config(), "merge2-zeroed": Config(k_steps=2, set_to_none=False)}


def _train_every_case(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Every 2-rank case of this file in one spawn, each with its own model and lb.distribute;
    the fake clock's case last (it replaces autotune.clock)."""
    out = {name: _train_auto(rank, world, cfg, False) for name, cfg in EXACT.items()}
    out["slow"] = _train_auto(rank, world, Config(), True)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_train_every_case, 2, timeout=360)


@pytest.mark.parametrize("name", EXACT)
def test_training_during_and_after_the_trial_is_exact(
    runs: list[dict[str, dict[str, Any]]], name: str
) -> None:
    cfg = EXACT[name]
    results = [r[name] for r in runs]
    if cfg.k_steps == 1:
        model = build_model(cfg, seed=0)
        expected = train_global_batch(model, build_optimizer(cfg, model), cfg, 2)
    else:
        expected = reference(cfg, 2)
    init = params_of(build_model(cfg, seed=0))
    assert any(not torch.allclose(init[n], expected[n]) for n in init)  # training moved them
    for rank, result in enumerate(results):
        for name in expected:
            torch.testing.assert_close(
                result["params"][name], expected[name], rtol=1e-5, atol=1e-5,
                msg=lambda m, n=name, r=rank: f"rank {r}: {n}: {m}",
            )  # fmt: skip
    first, second = results
    assert first["choice"] == second["choice"] and first["comms"] == second["comms"]
    assert first["medians"] == second["medians"]
    # every candidate really ran: 12 reducers, in order, with different buckets/communicators
    trial = [a for a, _, _ in first["installed"][:12]]
    assert trial == list(range(12))
    assert len({(b, c) for _, b, c in first["installed"]}) > 1
    assert all(first["planned"]) and all(second["planned"])  # model.plan follows the reducer
    assert first["bytes"] > 0


def test_choice_follows_the_slowest_rank(runs: list[dict[str, dict[str, Any]]]) -> None:
    first, second = (r["slow"] for r in runs)
    # rank 0 alone would pick candidate 1 (0.5 s); its MAX over ranks is 100 s: candidate 2 wins
    assert first["medians"] == second["medians"]
    assert first["medians"][1] == pytest.approx(100.0) and first["medians"][2] == pytest.approx(0.8)
    assert first["installed"][12][0] == second["installed"][12][0] == 2
    assert first["choice"] == second["choice"]
