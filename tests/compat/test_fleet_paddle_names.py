"""Paddle's DistributedStrategy names and values that scripts and Paddle-written prototxt files
use: accepted as Paddle does (with Paddle's defaults), refused when used where they mean model
parallelism, type errors as Paddle raises them, strict private names, and prototxt files that
hold Paddle's defaults for fields longboat does not have."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import pytest

import longboat.fleet as fleet
from longboat.strategy import Strategy, StrategyError

MP_DEFAULTS = {
    "sync_param": False,
    "sync_grad": False,
    "sync_moment": False,
    "sync_mode": "broadcast",
    "sync_param_name": ["embedding", "layer_norm", ".b_"],
    "need_broadcast_data": True,
    "mp_async_allreduce": False,
    "mp_skip_c_identity": False,
    "mp_fused_linear_param_grad_add": False,
}


def make(**fields: Any) -> Strategy:
    return Strategy(env={}, **fields)


# ---- names Paddle has ---------------------------------------------------------------------------


def test_fleet_desc_configs_fills_the_sparse_tables() -> None:
    """Paddle's fleet_desc_configs setter fills the tables sparse_table_configs reads."""
    s = fleet.DistributedStrategy()
    s.fleet_desc_configs = {"emb": {"sparse_optimizer": "naive", "sparse_learning_rate": 0.1}}
    assert s.sparse_table_configs == s.fleet_desc_configs
    assert s.sparse_table_configs["emb"]["accessor.embedx_sgd_param.naive.learning_rate"] == 0.1
    assert make(sparse_table_configs={"emb": {}}).sparse_table_configs["emb"] == {}
    assert make(fleet_desc_configs={"emb": {}}).sparse_table_configs["emb"]  # Paddle's defaults


def test_trainer_desc_configs_are_accepted_and_refused_when_used() -> None:
    s = fleet.DistributedStrategy()
    assert dict(s.trainer_desc_configs) == {
        "dump_fields_path": "",
        "dump_fields": [],
        "dump_param": [],
        "stat_var_names": [],
    }
    s.trainer_desc_configs = {
        "dump_fields_path": "dump_data",
        "dump_fields": ["xxx", "yyy"],
        "dump_param": ["zzz"],
    }
    assert s.trainer_desc_configs["dump_fields_path"] == "dump_data"
    assert len(s.trainer_desc_configs["dump_fields"]) == 2
    with pytest.raises(StrategyError, match="unknown Strategy.trainer_desc_configs key"):
        s.trainer_desc_configs = {"dump_field": ["x"]}
    s.mode = "ps"
    with pytest.raises(StrategyError, match=r"Strategy.trainer_desc_configs=.* dump files"):
        s.check()
    s.trainer_desc_configs = {"dump_fields_path": "", "dump_fields": [], "dump_param": []}
    s.check()


def test_hybrid_configs_take_paddles_mp_configs() -> None:
    """Paddle's own example: mp_configs keys read back as items and as attributes."""
    s = fleet.DistributedStrategy()
    assert dict(s.hybrid_configs["mp_configs"]) == MP_DEFAULTS
    s.hybrid_configs = {
        "dp_degree": 1,
        "mp_degree": 2,
        "pp_degree": 4,
        "mp_configs": {
            "sync_param": True,
            "sync_grad": False,
            "sync_moment": False,
            "sync_mode": "broadcast",
            "sync_param_name": ["embedding", "layer_norm", ".w", ".b_"],
        },
    }
    mp = s.hybrid_configs["mp_configs"]
    assert (mp.sync_param, mp.sync_grad, mp.sync_mode) == (True, False, "broadcast")
    assert mp["sync_param_name"] == ["embedding", "layer_norm", ".w", ".b_"]
    s.hybrid_configs["mp_configs"].need_broadcast_data = False  # as Paddle scripts write it
    s.hybrid_configs = {"mp_configs": {"sync_grad": True}}  # merged over the current keys
    assert s.hybrid_configs["mp_configs"] == {
        **MP_DEFAULTS,
        "sync_param": True,
        "sync_grad": True,
        "sync_param_name": ["embedding", "layer_norm", ".w", ".b_"],
        "need_broadcast_data": False,
    }
    with pytest.raises(StrategyError, match="did you mean 'sync_param'"):
        s.hybrid_configs = {"mp_configs": {"sync_params": True}}
    with pytest.raises(TypeError, match="'sync_params' is not an attribute of mp_configs"):
        s.hybrid_configs["mp_configs"].sync_params = True
    with pytest.raises(StrategyError, match="'sync_mode' must be one of 'broadcast', 'average'"):
        s.hybrid_configs["mp_configs"]["sync_mode"] = "sum"
    assert s.hybrid_configs["mp_configs"]["sync_mode"] == "broadcast"


def test_mp_configs_are_refused_when_used_as_model_parallelism() -> None:
    s = make(hybrid_configs={"dp_degree": 4, "mp_configs": {"sync_param": True}})
    with pytest.raises(
        StrategyError,
        match=r"Strategy.hybrid_configs=\{'dp_degree': 4, 'mp_configs': \{'sync_param': True\}\} "
        "is refused, "
        "outside data parallelism: .*mp_configs",
    ):
        s.check()
    s.hybrid_configs = {"mp_configs": {"sync_param": False}}
    s.check()  # data parallelism with Paddle's default mp_configs


def test_hybrid_parallel_order_is_hybrid_configs_order() -> None:
    s = fleet.DistributedStrategy()
    assert s.hybrid_parallel_order == ["dp", "pp", "sharding", "sep", "mp"]
    s.hybrid_configs = {"dp_degree": 1, "mp_degree": 2, "order": ["sharding", "mp", "dp", "pp"]}
    assert s.hybrid_parallel_order == ["sharding", "mp", "dp", "pp"]
    s.hybrid_parallel_order = ["dp", "mp"]
    assert s.hybrid_configs["order"] == ["dp", "mp"] and "hybrid_parallel_order" in dir(s)
    made = make(hybrid_parallel_order=["pp", "dp"], hybrid_configs={"dp_degree": 2})
    assert made.hybrid_configs["order"] == ["pp", "dp"] and made.hybrid_configs["dp_degree"] == 2
    with pytest.raises(StrategyError, match="given twice"):
        make(hybrid_parallel_order=["dp"], hybrid_configs={"order": ["mp"]})
    with pytest.raises(StrategyError, match="must be list"):
        s.hybrid_parallel_order = "dp"
    make(hybrid_parallel_order=["mp", "dp"]).check()  # an order alone is not model parallelism


def test_pipeline_configs_micro_batch_is_paddles_older_key() -> None:
    s = fleet.DistributedStrategy()
    assert s.pipeline_configs["micro_batch"] == 1
    s.pipeline_configs = {"micro_batch": 1}
    s.check()
    s.pipeline_configs = {"micro_batch": 4}
    assert s.pipeline_configs["micro_batch"] == 4
    with pytest.raises(StrategyError, match=r"Strategy.pipeline_configs=.*outside data paral"):
        s.check()


def test_cudnn_batchnorm_spatial_persistent_false_is_accepted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """False is Paddle 2.1+'s default (True, longboat's, was Paddle 2.0's): both are accepted."""
    s = fleet.DistributedStrategy()
    with caplog.at_level(logging.WARNING, logger="longboat.strategy"):
        s.cudnn_batchnorm_spatial_persistent = False
        s.check()
    assert s.cudnn_batchnorm_spatial_persistent is False and not caplog.records


# ---- type errors and strict names -------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp16_allreduce", "fp16_compress"])
def test_fp16_allreduce_type_error_is_a_type_error_as_in_paddle(name: str) -> None:
    s = fleet.DistributedStrategy()
    with pytest.raises(TypeError, match=r"Strategy.fp16_allreduce must be bool"):
        setattr(s, name, "True")
    assert s.fp16_allreduce is False  # the old value stays
    with pytest.raises(TypeError):
        make(**{name: 1})
    setattr(s, name, True)
    assert s.fp16_allreduce is True


def test_unknown_underscore_attributes_are_refused() -> None:
    s = fleet.DistributedStrategy()
    with pytest.raises(TypeError, match="'_fuse_grad_size' is not an attribute"):
        s._fuse_grad_size = 4
    with pytest.raises(TypeError, match="'_calc_comm_same_stream' is not an attribute"):
        s._calc_comm_same_stream = True
    assert "_fuse_grad_size" not in vars(s)
    with pytest.raises(AttributeError):
        _ = s._fuse_grad_size


def test_paddles_underscore_fuse_grad_size_in_tflops_is_the_field() -> None:
    """Paddle's ``_fuse_grad_size_in_TFLOPS`` property sets fuse_grad_size_in_TFLOPS; a value
    of the wrong type is refused instead of being stored on the side."""
    s = fleet.DistributedStrategy()
    with pytest.raises(StrategyError, match="Strategy.fuse_grad_size_in_TFLOPS must be float"):
        s._fuse_grad_size_in_TFLOPS = "x"
    assert "_fuse_grad_size_in_TFLOPS" not in vars(s) and s.fuse_grad_size_in_TFLOPS == 20
    s._fuse_grad_size_in_TFLOPS = 30
    assert s.fuse_grad_size_in_TFLOPS == 30 and s._fuse_grad_size_in_TFLOPS == 30
    s._fuse_grad_size_in_TFLOPS = 0.1  # a float in Paddle (its tests set 0.1)
    assert s.fuse_grad_size_in_TFLOPS == 0.1


def test_the_strategys_own_state_still_works() -> None:
    s = make(nccl_comm_num=2, hybrid_configs={"mp_configs": {"sync_grad": True}})
    for other in (s.copy(), pickle.loads(pickle.dumps(s))):
        assert other == s and other.source("nccl_comm_num") == "code"
        other.nccl_comm_num = 3
        assert s.nccl_comm_num == 2


# ---- prototxt files Paddle writes ---------------------------------------------------------------

# What Paddle writes for a strategy whose script assigned a fresh BuildStrategy and
# ExecutionStrategy and set amp and hybrid_configs: DistributedStrategy() sets four fields from
# its flags, and the group setters copy every field of the Paddle objects.
PADDLE_WRITTEN = """\
amp: true
sync_nccl_allreduce: true
cudnn_exhaustive_search: false
conv_workspace_size_limit: 512
cudnn_batchnorm_spatial_persistent: false
adam_d2sum: true
fuse_grad_size_in_num: 8
hybrid_configs {
  dp_degree: 2
  mp_degree: 1
  pp_degree: 1
  sharding_degree: 1
  mp_configs {
    sync_param: false
    need_broadcast_data: true
  }
}
pipeline_configs {
  micro_batch: 1
}
trainer_desc_configs {
}
build_strategy {
  enable_sequential_execution: false
  fuse_elewise_add_act_ops: false
  fuse_bn_act_ops: false
  fuse_relu_depthwise_conv: false
  fuse_broadcast_ops: false
  fuse_all_optimizer_ops: false
  enable_inplace: false
  enable_backward_optimizer_op_deps: true
  cache_runtime_context: false
  fuse_bn_add_act_ops: true
  enable_auto_fusion: false
  enable_addto: false
  fix_op_run_order: false
  allow_cuda_graph_capture: false
  reduce_strategy: 0
}
execution_strategy {
  num_threads: 0
  num_iteration_per_drop_scope: 100
  num_iteration_per_run: 1
  use_thread_barrier: false
}
gradient_scale_configs {
  scale_strategy: "avg"
  scale_gradient: false
}
"""


def test_prototxt_paddle_writes_with_its_defaults_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "dist_strategy.prototxt"
    path.write_text(PADDLE_WRITTEN)
    s = make()
    with caplog.at_level(logging.WARNING, logger="longboat.strategy"):
        s.load_from_prototxt(path)
        s.check()
    assert not caplog.records
    assert (s.amp, s.conv_workspace_size_limit, s.cudnn_exhaustive_search) == (True, 512, False)
    assert (s.num_iteration_per_run, s.num_iteration_per_drop_scope) == (1, 100)
    assert s.cudnn_batchnorm_spatial_persistent is False
    assert s.source("num_threads") == "default"  # Paddle's 0 (choose) sets nothing
    assert s.hybrid_configs["dp_degree"] == 2 and s.hybrid_configs["mp_configs"] == MP_DEFAULTS


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("build_strategy {\n  fix_op_run_order: true\n}\n", r":2: build_strategy field "),
        ("\nadam_d2sum: false\n", r":2: unknown DistributedStrategy field 'adam_d2sum': a Paddle"),
        ("gradient_scale_configs {\n  scale_strategy: 'sum'\n}\n", "'gradient_scale_configs'"),
        ("execution_strategy {\n  num_iteration_per_run: 4\n}\n", "no executor"),
        ("hybrid_configs {\n  mp_configs {\n    sync_parm: true\n  }\n}\n", "'sync_param'"),
    ],
)
def test_prototxt_refuses_other_values_of_paddle_only_fields(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "bad.prototxt"
    path.write_text(text)
    s = make()
    with pytest.raises(StrategyError, match=expected):
        s.load_from_prototxt(path)
    assert s == make()


def test_prototxt_round_trip_of_paddle_names(tmp_path: Path) -> None:
    s = make(
        hybrid_configs={"mp_configs": {"sync_param": True, "sync_param_name": ["emb"]}},
        hybrid_parallel_order=["mp", "dp"],
        pipeline_configs={"micro_batch": 2},
        trainer_desc_configs={"dump_fields": ["a", "b"]},
        num_iteration_per_run=1,
    )
    path = tmp_path / "strategy.prototxt"
    s.save_to_prototxt(path)
    text = path.read_text()
    assert "  mp_configs {\n    sync_param: true\n" in text
    loaded = make()
    loaded.load_from_prototxt(path)
    assert loaded == s
