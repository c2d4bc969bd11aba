"""Cases of Paddle's own test_fleet_distributed_strategy.py that longboat follows, in
longboat's terms: Paddle's BuildStrategy/ExecutionStrategy objects as Paddle's setter reads them,
mp_configs' sync_param_name read back from the strategy, and Paddle's table forms of
sparse_table_configs / fleet_desc_configs read by table index as Paddle's protobuf list."""

from __future__ import annotations

from pathlib import Path

import pytest

import longboat.fleet as fleet
from longboat.strategy import StrategyError


class _BuildStrategy:
    """What Paddle's BuildStrategy() object carries in Paddle's test: its own fields, some of
    DistributedStrategy's, and attributes its DistributedStrategy never copies."""

    def __init__(self) -> None:
        self.fuse_bn_act_ops = True
        self.nccl_comm_num = 10
        self.trainers_endpoints = ["1", "2"]
        self.num_trainers = 2


class _ExecutionStrategy:
    def __init__(self) -> None:
        self.num_threads = 4
        self.use_device = "cpu"


def test_paddle_object_only_attributes_are_ignored_as_paddle_does(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attributes Paddle's objects have but its DistributedStrategy never copies
    (trainers_endpoints, use_device, ...) are ignored and warned once; a mapping naming them,
    or an unknown attribute on the object, is still refused."""
    from longboat.strategy import changes

    monkeypatch.setattr(changes, "_warned_ignored", set())
    s = fleet.DistributedStrategy()
    build = _BuildStrategy()
    with caplog.at_level("WARNING", logger="longboat.strategy"):
        s.build_strategy = build
        s.execution_strategy = _ExecutionStrategy()
    assert s.fuse_bn_act_ops is True and s.num_threads == 4 and s.nccl_comm_num == 1
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "build_strategy.trainers_endpoints is ignored" in text
    assert "execution_strategy.use_device is ignored" in text
    with pytest.raises(StrategyError, match="unknown BuildStrategy field 'trainers_endpoints'"):
        s.build_strategy = {"trainers_endpoints": ["1"]}
    build.fuse_bn_act_opz = True  # type: ignore[attr-defined]
    with pytest.raises(StrategyError, match="unknown BuildStrategy field 'fuse_bn_act_opz'"):
        s.build_strategy = build


def test_a_build_strategy_object_survives_the_prototxt_round_trip(tmp_path: Path) -> None:
    """Paddle's test_strategy_prototxt: the object's fields are saved and read back."""
    s = fleet.DistributedStrategy()
    s.dgc = True
    s.build_strategy = _BuildStrategy()
    path = tmp_path / "dist_strategy.prototxt"
    s.save_to_prototxt(str(path))
    back = fleet.DistributedStrategy()
    back.load_from_prototxt(str(path))
    assert back.dgc is True and back.fuse_bn_act_ops is True


def test_sync_param_name_is_the_mp_configs_key() -> None:
    """Paddle keeps mp_configs' sync_param_name as strategy.sync_param_name: readable and
    settable there, the same value as hybrid_configs['mp_configs']['sync_param_name']."""
    s = fleet.DistributedStrategy()
    assert s.sync_param_name == ["embedding", "layer_norm", ".b_"]
    s.hybrid_configs = {
        "mp_degree": 2,
        "mp_configs": {"sync_param": True, "sync_param_name": ["embedding", ".w"]},
    }
    assert s.sync_param_name == ["embedding", ".w"]
    assert s.hybrid_configs["mp_configs"].sync_param is True
    s.sync_param_name = ["layer_norm"]
    assert s.hybrid_configs["mp_configs"]["sync_param_name"] == ["layer_norm"]
    assert s.hybrid_configs["mp_configs"].sync_param is True  # the other keys are kept
    s.update(hybrid_configs={"mp_configs": {"sync_grad": True}}, sync_param_name=[".b_"])
    assert s.sync_param_name == [".b_"] and s.hybrid_configs["mp_configs"].sync_grad is True
    with pytest.raises(StrategyError, match=r"\['sync_param_name'\] is given twice"):
        s.update(hybrid_configs={"mp_configs": {"sync_param_name": ["a"]}}, sync_param_name=["b"])
    with pytest.raises(StrategyError, match="sync_param_name' must be list"):
        s.sync_param_name = "embedding"


# ---- sparse tables: Paddle's test_sparse_table_configs / test_fleet_desc_configs -----------------
EMBX = "accessor.embedx_sgd_param"


def test_tables_read_by_position_and_attribute_as_paddles_table_list() -> None:
    s = fleet.DistributedStrategy()
    s.sparse_table_configs = {
        "emb": {f"table_parameters.emb.{EMBX}.adagrad.learning_rate": 0.05},
        "user": {"embedx_sparse_optimizer": "naive", "embedx_sparse_learning_rate": 0.2},
    }
    tables = s.sparse_table_configs
    assert tables[0].accessor.embedx_sgd_param.adagrad.learning_rate == 0.05
    assert tables[-1].table_name == "user" and tables[1].accessor.embedx_sgd_param.name == (
        "SparseNaiveSGDRule"
    )
    assert tables["emb"] == {f"{EMBX}.adagrad.learning_rate": 0.05}  # by name, as before
    with pytest.raises(IndexError, match=r"there are 2 table\(s\) \(emb, user\)"):
        _ = tables[2]
    with pytest.raises(AttributeError, match="does not set accessor.embedx_dim: the table uses"):
        _ = tables[0].accessor.embedx_dim
    with pytest.raises(StrategyError, match="read-only"):
        tables[0].accessor.embedx_dim = 8


def test_fleet_desc_configs_fills_in_paddles_defaults() -> None:
    """Paddle's fleet_desc_configs setter: the update rule's block with its defaults, the
    table class and the days before unseen rows go; given values win."""
    expected = {"adagrad": ("adagrad", "learning_rate", 0.05), "naive": ("naive", "learning_rate",
                0.05), "adam": ("adam", "beta1_decay_rate", 0.9), "std_adagrad": ("adagrad",
                "initial_g2sum", 3.0)}  # fmt: skip
    for rule, (block, key, value) in expected.items():
        s = fleet.DistributedStrategy()
        s.fleet_desc_configs = {"emb": {"sparse_optimizer": rule}}
        table = s.sparse_table_configs[0]
        assert getattr(getattr(table.accessor.embedx_sgd_param, block), key) == value
        assert table.table_class == "MemorySparseTable"
        assert table.accessor.ctr_accessor_param.delete_after_unseen_days == 30
    s = fleet.DistributedStrategy()
    s.fleet_desc_configs = {
        "emb": {"embedx_sparse_optimizer": "adam", "sparse_learning_rate": 0.01}
    }
    assert s.sparse_table_configs["emb"][f"{EMBX}.adam.learning_rate"] == 0.01
    assert s.sparse_table_configs["emb"][f"{EMBX}.adam.ada_epsilon"] == 1e-8


def test_fleet_desc_defaults_reach_the_sparse_embedding() -> None:
    from torch import nn

    from longboat.ps import SparseEmbedding
    from longboat.ps.trainer.table_configs import apply_sparse_table_configs

    model = nn.Sequential(SparseEmbedding(100, 4, "emb", optimizer="sgd", lr=0.5))
    s = fleet.DistributedStrategy()
    s.fleet_desc_configs = {"emb": {"sparse_optimizer": "std_adagrad"}}
    apply_sparse_table_configs(model, s.sparse_table_configs)
    spec = model[0].spec()
    assert spec["optimizer"] == "adagrad" and spec["scale"] == 1e-4
    assert spec["hparams"]["lr"] == pytest.approx(0.05 * 3**0.5)
    assert spec["lazy"] is True and spec["evict_after"] == 30


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"table_parameters.emb.accessor.embed_sgd_param.adagrad.learning_rate": 0.05},
         "one-wide embed_w column"),
        ({"embed_sparse_optimizer": "adagrad"}, "set the embedx rule instead"),
        ({"table_parameters.emb.accessor.table_accessor_save_param.num": 2}, "no converter"),
        ({"sparse_accessor_class": "DownpourUnitAccessor"}, "show/click"),
        ({"sparse_accessor_class": "DownpourCtrDoubleAccessor"}, "show/click"),
        ({"sparse_optimizer": "shared_adam"}, "use 'adam' (SparseAdamSGDRule)"),
        ({"sparse_click_coeff": 1.0}, "show/click"),
    ],
)  # fmt: skip
def test_paddle_table_settings_longboat_cannot_honour_are_refused(
    settings: dict[str, object], expected: str
) -> None:
    s = fleet.DistributedStrategy()
    for field in ("sparse_table_configs", "fleet_desc_configs"):
        with pytest.raises(StrategyError, match=next(iter(settings))) as info:
            setattr(s, field, {"emb": settings})
        assert expected in str(info.value)
    s.fleet_desc_configs = {"emb": {}}
    with pytest.raises(AttributeError, match="has no accessor.embed_sgd_param: embed_sgd_param"):
        _ = s.sparse_table_configs[0].accessor.embed_sgd_param
    with pytest.raises(AttributeError, match="show_scale: a show/click statistic"):
        _ = s.sparse_table_configs[0].accessor.ctr_accessor_param.show_scale


def test_paddles_ps_fields_without_a_counterpart_say_why() -> None:
    """test_sparse_table_configs also sets adam_d2sum and fs_client_param."""
    s = fleet.DistributedStrategy()
    with pytest.raises(TypeError, match="'adam_d2sum' has no counterpart.*torch's Adam"):
        s.adam_d2sum = True
    with pytest.raises(TypeError, match="'fs_client_param' has no counterpart.*--checkpoint-dir"):
        s.fs_client_param = {"uri": "123", "user": "456"}
    with pytest.raises(AttributeError, match="HDFS client"):
        _ = s.fs_client_param
