"""The plan's typed slices: everything below ``lb.distribute`` reads, resolved once."""

from __future__ import annotations

import pytest

from longboat.collective.plan import Placement, resolve
from longboat.recompute import RecomputeConfig
from longboat.strategy import Strategy
from longboat.trace.config import TraceConfig

ONE_NODE = Placement.of((0, 0), "gloo")
TWO_NODES = Placement.of((0, 0, 1, 1), "gloo")


def test_defaults_leave_the_process_and_the_optimizer_alone() -> None:
    plan = resolve(Strategy(env={}), ONE_NODE)
    runtime = plan.runtime
    assert (runtime.num_threads, runtime.cudnn_benchmark, runtime.conv_workspace_mb) == (
        None,
        None,
        None,
    )
    assert not runtime.compiled_fusion
    assert plan.optimizer.replace_with is None and not plan.optimizer.fused_kernels
    assert plan.recompute is None
    assert plan.trace == TraceConfig(
        timeline=None, stall_warning_seconds=60.0, stall_shutdown_seconds=0.0
    )


def test_every_slice_carries_the_users_values() -> None:
    s = Strategy(
        env={},
        num_threads=3,
        cudnn_exhaustive_search=False,
        fuse_bn_act_ops=True,
        lamb=True,
        fuse_all_optimizer_ops=True,
        recompute=True,
        timeline="trace.json",
        stall_warning_seconds=5,
        stall_shutdown_seconds=9,
    )
    s.lamb_configs = {"lamb_weight_decay": 0.02}
    s.recompute_configs = {"checkpoints": ["blocks.0", "head"], "enable_offload": True}
    plan = resolve(s, ONE_NODE)
    assert (plan.runtime.num_threads, plan.runtime.cudnn_benchmark) == (3, False)
    assert plan.runtime.conv_workspace_mb is None  # left at its default: PyTorch's own
    assert plan.runtime.compiled_fusion
    assert plan.optimizer.replace_with == "lamb" and plan.optimizer.fused_kernels
    assert plan.optimizer.config["lamb_weight_decay"] == 0.02
    assert plan.recompute == RecomputeConfig(checkpoints=("blocks.0", "head"), offload=True)
    assert plan.trace == TraceConfig(
        timeline="trace.json", stall_warning_seconds=5.0, stall_shutdown_seconds=9.0
    )
    with pytest.raises(TypeError):
        plan.optimizer.config["lamb_weight_decay"] = 0.1  # read-only like the plan


def test_shared_settings_name_every_shared_field_and_skip_per_rank_ones() -> None:
    s = Strategy(env={}, nccl_comm_num=2, num_threads=4)
    shared = resolve(s, ONE_NODE).shared_settings
    assert shared["nccl_comm_num"] == (2, "code")
    assert shared["fuse_grad_size_in_MB"] == (32, "default")
    assert shared["gradient_merge_configs.k_steps"][1] == "default"  # config fields key by key
    assert "num_threads" not in shared and "stall_shutdown_seconds" not in shared  # per rank
    assert "gradient_merge_configs" not in shared


def test_the_plan_placed_on_another_world_keeps_the_users_choices() -> None:
    """An elastic rebuild places the plan anew: the topology's choices follow the new world,
    the user's stay."""
    chosen = Strategy(env={}, nccl_comm_num=3, hierarchical_allreduce_inter_nranks=2)
    plan = resolve(chosen, ONE_NODE)
    moved = plan.on(TWO_NODES)
    assert plan.comm.algorithm == "shm" and moved.comm.algorithm == "hierarchical"
    assert moved.comm.communicators == 3 and dict(moved.comm.options) == {"inter_nranks": 2}
    assert moved.comm.bucket_mb == resolve(chosen, TWO_NODES).comm.bucket_mb
    assert moved == resolve(chosen, TWO_NODES)  # the same as resolving there
    assert moved.trace == plan.trace and moved.shared_settings == plan.shared_settings


def test_a_fractional_layer_limit_is_rounded_up() -> None:
    """Paddle's fuse_grad_size_in_TFLOPS is a float (its tests set 0.1): at least 1 layer."""
    assert resolve(Strategy(fuse_grad_size_in_TFLOPS=0.1), ONE_NODE).comm.layers_per_bucket == 1
    assert resolve(Strategy(fuse_grad_size_in_TFLOPS=2.5), ONE_NODE).comm.layers_per_bucket == 3
