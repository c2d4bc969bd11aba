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
