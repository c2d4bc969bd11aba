"""Sharded optimizer state across worlds: per-rank checkpoint files saved at 2 ranks load at 1
and at 4 ranks (sharding_degree 2); an elastic job that grows from 2 to 3 ranks, or shrinks
from 4 to 2 with a copy of every shard left, reshards in memory; one that lost a shard goes on
from State's sharded checkpoint, or, without one, stops naming it. Every continued run equals
one process trained on the same global batches without stopping. One spawn of 4 processes,
whose worlds form and dissolve in phases."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests._dist import free_port, run_ranks

K = 3  # steps before the checkpoint and the first membership change
MORE = 2  # steps of each later phase
BATCH = 12  # global batch: divides among 1, 2, 3 and 4 ranks
CAP_MB = 0.004  # several buckets, parameters cut between ranks' slices
PHASES = ("A", "B", "E", "G", "C", "D01", "D12", "F", "H")  # worlds, each on its own port


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 32), nn.LayerNorm(32)
        )
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Net().double()  # Adam divides by sqrt(v): float64 keeps rounding below tolerance


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "lr": 3e-2, "weight_decay": 0}],
        lr=1e-2,
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    steps = K + 2 * MORE
    return torch.randn(steps, BATCH, 8, generator=g).double(), torch.randint(
        0, 4, (steps, BATCH), generator=g
    )


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference() -> list[dict[str, torch.Tensor]]:
    """One process on every global batch: the parameters after 0, 1, ... steps."""
    model = _model(0)
    optimizer = _optimizer(model)
    x, y = _data()
    out = [_params(model)]
    for i in range(len(x)):
        optimizer.zero_grad()
        F.cross_entropy(model(x[i]), y[i]).backward()
        optimizer.step()
        out.append(_params(model))
    return out


# -- the spawned ranks ------------------------------------------------------------------------


def _join(rank: int, world: int, port: int) -> None:
    import longboat as lb

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_PORT=str(port),
    )
    lb.init(backend="gloo")


def _strategy(stage: int, degree: int) -> Any:
    import longboat as lb

    strategy = lb.Strategy(allreduce_algorithm="native", fuse_grad_size_in_MB=CAP_MB)
    strategy.sharding = True
    strategy.sharding_configs = {"stage": stage, "sharding_degree": degree}
    return strategy


def _distributed(seed: int, stage: int, degree: int) -> tuple[Any, Any, nn.Module]:
    import longboat as lb

    model = _model(seed)  # each rank builds its own: lb.distribute broadcasts rank 0's
    dmodel, dopt = lb.distribute(model, _optimizer(model), _strategy(stage, degree))
    return dmodel, dopt, model


def _train(dmodel: Any, dopt: Any, state: Any, steps: range) -> None:
    import longboat as lb

    x, y = _data()
    rank, world = lb.rank(), lb.world_size()
    per = BATCH // world
    for i in steps:
        dopt.zero_grad()
        part = slice(rank * per, (rank + 1) * per)
        F.cross_entropy(dmodel(x[i][part]), y[i][part]).backward()
        dopt.step()
        if state is not None:
            if state.sampler is not None:
                state.sampler.record_batch()
            state.commit()
    dmodel.settle_parameters()  # the last step's gathers, before the parameters are read


def _load_at_one_rank(ckpt: Path, port: int) -> dict[str, Any]:
    """A world of one loads the 2-rank checkpoint and trains on; damaged copies are refused."""
    import longboat as lb
    from longboat.checkpoint import CheckpointError

    deadline = time.monotonic() + 120
    while not (ckpt / "index.json").exists():  # phase A, on ranks 0 and 1, writes it
        assert time.monotonic() < deadline, "no checkpoint from the 2-rank phase"
        time.sleep(0.05)
    _join(0, 1, port)
    dmodel, dopt, model = _distributed(9, stage=1, degree=0)
    saved = lb.load_sharded_checkpoint(ckpt, dopt)
    dmodel.load_state_dict(saved["model"])
    _train(dmodel, dopt, None, range(saved["step"], K + MORE))
    out: dict[str, Any] = {"load1": _params(model)}
    damaged = ckpt.with_name("damaged")
    shutil.copytree(ckpt, damaged)
    next(damaged.glob("optimizer-*-1-of-2.pt")).unlink()
    errors = {}
    try:
        lb.load_sharded_checkpoint(damaged, dopt)
    except CheckpointError as exc:
        errors["missing file"] = str(exc)
    sgd_model = _model(9)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1)
    _, sgd = lb.distribute(sgd_model, sgd, _strategy(1, 0))
    try:
        lb.load_sharded_checkpoint(ckpt, sgd)
    except CheckpointError as exc:
        errors["other class"] = str(exc)
    out["errors"] = errors
    return out


def _phases(rank: int, world: int, ports: dict[str, int], ckpt: str) -> dict[str, Any]:
    """A: 2 ranks save at step K (lb.save_sharded_checkpoint, and State's checkpoint); B: a
    third rank joins; E: 1 rank loads; G: rank 2 leaves with its shard, the others go on from
    State's checkpoint; C: 4 ranks in shard groups of 2 load; D: two pairs of them go on
    alone; F: 1 rank loads State's checkpoint; H: the two pairs' ranks 1 leave with shard 1,
    and ranks 0 and 1, whose States have no checkpoint, stop."""
    import longboat as lb
    from longboat.elastic.reshard import ShardsLostError

    out: dict[str, Any] = {}
    state = None
    # A: 2 ranks, stage 2, train K steps, save the per-rank files
    if rank < 2:
        _join(rank, 2, ports["A"])
        dmodel, dopt, model = _distributed(rank, stage=2, degree=0)
        sampler = lb.elastic.ElasticSampler(1000, BATCH // 2, shuffle=False)
        state = lb.elastic.State(
            model=dmodel,
            optimizer=dopt,
            sampler=sampler,
            checkpoint=f"{ckpt}-state",
            checkpoint_every=K,
        )
        state.sync()
        _train(dmodel, dopt, state, range(K))
        lb.save_sharded_checkpoint(ckpt, dopt, {"model": dmodel.state_dict(), "step": K})
        out["A"] = _params(model)
    # B: a third rank joins; the survivors reshard from memory. E, beside it: 1 rank loads
    if rank < 3:
        if state is not None:
            lb.shutdown()
            _join(rank, 3, ports["B"])
            state.on_reset()  # what lb.elastic.run does after a membership change
        else:
            _join(rank, 3, ports["B"])
            dmodel, dopt, model = _distributed(7, stage=2, degree=0)
            sampler = lb.elastic.ElasticSampler(1000, BATCH // 2, shuffle=False)
            state = lb.elastic.State(model=dmodel, optimizer=dopt, sampler=sampler)
        state.sync()
        _train(dmodel, dopt, state, range(K, K + MORE))
        out["growth"] = _params(model)
        out["growth commits"] = state.commits
    else:
        out |= _load_at_one_rank(Path(ckpt), ports["E"])
    lb.shutdown()
    # G: rank 2 leaves with its shard; the others go on from State's checkpoint (commit K)
    if rank < 2:
        _join(rank, 2, ports["G"])
        state.on_reset()
        warnings = _Warnings()
        logging.getLogger("longboat.elastic").addHandler(warnings)
        try:
            state.sync()
        finally:
            logging.getLogger("longboat.elastic").removeHandler(warnings)
        out["G log"] = warnings.lines
        out["G from"] = state.commits
        out["G sampler steps"] = state.sampler.steps_recorded
        _train(dmodel, dopt, state, range(state.commits, K + MORE))  # no checkpoint written
        out["G"] = _params(model)
        lb.shutdown()
    # C: 4 ranks, 2 shard groups of 2, stage 1, load the checkpoint and train on
    _join(rank, 4, ports["C"])
    dmodel, dopt, model = _distributed(10 + rank, stage=1, degree=2)
    saved = lb.load_sharded_checkpoint(ckpt, dopt)
    dmodel.load_state_dict(saved["model"])
    state = lb.elastic.State(model=dmodel, optimizer=dopt)
    state.sync()
    _train(dmodel, dopt, state, range(saved["step"], K + MORE))
    out["load4"] = _params(model)
    lb.shutdown()
    # D: two ranks leave; each pair left holds both shards (0 and 3: in place; 1 and 2: swapped)
    pair = "D12" if rank in (1, 2) else "D01"
    _join(0 if rank in (0, 1) else 1, 2, ports[pair])
    state.on_reset()
    state.sync()
    _train(dmodel, dopt, state, range(K + MORE, K + 2 * MORE))
    out[pair] = _params(model)
    lb.shutdown()
    if rank < 2:  # H: each pair's rank 0 (old ranks 0 and 1) meet: shard 1 left, no checkpoint
        _join(rank, 2, ports["H"])
        state.on_reset()
        try:
            state.sync()
        except ShardsLostError as exc:
            out["lost"] = str(exc)
        lb.shutdown()
    if rank == 2:
        _join(0, 1, ports["F"])
        dmodel, dopt, model = _distributed(20, stage=2, degree=0)
        state = lb.elastic.State(model=dmodel, optimizer=dopt, checkpoint=f"{ckpt}-state")
        out["state checkpoint loaded"] = state.load_checkpoint()
        _train(dmodel, dopt, state, range(state.commits, K + MORE))
        out["state checkpoint"] = _params(model)
        lb.shutdown()
    return out


class _Warnings(logging.Handler):
    """The lines logged at WARNING and above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    ckpt = tmp_path_factory.mktemp("sharded") / "ckpt"
    ports = {phase: free_port() for phase in PHASES}
    return run_ranks(_phases, 4, ports, str(ckpt), timeout=240), ckpt


@pytest.fixture(scope="module")
def expected() -> list[dict[str, torch.Tensor]]:
    return reference()


def _close(actual: dict, expected: dict, what: str) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(
            actual[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


def _differs(actual: dict, expected: dict) -> bool:
    return any(not torch.allclose(actual[n], v, rtol=1e-5, atol=1e-6) for n, v in expected.items())


# -- per-rank checkpoint files ----------------------------------------------------------------


def test_a_checkpoint_of_2_ranks_loads_at_1_rank_and_trains_on(runs, expected):
    results, _ = runs
    _close(results[0]["A"], expected[K], "2 ranks before the save")
    _close(results[3]["load1"], expected[K + MORE], "loaded at 1 rank")
    assert _differs(expected[K + MORE], expected[K])  # the later steps move the parameters


def test_a_checkpoint_of_2_ranks_loads_at_4_ranks_in_groups_of_2(runs, expected):
    results, _ = runs
    for rank, r in enumerate(results):
        _close(r["load4"], expected[K + MORE], f"rank {rank} of 4, loaded")


def test_the_index_is_json_naming_each_files_elements(runs, expected):
    _, ckpt = runs
    index = json.loads((ckpt / "index.json").read_text())
    assert (index["world"], index["sharding_degree"], index["stage"]) == (2, 2, 2)
    assert index["optimizer"] == "AdamW"
    assert [f["shard"] for f in index["files"]] == [0, 1]
    assert set(index["groups"]) == {"0", "1"}
    assert index["groups"]["0"]["exp_avg"] == {"dtype": "float64"}
    assert index["groups"]["0"]["step"]["scalar"] == K
    names = [p["name"] for p in index["params"]]
    numel = {n: v.numel() for n, v in expected[0].items()}
    assert sorted(names) == sorted(numel)
    covered = dict.fromkeys(names, 0)
    cut = 0
    for f in index["files"]:
        for p, a, b in f["pieces"]:
            covered[names[p]] += b - a
            cut += (a, b) != (0, numel[names[p]])
    assert covered == numel  # every element in exactly one file
    assert cut > 0, "some parameter is split between the two files"
    files = sorted(path.name for path in ckpt.iterdir())
    assert files == sorted(["index.json", index["common"], *(f["file"] for f in index["files"])])
    for f in index["files"]:  # plain tensors and lists: loads without unpickling objects
        torch.load(ckpt / f["file"], weights_only=True)


def test_a_damaged_checkpoint_or_another_optimizer_is_refused_by_name(runs):
    results, _ = runs
    errors = results[3]["errors"]
    assert "optimizer-" in errors["missing file"] and "is missing" in errors["missing file"]
    assert "AdamW" in errors["other class"] and "SGD" in errors["other class"]


def test_the_elastic_states_checkpoint_is_sharded_and_loads_at_another_world(runs, expected):
    results, ckpt = runs
    assert json.loads((ckpt.with_name("ckpt-state") / "index.json").read_text())["world"] == 2
    assert results[2]["state checkpoint loaded"]
    _close(results[2]["state checkpoint"], expected[K + MORE], "State's checkpoint at 1 rank")


# -- elastic: in memory -----------------------------------------------------------------------


def test_growing_from_2_to_3_ranks_reshards_in_memory(runs, expected):
    results, _ = runs
    for rank, r in enumerate(results[:3]):
        assert r["growth commits"] == K + MORE
        _close(r["growth"], expected[K + MORE], f"rank {rank} of 3 after growing")


@pytest.mark.parametrize("pair", ["D01", "D12"])
def test_shrinking_with_a_copy_of_every_shard_left_reshards_in_memory(runs, expected, pair):
    results, _ = runs
    for rank, r in enumerate(results):
        if pair in r:
            _close(r[pair], expected[K + 2 * MORE], f"old rank {rank}, {pair}")
    assert sum(pair in r for r in results) == 2


def test_a_shard_lost_with_its_rank_resumes_from_the_states_sharded_checkpoint(runs, expected):
    results, _ = runs
    for rank, r in enumerate(results[:2]):
        assert (r["G from"], r["G sampler steps"]) == (K, K)  # the checkpoint's commit
        _close(r["G"], expected[K + MORE], f"rank {rank} of 2 after the loss, from commit {K}")
        (line,) = r["G log"]
        assert "shard 2 of 3, held only by rank 2 of the previous 3-rank world" in line, line
        assert f"ckpt-state: commit {K}, {MORE} step(s) trained again" in line, line
        assert "\n" not in line


def test_a_shard_lost_with_its_rank_stops_the_job_naming_it_without_a_checkpoint(runs):
    from longboat.elastic.failures import is_peer_failure
    from longboat.elastic.reshard import ShardsLostError

    results, _ = runs
    for r in results[:2]:
        text = r["lost"]
        assert "shard 1 of 2" in text and "rank 1 of the previous 2-rank world" in text, text
        assert "lb.elastic.State(checkpoint=" in text and "sharding_degree" in text, text
        assert "load_sharded_checkpoint" in text and "\n" not in text, text
        assert not is_peer_failure(ShardsLostError(text))  # not retried as a lost peer


def test_elastic_rebuild_accepts_sharding():
    import types

    import longboat as lb
    from longboat.collective.plan import Placement, resolve
    from longboat.collective.rebuild import check_rebuildable

    plan = resolve(lb.Strategy(sharding=True), Placement.of([0, 0], "gloo"))
    check_rebuildable(types.SimpleNamespace(plan=plan, tuner=None))  # type: ignore[arg-type]


def test_each_element_comes_from_the_lowest_holder_and_gaps_are_named():
    from longboat.sharding.zero.slices import assign

    holdings = {2: [(0, 0, 6)], 1: [(0, 4, 10), (1, 0, 3)]}
    supply, missing = assign(holdings, [(0, 0, 10), (1, 0, 5)])
    assert supply == [(2, 0, 0, 4), (1, 0, 4, 10), (1, 1, 0, 3)]  # 4:6 from holder 1
    assert missing == [(1, 3, 5)]
