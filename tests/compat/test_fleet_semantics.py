"""Paddle Fleet semantics of the strategy: fields set in any order and checked when used,
recompute against plain training, sparse table settings, prototxt files, BuildStrategy
switches without effect, unknown attributes, and a table of feature combinations."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import longboat as lb
import longboat.fleet as fleet
from longboat.strategy import Strategy, StrategyError
from tests._dist import run_ranks

LOGGER = "longboat.strategy"


def make(**fields: Any) -> Strategy:
    return Strategy(env={}, **fields)


# ---- a model whose blocks count their forward calls -----------------------------------------


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x)) + x


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.Sequential(Block(8), Block(8))
        self.head = nn.Linear(8, 3)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.inp(x))))


def _batches(steps: int, rank: int = 0, world: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=g)
        per = 8 // world
        out.append((x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
    return out


def _train(rank: int, world: int, recompute: bool, steps: int = 3) -> dict[str, Any]:
    """Fleet's collective flow; gradients of the first step, parameters at the end, and how
    often each block ran forward."""
    strategy = fleet.DistributedStrategy()
    strategy.recompute_configs = {"checkpoints": ["blocks.0", "blocks.1"]}  # before the switch
    strategy.recompute = recompute
    fleet.init(is_collective=True, strategy=strategy)
    model = Net()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    dmodel = fleet.distributed_model(model)
    grads: dict[str, torch.Tensor] = {}
    for i, (x, y) in enumerate(_batches(steps, rank, world)):
        loss = F.cross_entropy(dmodel(x), y)
        loss.backward()
        if i == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.clear_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = [b.calls for b in model.blocks]
    return {"grads": grads, "params": params, "calls": calls}


def _distributed(rank: int, world: int, strategy: Strategy, steps: int = 3) -> dict[str, Any]:
    """``lb.distribute`` training of Net on this rank's shards, as ``_train`` reports it."""
    model = Net()
    dmodel, opt = lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    grads: dict[str, torch.Tensor] = {}
    for i, (x, y) in enumerate(_batches(steps, rank, world)):
        F.cross_entropy(dmodel(x), y).backward()
        if i == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"grads": grads, "params": params, "calls": [b.calls for b in model.blocks]}


def _both(rank: int, world: int) -> dict[str, Any]:
    lb.init()
    checkpoints = {"checkpoints": ["blocks.0", "blocks.1"]}
    return {
        "plain": _distributed(rank, world, Strategy()),
        "recompute": _distributed(
            rank, world, Strategy(recompute=True, recompute_configs=checkpoints)
        ),
    }


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


def test_recompute_matches_plain_training_and_reruns_forward() -> None:
    try:
        plain = _train(0, 1, recompute=False)
        lb.shutdown()
        again = _train(0, 1, recompute=True)
    finally:
        lb.shutdown()
    _close(plain["grads"], again["grads"])
    _close(plain["params"], again["params"])
    assert plain["calls"] == [3, 3]
    assert again["calls"] == [6, 6]  # each checkpointed forward ran again in backward


def test_recompute_on_two_ranks_matches_plain_training_on_two_ranks() -> None:
    results = run_ranks(_both, 2, timeout=150)
    for r in results:
        _close(r["plain"]["grads"], r["recompute"]["grads"])
        _close(r["plain"]["params"], r["recompute"]["params"])
        assert r["recompute"]["calls"] == [6, 6]
    _close(results[0]["recompute"]["params"], results[1]["recompute"]["params"])


def test_recompute_unknown_checkpoint_names_it_and_the_valid_names() -> None:
    strategy = make(recompute=True, recompute_configs={"checkpoints": ["blocks.7"]})
    try:
        with pytest.raises(StrategyError) as info:
            lb.distribute(Net(), None, strategy)
    finally:
        lb.shutdown()
    message = str(info.value)
    assert "'blocks.7'" in message and "blocks.0" in message and "head" in message


def test_recompute_offload_keeps_gradients() -> None:
    from longboat.recompute import RecomputeConfig, apply_recompute

    x, y = _batches(1)[0]
    plain, offloaded = Net(), Net()
    s = make(recompute=True, recompute_configs={"checkpoints": ["blocks"], "enable_offload": True})
    apply_recompute(offloaded, RecomputeConfig.of(s.recompute, s.recompute_configs))
    for model in (plain, offloaded):
        F.cross_entropy(model(x), y).backward()
    _close(
        {n: p.grad for n, p in plain.named_parameters()},
        {n: p.grad for n, p in offloaded.named_parameters()},
    )


# ---- fields set in any order, checked when used ----------------------------------------------


def test_paddle_geo_setup_in_any_order_is_accepted_by_fleet_ps() -> None:
    s = fleet.DistributedStrategy()
    s.a_sync_configs = {"k_steps": 100}
    s.a_sync = True
    fleet.init(fleet.UserDefinedRoleMaker(0, fleet.Role.WORKER, 1))  # parameter-server mode
    opt = fleet.distributed_optimizer(torch.optim.SGD(Net().parameters(), lr=0.1), s)
    assert opt.user_defined_strategy.a_sync_configs["k_steps"] == 100


def test_conflict_is_refused_by_fleet_and_lb_distribute_naming_both() -> None:
    s = fleet.DistributedStrategy()
    s.localsgd = True
    s.gradient_merge = True  # accepted here
    try:
        fleet.init(is_collective=True)
        with pytest.raises(
            StrategyError, match=r"Strategy.localsgd=True and Strategy.gradient_merge"
        ):
            fleet.distributed_optimizer(torch.optim.SGD(Net().parameters(), lr=0.1), s)
        with pytest.raises(StrategyError, match="use one of them"):
            lb.distribute(Net(), None, s)
    finally:
        lb.shutdown()


@pytest.mark.parametrize(
    "fields",
    [
        {"pipeline": True},
        {"pipeline_configs": {"micro_batch_size": 4}},
        {"tensor_parallel": True},
        {"hybrid_configs": {"dp_degree": 2, "mp_degree": 2}},
    ],
)
def test_model_parallel_fields_are_refused_at_use(fields: dict[str, Any]) -> None:
    s = make(**fields)  # accepted on assignment
    name = next(iter(fields))
    with pytest.raises(StrategyError, match=f"Strategy.{name}=.*outside data parallelism"):
        s.check()


def test_hybrid_configs_with_only_data_parallelism_is_accepted() -> None:
    make(hybrid_configs={"dp_degree": 4, "mp_degree": 1, "pp_degree": 1}).check()


def test_unknown_attribute_raises_type_error_like_paddle() -> None:
    s = fleet.DistributedStrategy()
    with pytest.raises(TypeError, match="'recompute_config' is not an attribute"):
        s.recompute_config = {"checkpoints": []}
    with pytest.raises(AttributeError):
        _ = s.no_such_field


def test_fp16_compress_is_fp16_allreduce() -> None:
    s = make()
    s.fp16_compress = True
    assert s.fp16_allreduce is True and s.fp16_compress is True
    assert make(fp16_compress=True) == s
    s.dgc = True
    with pytest.raises(StrategyError, match="Strategy.dgc=True and Strategy.fp16_allreduce=True"):
        s.check()


def test_elastic_is_a_marker_that_points_at_the_launcher(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LONGBOAT_ELASTIC_DIR", raising=False)
    s = make(elastic=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s.check()
        s.check()
    found = [r.getMessage() for r in caplog.records if "elastic" in r.getMessage()]
    assert len(found) == 1 and "longboat launch --nnodes MIN:MAX" in found[0]


NO_EFFECT_SWITCHES = [
    ("enable_inplace", True),
    ("memory_optimize", True),
    ("enable_addto", True),
    ("fuse_bn_add_act_ops", False),
    ("fuse_gemm_epilogue", True),
]


@pytest.mark.parametrize(("name", "value"), NO_EFFECT_SWITCHES)
def test_build_strategy_switch_without_effect_warns_once(
    name: str, value: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from longboat.strategy import changes

    changes._warned_no_effect.discard(name)
    s = make()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s.build_strategy = {name: value}
        setattr(s, name, value)
        make(**{name: value})
    found = [r.getMessage() for r in caplog.records if f"Strategy.{name}=" in r.getMessage()]
    assert len(found) == 1 and "no effect in PyTorch" in found[0]
    assert getattr(s, name) is value
    s.check()


# ---- sparse table configs ---------------------------------------------------------------------


def test_sparse_table_configs_spellings_agree() -> None:
    short = {"emb": {"sparse_optimizer": "adam", "sparse_learning_rate": 0.01,
                     "sparse_beta1_decay_rate": 0.8, "sparse_embedx_dim": 4}}  # fmt: skip
    paddle = {
        "emb": {
            "table_parameters.emb.accessor.embedx_sgd_param.name": "SparseAdamSGDRule",
            "table_parameters.emb.accessor.embedx_sgd_param.adam.learning_rate": 0.01,
            "table_parameters.emb.accessor.embedx_sgd_param.adam.beta1_decay_rate": 0.8,
            "table_parameters.emb.accessor.embedx_dim": 4,
        }
    }
    assert make(sparse_table_configs=short) == make(sparse_table_configs=paddle)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("sparse_shard_num", 100, "'sparse_shard_num' cannot be honoured: rows are sharded"),
        ("sparse_embedx_threshold", 10, "admit_count"),
        ("sparse_accessor_class", "DownpourCtrAccessor", "show/click"),
        ("sparse_optimizer", "shared_adam", "one pair of Adam moments per row"),
        ("sparse_optimizer", "adagrad_v2", "SparseNaiveSGDRule"),
        ("sparse_learnig_rate", 0.1, "did you mean 'sparse_learning_rate'"),
    ],
)
def test_sparse_table_configs_refusals_name_the_key(key: str, value: Any, expected: str) -> None:
    with pytest.raises(StrategyError, match=key) as info:
        make(sparse_table_configs={"emb": {key: value}})
    assert expected in str(info.value)


def test_sparse_table_configs_reach_the_sparse_embedding() -> None:
    from longboat.ps import SparseEmbedding
    from longboat.ps.trainer.table_configs import apply_sparse_table_configs

    model = nn.Sequential(SparseEmbedding(100, 4, "emb", optimizer="sgd", lr=0.5))
    s = make(
        mode="ps",
        sparse_table_configs={
            "emb": {
                "sparse_table_class": "DownpourSparseTable",
                "sparse_optimizer": "adagrad",
                "sparse_learning_rate": 0.05,
                "sparse_initial_g2sum": 4.0,
                "sparse_initial_range": 0.02,
                "sparse_delete_after_unseen_days": 3,
            }
        },
    )
    s.check()
    apply_sparse_table_configs(model, s.sparse_table_configs)
    table = model[0]
    spec = table.spec()
    assert spec["optimizer"] == "adagrad" and spec["scale"] == 0.02
    assert spec["hparams"] == {"lr": pytest.approx(0.1), "initial_accumulator_value": 4.0}
    assert spec["lazy"] is True and spec["evict_after"] == 3
    with pytest.raises(StrategyError, match="no SparseEmbedding of that name.*emb"):
        apply_sparse_table_configs(model, {"user": {}})
    with pytest.raises(StrategyError, match="embedding_dim=4"):
        apply_sparse_table_configs(model, {"emb": {"accessor.embedx_dim": 8}})


# ---- prototxt ---------------------------------------------------------------------------------


def test_prototxt_round_trip(tmp_path: Path) -> None:
    s = make(
        amp=True,
        amp_configs={"init_loss_scaling": 1024.0, "custom_white_list": ["matmul", "conv2d"]},
        recompute=True,
        recompute_configs={"checkpoints": ["blocks.0"]},
        gradient_merge=True,
        gradient_merge_configs={"k_steps": 4, "avg": False},
        nccl_comm_num=2,
        fuse_grad_size_in_MB=16.5,
        timeline="trace.json",
        mode="ps",
        a_sync_configs={"k_steps": 100},
        sparse_table_configs={"emb": {"sparse_optimizer": "naive", "sparse_learning_rate": 0.1}},
        build_strategy={"fuse_bn_act_ops": True},
        execution_strategy={"num_threads": 4},
    )
    path = tmp_path / "strategy.prototxt"
    s.save_to_prototxt(path)
    text = path.read_text()
    assert 'checkpoints: "blocks.0"' in text and "mode: PS" in text and "amp: true" in text
    loaded = make()
    loaded.load_from_prototxt(path)
    assert loaded == s and loaded.source("nccl_comm_num") == "file"


PADDLE_WRITTEN = """\
mode: COLLECTIVE
amp: true
recompute: true
localsgd: false
dgc: false
a_sync: true
nccl_comm_num: 2
use_hierarchical_allreduce: false
fuse_grad_size_in_MB: 32
recompute_configs {
  checkpoints: "blocks.0"
  checkpoints: "blocks.1"
  enable_offload: false
}
amp_configs {
  init_loss_scaling: 32768.0
  incr_every_n_steps: 1000
  decr_ratio: 0.5
  use_dynamic_loss_scaling: true
  custom_black_list: "reduce_sum"
}
build_strategy {
  enable_sequential_execution: false
  fuse_elewise_add_act_ops: true
  fuse_broadcast_ops: true
}
execution_strategy {
  num_threads: 2
  num_iteration_per_drop_scope: 10
}
"""


def test_prototxt_written_by_paddle_is_read(tmp_path: Path) -> None:
    path = tmp_path / "dist_strategy.prototxt"
    path.write_text(PADDLE_WRITTEN)
    s = make()
    s.load_from_prototxt(path)
    assert (s.amp, s.recompute, s.nccl_comm_num, s.num_threads) == (True, True, 2, 2)
    assert s.recompute_configs["checkpoints"] == ["blocks.0", "blocks.1"]
    assert s.amp_configs["decr_ratio"] == 0.5
    assert s.amp_configs["custom_black_list"] == ["reduce_sum"]
    assert s.fuse_elewise_add_act_ops is True and s.fuse_broadcast_ops is True


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "amp: true\nheter_ccl_mode: true\n",
            r":2: unknown DistributedStrategy field 'heter_ccl_mode'",
        ),
        ("amp_configs {\n  init_loss_scale: 2.0\n}\n", "did you mean 'init_loss_scaling'"),
        ("build_strategy {\n  num_threads: 2\n}\n", "belongs to ExecutionStrategy"),
        ("mode: PIPELINE\n", "outside data parallelism"),
        ("amp_configs {\n  dtype: 'float16'\n", "missing '}'"),
    ],
)
def test_prototxt_errors_name_the_field(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.prototxt"
    path.write_text(text)
    s = make(nccl_comm_num=3)
    with pytest.raises(StrategyError, match=expected):
        s.load_from_prototxt(path)
    assert s == make(nccl_comm_num=3)  # nothing half-read


# ---- combinations Paddle allows: they work, or are refused when used with the reason ---------

COMBINATIONS: list[tuple[str, dict[str, Any], str | None]] = [
    ("dgc + gradient merge", {"dgc": True, "gradient_merge": True,
                              "gradient_merge_configs": {"k_steps": 2}}, None),
    ("amp(bfloat16) + recompute", {"amp": True, "amp_configs": {"dtype": "bfloat16"},
                                   "recompute": True,
                                   "recompute_configs": {"checkpoints": ["blocks.0"]}}, None),
    ("recompute + gradient merge", {"recompute": True, "gradient_merge": True,
                                    "recompute_configs": {"checkpoints": ["blocks"]}}, None),
    ("localsgd + recompute", {"localsgd": True, "recompute": True,
                              "recompute_configs": {"checkpoints": ["blocks.1"]}}, None),
    ("dgc + localsgd", {"dgc": True, "localsgd": True}, "local SGD skips them"),
    ("dgc + amp(float16)", {"dgc": True, "amp": True}, "float32 gradients"),
    ("localsgd + gradient merge", {"localsgd": True, "gradient_merge": True}, "use one of them"),
    ("lars + lamb", {"lars": True, "lamb": True}, "choose one"),
    ("dgc + fp16_compress", {"dgc": True, "fp16_compress": True}, "error feedback"),
    ("a_sync + k_steps in collective mode", {"a_sync": True, "a_sync_configs": {"k_steps": 10}},
     "parameter-server mode"),
    ("recompute without checkpoints", {"recompute": True}, "named_modules"),
    ("pipeline + amp", {"pipeline": True, "amp": True}, "outside data parallelism"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("label", "fields", "refusal"), COMBINATIONS, ids=[c[0] for c in COMBINATIONS]
)
def test_combination_works_or_is_refused_at_use(
    label: str, fields: dict[str, Any], refusal: str | None
) -> None:
    strategy = fleet.DistributedStrategy()
    for name, value in reversed(fields.items()):  # any order is accepted
        setattr(strategy, name, value)
    try:
        fleet.init(is_collective=True)
        model = Net()
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if refusal is not None:
            with pytest.raises(StrategyError, match=refusal):
                fleet.distributed_optimizer(sgd, strategy)
            return
        opt = fleet.distributed_optimizer(sgd, strategy)
        dmodel = fleet.distributed_model(model)
        before = [p.detach().clone() for p in model.parameters()]
        for x, y in _batches(4):
            opt.minimize(F.cross_entropy(dmodel(x), y))
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    finally:
        lb.shutdown()


def test_combination_geo_with_ps_mode_passes_the_check() -> None:
    make(mode="ps", a_sync=True, a_sync_configs={"k_steps": 10}).check()
