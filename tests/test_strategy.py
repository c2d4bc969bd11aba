"""Strategy fields: defaults, validation, conflicts, groups, configs and status."""

from __future__ import annotations

import ast
import pickle
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import longboat
from longboat.strategy import (
    CONFLICTS,
    FIELDS,
    DistributedStrategy,
    Strategy,
    StrategyError,
    fields_by_status,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "strategy.md"


def make(**fields: Any) -> Strategy:
    """A Strategy that ignores the real environment."""
    return Strategy(env={}, **fields)


# Paddle's published defaults, a reference (not a copy of longboat's table); longboat's own
# defaults and every field's status are held against docs/strategy.md instead
# (test_defaults_and_status_are_the_documented_ones), so a new field needs no line here.

# Paddle Fleet's three strategy tables: field -> (group, default)
FLEET_TABLES: dict[str, tuple[str, Any]] = {
    "auto": ("DistributedStrategy", False),
    "a_sync": ("DistributedStrategy", True),
    "sync_nccl_allreduce": ("DistributedStrategy", True),
    "nccl_comm_num": ("DistributedStrategy", 1),
    "use_hierarchical_allreduce": ("DistributedStrategy", False),
    "hierarchical_allreduce_inter_nranks": ("DistributedStrategy", 1),
    "sync_batch_norm": ("DistributedStrategy", False),
    "fuse_all_reduce_ops": ("DistributedStrategy", True),
    "fuse_grad_size_in_MB": ("DistributedStrategy", 32),
    "fuse_grad_size_in_TFLOPS": ("DistributedStrategy", 20.0),
    "cudnn_exhaustive_search": ("DistributedStrategy", True),
    "conv_workspace_size_limit": ("DistributedStrategy", 4000),
    "cudnn_batchnorm_spatial_persistent": ("DistributedStrategy", True),
    "enable_sequential_execution": ("BuildStrategy", False),
    "fuse_elewise_add_act_ops": ("BuildStrategy", False),
    "fuse_bn_act_ops": ("BuildStrategy", False),
    "fuse_relu_depthwise_conv": ("BuildStrategy", False),
    "fuse_broadcast_ops": ("BuildStrategy", False),
    "fuse_all_optimizer_ops": ("BuildStrategy", False),
    "enable_inplace": ("BuildStrategy", False),
    "enable_backward_optimizer_op_deps": ("BuildStrategy", True),
    "cache_runtime_context": ("BuildStrategy", False),
    "memory_optimize": ("BuildStrategy", False),
    "enable_addto": ("BuildStrategy", False),
    "enable_auto_fusion": ("BuildStrategy", False),
    "fuse_bn_add_act_ops": ("BuildStrategy", True),
    "fuse_gemm_epilogue": ("BuildStrategy", False),
    "fused_attention": ("BuildStrategy", False),
    "fused_feedforward": ("BuildStrategy", False),
    "recompute": ("DistributedStrategy", False),
    "elastic": ("DistributedStrategy", False),
    "pipeline": ("DistributedStrategy", False),
    "sharding": ("DistributedStrategy", False),
    "tensor_parallel": ("DistributedStrategy", False),
    "num_threads": ("ExecutionStrategy", 1),
    "num_iteration_per_drop_scope": ("ExecutionStrategy", 10),
    "num_iteration_per_run": ("ExecutionStrategy", 3),
    "use_thread_barrier": ("ExecutionStrategy", False),
}

# Fleet's other DistributedStrategy switches
OTHER_DEFAULTS: dict[str, Any] = {
    "mode": "collective",
    "amp": False,
    "gradient_merge": False,
    "localsgd": False,
    "adaptive_localsgd": False,
    "dgc": False,
    "lars": False,
    "lamb": False,
    "fp16_allreduce": False,
    "last_comm_group_size_MB": 1.0,
    "find_unused_parameters": False,
    "sparse_table_configs": {},
}

# Fleet's *_configs (longboat's own keys marked), and PowerSGD's: a compressor's settings field
# is registered with it, so the generated reference does not list it
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "amp_configs": {
        "init_loss_scaling": 32768.0,
        "incr_every_n_steps": 1000,
        "decr_every_n_nan_or_inf": 2,
        "incr_ratio": 2.0,
        "decr_ratio": 0.8,
        "use_dynamic_loss_scaling": True,
        "custom_white_list": [],
        "custom_black_list": [],
        "custom_black_varnames": [],
        "use_pure_fp16": False,
        "use_fp16_guard": True,
        "dtype": "float16",
    },
    "gradient_merge_configs": {"k_steps": 1, "avg": True},
    "localsgd_configs": {"k_steps": 1, "begin_step": 1},
    "adaptive_localsgd_configs": {"init_k_steps": 1, "begin_step": 1},
    "dgc_configs": {
        "rampup_begin_step": 0,
        "rampup_step": 1,
        "sparsity": [0.999],
        "min_numel": 16384,  # longboat's addition
    },
    "powersgd_configs": {
        "rank": 1,
        "start_step": 10,
        "warm_start": True,
        "error_feedback": True,
        "min_compression_bytes": 65536,
        "seed": 0,
    },
    "lars_configs": {
        "lars_coeff": 0.001,
        "lars_weight_decay": 0.0005,
        "epsilon": 0.0,
        "exclude_from_weight_decay": [],
    },
    "lamb_configs": {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": []},
    "a_sync_configs": {
        "k_steps": -1,
        "mode": "auto",
        "max_merge_var_num": 1,
        "send_queue_size": 16,
        "independent_recv_thread": False,
        "min_send_grad_num_before_recv": 1,
        "thread_pool_size": 1,
        "send_wait_times": 1,
        "runtime_split_send_recv": False,
        "launch_barrier": True,
        "lr_decay_steps": 10,
        "update_on_server": True,
    },
    "recompute_configs": {"checkpoints": [], "enable_offload": False, "checkpoint_shape": []},
    "pipeline_configs": {
        "micro_batch_size": 1,
        "accumulate_steps": 1,
        "schedule_mode": "1F1B",
        "p2p_cache_shape": True,
        "enable_partial_send_recv": True,
        "micro_batch": 1,  # Paddle 2.0's key
    },
    "sharding_configs": {
        "sharding_degree": 0,
        "stage": 1,
        "segment_broadcast_MB": 32.0,
        "comm_overlap": False,  # the name (and default) of Paddle's dygraph sharding key
        "segment_anchors": [],
        "units": [],  # longboat's stage 3 keys (FSDP2)
        "offload": False,
        "gradient_merge_acc_step": 1,
        "optimize_offload": False,
        "dp_degree": 1,
        "mp_degree": 1,
        "pp_degree": 1,
    },
    "tensor_parallel_configs": {"tensor_parallel_degree": 1, "tensor_init_seed": -1},
    "hybrid_configs": {
        "dp_degree": -1,
        "mp_degree": 1,
        "pp_degree": 1,
        "sharding_degree": 1,
        "sep_degree": 1,
        "order": ["dp", "pp", "sharding", "sep", "mp"],
        "mp_configs": {
            "sync_param": False,
            "sync_grad": False,
            "sync_moment": False,
            "sync_mode": "broadcast",
            "sync_param_name": ["embedding", "layer_norm", ".b_"],
            "need_broadcast_data": True,
            "mp_async_allreduce": False,
            "mp_skip_c_identity": False,
            "mp_fused_linear_param_grad_add": False,
        },
    },
    "trainer_desc_configs": {
        "dump_fields_path": "",
        "dump_fields": [],
        "dump_param": [],
        "stat_var_names": [],
    },
}


# ---- defaults and public names ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FLEET_TABLES))
def test_fleet_table_default_and_group(name: str) -> None:
    group, default = FLEET_TABLES[name]
    value = getattr(make(), name)
    assert value == default
    assert type(value) is type(default) or isinstance(value, float)
    assert FIELDS[name].group == group


def test_group_views_hold_exactly_the_fleet_tables() -> None:
    s = make()
    for group, view in (
        ("BuildStrategy", s.build_strategy),
        ("ExecutionStrategy", s.execution_strategy),
    ):
        expected = {n: d for n, (g, d) in FLEET_TABLES.items() if g == group}
        assert dict(view) == expected


@pytest.mark.parametrize("name", sorted(OTHER_DEFAULTS))
def test_fleet_switch_defaults(name: str) -> None:
    assert getattr(make(), name) == OTHER_DEFAULTS[name]


@pytest.mark.parametrize("name", sorted(CONFIG_DEFAULTS))
def test_fleet_config_defaults(name: str) -> None:
    assert dict(getattr(make(), name)) == CONFIG_DEFAULTS[name]


def _documented(table: str) -> list[list[str]]:
    """The rows of a table (``### table``) of the reference committed in docs/strategy.md."""
    text = DOCS.read_text(encoding="utf-8")
    body = text.split(f"\n### {table}\n", 1)[1].split("\n### ", 1)[0]
    return [
        [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        for line in body.splitlines()
        if line.startswith("| `")
    ]


def _value(cell: str) -> Any:
    return ast.literal_eval(cell.strip("`"))


def _flat(config: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for key, value in config.items():
        if isinstance(value, Mapping):  # a nested config: one row per key
            yield from ((f"{key}.{k}", v) for k, v in value.items())
        else:
            yield key, value


def test_defaults_and_status_are_the_documented_ones() -> None:
    """The guard on defaults and status: every declared field's default (as ``Strategy()``
    holds it), group and status are what docs/strategy.md's committed reference says. A new
    field needs the refreshed page only; a changed default or status fails here until the page
    is refreshed, and then shows in its diff."""
    fields = {row[0].strip("`"): row for row in _documented("Fields")}
    keys = {(r[0].strip("`"), r[1].strip("`")): r[3] for r in _documented("Config keys")}
    assert sorted(fields) == sorted(spec.name for spec in FIELDS.static), "refresh the docs"
    held = make().to_dict()  # plain values
    for spec in FIELDS.static:
        _, group, _, default, status, *_ = fields[spec.name]
        assert (group, status) == (spec.group, spec.status_text()), f"{spec.name}: refresh the docs"
        values = _flat(held[spec.name]) if spec.is_config else [("", held[spec.name])]
        for key, value in values:
            documented = _value(keys[(spec.name, key)] if key else default)
            assert documented == value and type(documented) is type(value), (
                f"{spec.name} {key}: {value!r}, documented {documented!r}; refresh the docs if "
                "the change is meant"
            )


def test_public_names() -> None:
    assert DistributedStrategy is Strategy
    assert longboat.Strategy is Strategy
    assert issubclass(StrategyError, ValueError)


def test_float_fields_accept_small_values_and_ints() -> None:
    s = make(fuse_grad_size_in_MB=0.001, last_comm_group_size_MB=2)
    assert s.fuse_grad_size_in_MB == 0.001
    assert s.last_comm_group_size_MB == 2.0 and isinstance(s.last_comm_group_size_MB, float)


def test_int_fields_accept_integral_floats() -> None:
    s = make(nccl_comm_num=2.0)
    assert s.nccl_comm_num == 2 and type(s.nccl_comm_num) is int


# ---- unknown names ------------------------------------------------------------------------


def test_unknown_kwarg_suggests_closest() -> None:
    with pytest.raises(StrategyError) as info:
        make(nccl_com_num=2)
    assert str(info.value) == "unknown Strategy field 'nccl_com_num'; did you mean 'nccl_comm_num'?"


def test_unknown_setattr_suggests_closest() -> None:
    s = make()
    with pytest.raises(
        StrategyError, match=r"'fuse_all_reduce_op'.*did you mean 'fuse_all_reduce_ops'"
    ):
        s.fuse_all_reduce_op = True
    assert "fuse_all_reduce_op" not in vars(s)


def test_unknown_getattr_suggests_closest_and_hasattr_is_false() -> None:
    s = make()
    with pytest.raises(StrategyError, match=r"'sync_nccl_allreduse'.*'sync_nccl_allreduce'"):
        _ = s.sync_nccl_allreduse
    assert not hasattr(s, "no_such_field")


def test_unknown_name_without_close_match_points_to_docs() -> None:
    with pytest.raises(StrategyError, match=r"unknown Strategy field 'zzz'; see docs/strategy.md"):
        make(zzz=1)


def test_unknown_config_key_suggests_closest() -> None:
    with pytest.raises(
        StrategyError, match=r"amp_configs key 'init_loss_scale'.*'init_loss_scaling'"
    ):
        make(amp_configs={"init_loss_scale": 1024})
    s = make()
    with pytest.raises(StrategyError, match=r"'k_step'; did you mean 'k_steps'"):
        s.gradient_merge_configs["k_step"] = 2
    with pytest.raises(StrategyError, match=r"'avgg'; did you mean 'avg'"):
        _ = s.gradient_merge_configs["avgg"]


def test_unknown_key_in_from_dict() -> None:
    with pytest.raises(StrategyError, match=r"'fuse_bn_act_op'.*'fuse_bn_act_ops'"):
        Strategy.from_dict({"build_strategy": {"fuse_bn_act_op": True}}, env={})


# ---- types and ranges -----------------------------------------------------------------------

BAD_VALUES = [
    ("nccl_comm_num", 0, "int in [1, 64]"),
    ("nccl_comm_num", 65, "int in [1, 64]"),
    ("nccl_comm_num", True, "int in [1, 64]"),
    ("nccl_comm_num", 1.5, "int in [1, 64]"),
    ("nccl_comm_num", "2", "int in [1, 64]"),
    ("fuse_all_reduce_ops", 1, "bool (True or False)"),
    ("fuse_all_reduce_ops", "yes", "bool (True or False)"),
    ("fuse_grad_size_in_MB", 0, "float > 0"),
    ("fuse_grad_size_in_MB", -0.5, "float > 0"),
    ("fuse_grad_size_in_MB", float("nan"), "float > 0"),
    ("fuse_grad_size_in_MB", float("inf"), "float > 0"),
    ("fuse_grad_size_in_TFLOPS", 0, "float > 0"),
    ("last_comm_group_size_MB", 0.0, "float > 0"),
    ("hierarchical_allreduce_inter_nranks", 0, "int >= 1"),
    ("conv_workspace_size_limit", -1, "int >= 0"),
    ("num_threads", 0, "int >= 1"),
    ("mode", "PS", "one of 'collective', 'ps'"),
]


@pytest.mark.parametrize(("name", "value", "allowed"), BAD_VALUES)
def test_bad_value_in_constructor_names_field_value_and_range(
    name: str, value: Any, allowed: str
) -> None:
    with pytest.raises(StrategyError) as info:
        make(**{name: value})
    message = str(info.value)
    assert f"Strategy.{name} must be {allowed}, got {value!r}" in message


@pytest.mark.parametrize(("name", "value", "allowed"), BAD_VALUES)
def test_bad_assignment_raises_and_leaves_value(name: str, value: Any, allowed: str) -> None:
    s = make()
    before = s.to_dict()
    with pytest.raises(StrategyError, match=name):
        setattr(s, name, value)
    assert s.to_dict() == before


@pytest.mark.parametrize(
    ("config", "key", "value", "allowed"),
    [
        ("gradient_merge_configs", "k_steps", 0, "int >= 1"),
        ("gradient_merge_configs", "avg", 1, "bool"),
        ("amp_configs", "dtype", "fp8", "one of 'float16', 'bfloat16'"),
        ("amp_configs", "decr_ratio", 1.0, "float in (0, 1)"),
        ("amp_configs", "custom_white_list", "matmul", "list[str]"),
        ("dgc_configs", "sparsity", [0.5, 1.0], "each in [0, 1)"),
        ("dgc_configs", "sparsity", [], "non-empty"),
        ("a_sync_configs", "k_steps", -2, "int >= -1"),
    ],
)
def test_config_item_validation(config: str, key: str, value: Any, allowed: str) -> None:
    s = make(mode="ps")
    with pytest.raises(StrategyError) as info:
        getattr(s, config)[key] = value
    assert f"Strategy.{config}[{key!r}]" in str(info.value)
    assert allowed in str(info.value)
    assert getattr(s, config)[key] == CONFIG_DEFAULTS[config][key]


def test_config_assignment_merges_over_current() -> None:
    s = make()
    s.gradient_merge_configs = {"k_steps": 4}
    s.gradient_merge_configs = {"avg": False}
    assert dict(s.gradient_merge_configs) == {"k_steps": 4, "avg": False}
    s.gradient_merge_configs["k_steps"] = 8
    assert s.gradient_merge_configs == {"k_steps": 8, "avg": False}


def test_config_assignment_is_all_or_nothing() -> None:
    s = make()
    with pytest.raises(StrategyError, match="avg"):
        s.gradient_merge_configs = {"k_steps": 4, "avg": "no"}
    assert s.gradient_merge_configs["k_steps"] == 1
    with pytest.raises(StrategyError, match="must be a mapping"):
        s.gradient_merge_configs = [("k_steps", 4)]


def test_config_view_update_is_validated() -> None:
    s = make()
    s.lars_configs.update(lars_coeff=0.01, epsilon=1e-8)
    assert s.lars_configs["lars_coeff"] == 0.01 and s.lars_configs["epsilon"] == 1e-8
    with pytest.raises(StrategyError):
        s.lars_configs.update(lars_coeff=0.02, epsilon=-1)
    assert s.lars_configs["lars_coeff"] == 0.01


def test_config_lists_are_copied_and_read_only() -> None:
    names = ["matmul"]
    s = make(amp_configs={"custom_white_list": names})
    names.append("conv2d")
    assert s.amp_configs["custom_white_list"] == ["matmul"]
    with pytest.raises(StrategyError, match="read-only"):
        s.amp_configs["custom_white_list"].append("conv2d")
    s.amp_configs["custom_white_list"] = ("matmul", "conv2d")
    assert s.amp_configs["custom_white_list"] == ["matmul", "conv2d"]


def test_config_keys_cannot_be_deleted() -> None:
    s = make()
    with pytest.raises(StrategyError, match="assign its default"):
        del s.gradient_merge_configs["k_steps"]
    assert "k_steps" in s.gradient_merge_configs and "nope" not in s.gradient_merge_configs


def test_fields_cannot_be_deleted() -> None:
    s = make(nccl_comm_num=2)
    with pytest.raises(StrategyError):
        del s.nccl_comm_num
    assert s.nccl_comm_num == 2


# ---- BuildStrategy / ExecutionStrategy groups -------------------------------------------------


def test_group_assignment_sets_fields_in_both_spellings() -> None:
    s = make()
    s.build_strategy = {"fuse_bn_act_ops": True}
    s.BuildStrategy = {"fuse_elewise_add_act_ops": True}
    s.ExecutionStrategy = {"num_threads": 4}
    assert s.fuse_bn_act_ops and s.fuse_elewise_add_act_ops
    assert s.execution_strategy["num_threads"] == 4 == s.num_threads
    s.execution_strategy["num_threads"] = 2
    assert s.num_threads == 2


def test_fleet_example_key_from_other_group_names_its_group() -> None:
    s = make()
    with pytest.raises(StrategyError) as info:
        s.BuildStrategy = {"num_iteration_per_drop_scope": 30}
    assert (
        "'num_iteration_per_drop_scope' belongs to ExecutionStrategy, not to BuildStrategy"
        in str(info.value)
    )
    assert "strategy.execution_strategy" in str(info.value)
    assert s.num_iteration_per_drop_scope == 10


def test_group_view_rejects_top_level_field() -> None:
    s = make()
    with pytest.raises(StrategyError, match="belongs to DistributedStrategy"):
        s.execution_strategy["nccl_comm_num"] = 2
    with pytest.raises(StrategyError, match="belongs to BuildStrategy"):
        _ = s.execution_strategy["fuse_bn_act_ops"]
    assert s.nccl_comm_num == 1


def test_group_assignment_is_all_or_nothing() -> None:
    s = make()
    with pytest.raises(StrategyError, match="fuse_broadcast_ops"):
        s.build_strategy = {"fuse_bn_act_ops": True, "fuse_broadcast_ops": 1}
    assert s.fuse_bn_act_ops is False


def test_update_sets_several_fields_atomically() -> None:
    s = make(gradient_merge=True)
    s.update(gradient_merge=False, localsgd=True)
    assert (s.gradient_merge, s.localsgd) == (False, True)
    with pytest.raises(StrategyError):
        s.update({"nccl_comm_num": 3}, fuse_all_reduce_ops=0)
    assert s.nccl_comm_num == 1


# ---- conflicts (checked when the strategy is used) ----------------------------------------

# (existing fields, field assigned, value that creates the conflict, the other field named)
CONFLICT_CASES = [
    (
        {"sparse_table_configs": {"emb": {"sparse_learning_rate": 0.1}}},
        "mode",
        "collective",
        "sparse_table_configs",
    ),
    ({"recompute_configs": {"enable_offload": True}}, "recompute", True, "recompute_configs"),
    ({"gradient_merge": True}, "localsgd", True, "gradient_merge"),
    ({"adaptive_localsgd": True}, "localsgd", True, "adaptive_localsgd"),
    ({"amp": True}, "dgc", True, "amp"),
    ({"fp16_allreduce": True}, "dgc", True, "fp16_allreduce"),
    ({"lamb": True}, "lars", True, "lamb"),
    ({"lars": True}, "dgc", True, "lars"),
    ({"lamb": True}, "dgc", True, "lamb"),
    ({"localsgd": True}, "dgc", True, "localsgd"),
    ({"adaptive_localsgd": True}, "dgc", True, "adaptive_localsgd"),
    ({"gradient_compression": "powersgd"}, "dgc", True, "gradient_compression"),
    ({"gradient_compression": "bf16"}, "fp16_allreduce", True, "gradient_compression"),
    ({"gradient_compression": "fp16"}, "localsgd", True, "gradient_compression"),
    ({"mode": "ps", "a_sync_configs": {"k_steps": 0}}, "mode", "collective", "a_sync_configs"),
    ({"allreduce_algorithm": "ring"}, "use_hierarchical_allreduce", True, "allreduce_algorithm"),
    *(
        ({"sharding_configs": {"stage": 3}, other: value}, "sharding", True, other)
        for other, value in (
            ("dgc", True),
            ("gradient_compression", "powersgd"),
            ("allreduce_algorithm", "ring"),
            ("use_hierarchical_allreduce", True),
            ("lars", True),
            ("lamb", True),
            ("sync_batch_norm", True),
            ("timeline", "timeline.json"),
            ("fuse_elewise_add_act_ops", True),
            ("fuse_bn_act_ops", True),
            ("fuse_relu_depthwise_conv", True),
        )
    ),
    ({"sharding_configs": {"optimize_offload": True}}, "sharding", True, "sharding_configs"),
    ({"mode": "ps"}, "sharding", True, "mode"),
    ({"find_unused_parameters": True}, "sharding", True, "find_unused_parameters"),
    ({"auto": True}, "sharding", True, "auto"),
    ({"localsgd": True}, "sharding", True, "localsgd"),
    ({"adaptive_localsgd": True}, "sharding", True, "adaptive_localsgd"),
    *(
        ({"sharding_configs": {"stage": 2}, other: True}, "sharding", True, other)
        for other in ("dgc",)
    ),
    (
        {"sharding_configs": {"stage": 2}, "gradient_compression": "powersgd"},
        "sharding",
        True,
        "gradient_compression",
    ),
    (
        {"sharding_configs": {"stage": 2}, "allreduce_algorithm": "ring"},
        "sharding",
        True,
        "allreduce_algorithm",
    ),
]


def test_conflict_cases_cover_every_rule() -> None:
    covered = {frozenset({name, other}) for _, name, _, other in CONFLICT_CASES}
    assert covered == {frozenset({c.first, c.second}) for c in CONFLICTS}


@pytest.mark.parametrize(("existing", "name", "value", "other"), CONFLICT_CASES)
def test_conflict_is_accepted_on_assignment_and_refused_at_use(
    existing: dict[str, Any], name: str, value: Any, other: str
) -> None:
    s = make(**existing)
    setattr(s, name, value)  # any order of assignments is accepted
    with pytest.raises(StrategyError) as info:
        s.check()
    message = str(info.value)
    assert f"Strategy.{name}=" in message and f"Strategy.{other}=" in message
    assert "cannot be combined" in message
    with pytest.raises(StrategyError, match="cannot be combined"):
        s.check_implemented()  # the older name runs the same check


@pytest.mark.parametrize(("existing", "name", "value", "other"), CONFLICT_CASES)
def test_conflicting_constructor_is_refused_at_use(
    existing: dict[str, Any], name: str, value: Any, other: str
) -> None:
    s = make(**{**existing, name: value})
    with pytest.raises(StrategyError, match=f"conflicting settings: .*Strategy.{other}="):
        s.check()


def test_dgc_with_bfloat16_amp_is_allowed_until_dtype_becomes_float16() -> None:
    s = make(amp=True, amp_configs={"dtype": "bfloat16"}, dgc=True)
    s.check()
    s.amp_configs["dtype"] = "float16"
    with pytest.raises(StrategyError, match="float32 gradients"):
        s.check()


def test_a_sync_configs_need_ps_mode_whatever_the_order() -> None:
    s = make()
    s.a_sync_configs = {"k_steps": 100}
    s.a_sync = True
    with pytest.raises(StrategyError, match=r"Strategy.a_sync_configs=\{'k_steps': 100\}"):
        s.check()
    s.mode = "ps"
    s.check()
    assert s.a_sync_configs["k_steps"] == 100


def test_switching_between_conflicting_features_works_atomically() -> None:
    s = make(gradient_merge=True)
    s.gradient_merge = False
    s.localsgd = True
    assert s.localsgd and not s.gradient_merge


# ---- status ---------------------------------------------------------------------------------

NOT_APPLICABLE = {
    "num_iteration_per_drop_scope": (
        30,
        "PyTorch frees temporaries as soon as they are unreferenced",
    ),
    "num_iteration_per_run": (5, "no executor"),
}
PADDLE_DEFAULTS = {  # field -> Paddle's default where it differs from longboat's: accepted
    "num_iteration_per_run": 1,
    "num_iteration_per_drop_scope": 100,  # a Paddle ExecutionStrategy object's
    "cudnn_batchnorm_spatial_persistent": False,  # Paddle 2.1+
}


@pytest.mark.parametrize("name", sorted(PADDLE_DEFAULTS))
def test_paddle_defaults_are_accepted_like_the_default(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    value = PADDLE_DEFAULTS[name]
    s = make(**{name: value})
    setattr(s, name, value)
    with caplog.at_level("WARNING", logger="longboat.strategy"):
        s.check()
    assert getattr(s, name) == value and not caplog.records


@pytest.mark.parametrize("name", sorted(NOT_APPLICABLE))
def test_not_applicable_rejects_non_default_with_reason(name: str) -> None:
    value, reason = NOT_APPLICABLE[name]
    s = make(**{name: FIELDS[name].default})  # the default is accepted
    with pytest.raises(StrategyError) as info:
        setattr(s, name, value)
    assert f"Strategy.{name}={value!r} has no meaning in longboat" in str(info.value)
    assert reason in str(info.value) and "remove this setting" in str(info.value)
    assert getattr(s, name) == FIELDS[name].default


def test_backward_optimizer_deps_false_is_refused_with_reason() -> None:
    with pytest.raises(StrategyError, match="optimizer after backward"):
        make(enable_backward_optimizer_op_deps=False)
    assert make(enable_sequential_execution=True).enable_sequential_execution is True


def test_fields_by_status_names_an_unknown_status() -> None:
    with pytest.raises(StrategyError, match="unknown status"):
        fields_by_status("done")  # type: ignore[arg-type]


def _non_default(name: str) -> dict[str, Any]:
    spec = FIELDS[name]
    if name == "mode":
        return {"mode": "ps"}
    if name == "a_sync_configs":
        return {"mode": "ps", "a_sync_configs": {"k_steps": 0}}
    if spec.is_config:
        key, value = next(iter(spec.default.items()))
        bumped = (
            [0.5]
            if isinstance(value, list)
            else (not value if isinstance(value, bool) else value + 1)
        )
        return {name: {key: bumped}}
    if isinstance(spec.default, bool):
        return {name: not spec.default}
    return {name: spec.default + 1}


@pytest.mark.parametrize("name", fields_by_status("planned"))
def test_check_implemented_names_planned_field_and_feature(name: str) -> None:
    s = make(**_non_default(name))
    with pytest.raises(NotImplementedError) as info:
        s.check_implemented()
    message = str(info.value)
    first = "mode" if name == "a_sync_configs" else name
    assert message.startswith(f"Strategy.{first}=")
    feature = FIELDS[first].status.feature
    assert feature in message and "does not implement yet (planned: " in message


def test_check_implemented_passes_for_defaults_and_implemented_fields() -> None:
    make().check_implemented()
    make(
        nccl_comm_num=2,
        gradient_merge=True,
        gradient_merge_configs={"k_steps": 4},
        fuse_grad_size_in_MB=0.001,
        a_sync=False,
        fuse_all_optimizer_ops=True,
        cudnn_exhaustive_search=False,
        auto=True,
    ).check_implemented()
    make(
        mode="ps", a_sync=False, a_sync_configs={"k_steps": 0}, use_thread_barrier=True
    ).check_implemented()


def test_every_field_has_doc_and_status() -> None:
    for name, spec in FIELDS.items():
        assert spec.doc and spec.status.kind in ("implemented", "not applicable", "planned"), name
        assert spec.env_var == "LONGBOAT_" + name.upper()


# ---- equality and copies ------------------------------------------------------------------


def test_equality_compares_all_values() -> None:
    assert make() == make()
    assert make(nccl_comm_num=2) != make()
    assert make(amp_configs={"incr_ratio": 3}) != make()
    assert make() != "Strategy()"


def test_copy_is_independent() -> None:
    s = make(amp_configs={"custom_black_list": ["softmax"]})
    c = s.copy()
    assert c == s and c is not s
    c.amp_configs["custom_black_list"] = []
    c.nccl_comm_num = 3
    assert s.amp_configs["custom_black_list"] == ["softmax"] and s.nccl_comm_num == 1
    assert c.source("nccl_comm_num") == "code"


def test_pickle_round_trip() -> None:
    s = make(nccl_comm_num=4, gradient_merge=True)
    assert pickle.loads(pickle.dumps(s)) == s


def test_repr_is_one_line_of_non_defaults() -> None:
    assert repr(make()) == "Strategy()"
    assert repr(make(nccl_comm_num=2, gradient_merge_configs={"k_steps": 2})) == (
        "Strategy(nccl_comm_num=2, gradient_merge_configs={'k_steps': 2})"
    )


class _PaddleBuildStrategy:
    """What Paddle's BuildStrategy() object carries: its own fields and some of
    DistributedStrategy's, which Paddle ignores on assignment."""

    def __init__(self) -> None:
        self.fuse_bn_act_ops = True
        self.enable_inplace = True
        self.nccl_comm_num = 4
        self.use_hierarchical_allreduce = True
        self.sync_batch_norm = True


def test_a_build_strategy_object_is_taken_as_paddle_takes_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from longboat.strategy import changes

    monkeypatch.setattr(changes, "_warned_ignored", set())  # warned once per process
    s = make()
    with caplog.at_level("WARNING", logger="longboat.strategy"):
        s.build_strategy = _PaddleBuildStrategy()
    assert s.fuse_bn_act_ops is True and s.enable_inplace is True  # its own fields apply
    assert s.nccl_comm_num == 1 and s.sync_batch_norm is False  # the others are ignored
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "build_strategy.nccl_comm_num is ignored" in text and "strategy.nccl_comm_num" in text
    with pytest.raises(StrategyError, match="belongs to DistributedStrategy"):
        s.build_strategy = {"nccl_comm_num": 4}  # longboat's own mapping form: refused
