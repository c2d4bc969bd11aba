"""The BuildStrategy group of the Strategy's field table (Paddle's graph-build passes), in
table order."""

from __future__ import annotations

from longboat.strategy.spec import FieldSpec, implemented, mapped, no_effect
from longboat.strategy.values import Bool

_TORCH_COMPILE = "torch.compile of the model (its graph fuser fuses such ops)"
_GRAPH_PASS = (
    "a pass of Paddle's static-graph compiler; eager PyTorch has no such pass (torch.compile "
    "fuses ops when fuse_elewise_add_act_ops, fuse_bn_act_ops or fuse_relu_depthwise_conv is set)"
)

BUILD_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "enable_sequential_execution",
        Bool(),
        False,
        "run ops in program order",
        implemented("no effect: eager PyTorch always runs ops in program order"),
        group="BuildStrategy",
    ),
    FieldSpec(
        "fuse_elewise_add_act_ops",
        Bool(),
        False,
        "fuse elementwise add with the following activation",
        mapped(_TORCH_COMPILE),
        group="BuildStrategy",
    ),
    FieldSpec(
        "fuse_bn_act_ops",
        Bool(),
        False,
        "fuse batch norm with the following activation",
        mapped(_TORCH_COMPILE),
        group="BuildStrategy",
    ),
    FieldSpec(
        "fuse_relu_depthwise_conv",
        Bool(),
        False,
        "fuse ReLU with depthwise convolution",
        mapped(_TORCH_COMPILE),
        group="BuildStrategy",
    ),
    FieldSpec(
        "fuse_broadcast_ops",
        Bool(),
        False,
        "broadcast the initial parameters in coalesced buckets",
        implemented(),
        group="BuildStrategy",
    ),
    FieldSpec(
        "fuse_all_optimizer_ops",
        Bool(),
        False,
        "update all parameters in one fused optimizer step",
        mapped("the multi-tensor foreach implementation of torch optimizers"),
        group="BuildStrategy",
    ),
    FieldSpec(
        "enable_inplace",
        Bool(),
        False,
        "let op outputs reuse their inputs' memory",
        no_effect(
            "PyTorch has no graph pass that rewrites ops in place; in-place reuse is chosen in "
            "the model code (e.g. nn.ReLU(inplace=True))"
        ),
        group="BuildStrategy",
    ),
    FieldSpec(
        "enable_backward_optimizer_op_deps",
        Bool(),
        True,
        "start the optimizer update only after the whole backward pass",
        implemented(
            only_default="PyTorch applies the optimizer after backward returns, so the update "
            "always depends on the whole backward pass; remove this setting"
        ),
        group="BuildStrategy",
    ),
    FieldSpec(
        "cache_runtime_context",
        Bool(),
        False,
        "cache each op's runtime context between iterations",
        no_effect("eager PyTorch ops have no per-op runtime context to cache"),
        group="BuildStrategy",
    ),
    *(
        FieldSpec(name, Bool(), default, doc, no_effect(_GRAPH_PASS), group="BuildStrategy")
        for name, default, doc in (
            ("memory_optimize", False, "reuse variable memory across the program"),
            ("enable_addto", False, "accumulate gradients in place with addto ops"),
            ("enable_auto_fusion", False, "fuse element-wise op groups automatically"),
            ("fuse_bn_add_act_ops", True, "fuse batch norm, add and activation"),
            ("fuse_gemm_epilogue", False, "fuse matmul with the following bias add"),
            ("fused_attention", False, "use the fused multi-head attention op"),
            ("fused_feedforward", False, "use the fused feed-forward op"),
        )
    ),
)
