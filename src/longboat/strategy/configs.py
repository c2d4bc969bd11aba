"""Per-feature config tables of the Strategy (Fleet's ``*_configs`` dicts).

The gradient compressors' tables (``powersgd_configs``, ``dgc_configs``, ...) are not here:
each compressor declares its own with its registration (``longboat.registry.COMPRESSORS``).
"""

from __future__ import annotations

from longboat.strategy.registered import ps_mode_names
from longboat.strategy.values import (
    Bool,
    Choice,
    Config,
    Float,
    Int,
    IntList,
    KeySpec,
    RegistryChoice,
    Str,
    StrList,
    SubConfig,
)

AMP_CONFIGS = Config(
    (
        KeySpec("init_loss_scaling", Float(0, lo_open=True), 32768.0, "initial loss scale"),
        KeySpec("incr_every_n_steps", Int(1), 1000, "grow the scale after this many finite steps"),
        KeySpec("decr_every_n_nan_or_inf", Int(1), 2, "shrink the scale after this many overflows"),
        KeySpec("incr_ratio", Float(1, lo_open=True), 2.0, "factor the scale grows by"),
        KeySpec("decr_ratio", Float(0, 1, True, True), 0.8, "factor the scale shrinks by"),
        KeySpec("use_dynamic_loss_scaling", Bool(), True, "adapt the loss scale while training"),
        KeySpec("custom_white_list", StrList(), [], "ops forced to run in low precision"),
        KeySpec("custom_black_list", StrList(), [], "ops forced to run in float32"),
        KeySpec("custom_black_varnames", StrList(), [], "tensors kept in float32"),
        KeySpec("use_pure_fp16", Bool(), False, "cast the whole model, not op by op"),
        KeySpec("use_fp16_guard", Bool(), True, "with use_pure_fp16, cast only guarded regions"),
        KeySpec("dtype", Choice(("float16", "bfloat16")), "float16", "low-precision dtype"),
    )
)
GRADIENT_MERGE_CONFIGS = Config(
    (
        KeySpec("k_steps", Int(1), 1, "micro-steps accumulated before one allreduce and update"),
        KeySpec("avg", Bool(), True, "average (True) or sum (False) the accumulated gradients"),
    )
)
LOCALSGD_CONFIGS = Config(
    (
        KeySpec("k_steps", Int(1), 1, "local steps between parameter averages"),
        KeySpec("begin_step", Int(1), 1, "step at which local SGD starts"),
    )
)
ADAPTIVE_LOCALSGD_CONFIGS = Config(
    (
        KeySpec("init_k_steps", Int(1), 1, "initial local steps between parameter averages"),
        KeySpec("begin_step", Int(1), 1, "step at which adaptive local SGD starts"),
    )
)
LARS_CONFIGS = Config(
    (
        KeySpec("lars_coeff", Float(0, lo_open=True), 0.001, "trust coefficient"),
        KeySpec("lars_weight_decay", Float(0), 0.0005, "weight decay"),
        KeySpec("epsilon", Float(0), 0.0, "added to the denominator of the local learning rate"),
        KeySpec("exclude_from_weight_decay", StrList(), [], "parameter-name patterns not decayed"),
    )
)
LAMB_CONFIGS = Config(
    (
        KeySpec("lamb_weight_decay", Float(0), 0.01, "weight decay"),
        KeySpec("exclude_from_weight_decay", StrList(), [], "parameter-name patterns not decayed"),
    )
)
A_SYNC_CONFIGS = Config(
    (
        KeySpec(
            "k_steps",
            Int(-1),
            -1,
            "with a_sync=True: -1 or 0 async (half-async with use_thread_barrier), "
            ">0 geo-SGD every k steps; with a_sync=False: sync",
        ),
        KeySpec(
            "mode",
            RegistryChoice(ps_mode_names),
            "auto",
            "a registered parameter-server mode by name (longboat's key); auto: a_sync, "
            "k_steps and use_thread_barrier choose sync, async, half_async or geo",
        ),
        KeySpec("max_merge_var_num", Int(1), 1, "gradients merged into one send"),
        KeySpec("send_queue_size", Int(1), 16, "per-variable send queue length"),
        KeySpec("independent_recv_thread", Bool(), False, "receive on a dedicated thread"),
        KeySpec("min_send_grad_num_before_recv", Int(1), 1, "sends between two receives"),
        KeySpec("thread_pool_size", Int(1), 1, "communicator threads"),
        KeySpec("send_wait_times", Int(1), 1, "waits before a partial batch is sent"),
        KeySpec("runtime_split_send_recv", Bool(), False, "split variables at run time"),
        KeySpec("launch_barrier", Bool(), True, "trainers wait for servers at start"),
        KeySpec("lr_decay_steps", Int(1), 10, "steps between learning-rate decays on servers"),
        KeySpec(
            "update_on_server",
            Bool(),
            True,
            "MXNet's update_on_kvstore: the optimizer runs on the servers (True) or the servers "
            "only average gradients and trainers run it (False, sync mode; longboat's key)",
        ),
    )
)
RECOMPUTE_CONFIGS = Config(
    (
        KeySpec(
            "checkpoints",
            StrList(),
            [],
            "names of the submodules (model.named_modules()) whose forward is recomputed in "
            "backward instead of keeping its activations",
        ),
        KeySpec(
            "enable_offload",
            Bool(),
            False,
            "keep the tensors saved for backward in CPU memory (torch.autograd.graph.save_on_cpu)",
        ),
        KeySpec(
            "checkpoint_shape",
            IntList(),
            [],
            "Paddle's static shape of the offloaded checkpoints; not needed in PyTorch (no effect)",
        ),
    )
)
PIPELINE_CONFIGS = Config(
    (
        KeySpec("micro_batch_size", Int(1), 1, "samples per pipeline micro-batch"),
        KeySpec("accumulate_steps", Int(1), 1, "micro-batches per step"),
        KeySpec("schedule_mode", Choice(("1F1B", "F-then-B")), "1F1B", "pipeline schedule"),
        KeySpec("p2p_cache_shape", Bool(), True, "cache the shapes sent between stages"),
        KeySpec("enable_partial_send_recv", Bool(), True, "send slices between stages"),
        KeySpec("micro_batch", Int(1), 1, "micro-batches per batch (Paddle 2.0's key)"),
    )
)
SHARDING_CONFIGS = Config(
    (
        KeySpec(
            "sharding_degree",
            Int(0),
            0,
            "ranks the optimizer state is split over (0: every rank of the job; below the "
            "world size: split within groups of this many ranks, averaged across the groups)",
        ),
        KeySpec("stage", Int(1, 3), 1, "1: optimizer state, 2: + gradients, 3: + parameters"),
        KeySpec("segment_broadcast_MB", Float(0, lo_open=True), 32.0, "broadcast segment size"),
        KeySpec(
            "comm_overlap",
            Bool(),
            False,
            "all-gather the updated parameters during the next forward, which completes them "
            "(False: inside optimizer.step(), every parameter whole when it returns)",
        ),
        KeySpec("segment_anchors", StrList(), [], "variables that end a segment"),
        KeySpec(
            "units",
            StrList(),
            [],
            "stage 3: module classes or names that become FSDP units (empty: chosen from "
            "fuse_grad_size_in_MB)",
        ),
        KeySpec("offload", Bool(), False, "stage 3: parameter shards in CPU memory"),
        KeySpec("gradient_merge_acc_step", Int(1), 1, "gradient merge steps inside sharding"),
        KeySpec("optimize_offload", Bool(), False, "optimizer state in CPU memory"),
        KeySpec("dp_degree", Int(1), 1, "data-parallel ranks beside the sharding group"),
        KeySpec("mp_degree", Int(1), 1, "model-parallel ranks"),
        KeySpec("pp_degree", Int(1), 1, "pipeline stages"),
    )
)
TENSOR_PARALLEL_CONFIGS = Config(
    (
        KeySpec("tensor_parallel_degree", Int(1), 1, "ranks each weight matrix is split over"),
        KeySpec("tensor_init_seed", Int(-1), -1, "seed of the split weights' initialisation"),
    )
)
MP_CONFIGS = Config(
    (
        KeySpec(
            "sync_param", Bool(), False, "broadcast the parameters in the tensor-parallel group"
        ),
        KeySpec("sync_grad", Bool(), False, "synchronise gradients in the tensor-parallel group"),
        KeySpec("sync_moment", Bool(), False, "synchronise optimizer moments in that group"),
        KeySpec("sync_mode", Choice(("broadcast", "average")), "broadcast", "how they are synced"),
        KeySpec(
            "sync_param_name",
            StrList(),
            ["embedding", "layer_norm", ".b_"],
            "name patterns of the parameters synchronised",
        ),
        KeySpec("need_broadcast_data", Bool(), True, "broadcast the input data in that group"),
        KeySpec("mp_async_allreduce", Bool(), False, "overlap its allreduce with backward"),
        KeySpec("mp_skip_c_identity", Bool(), False, "with mp_async_allreduce: skip c_identity"),
        KeySpec(
            "mp_fused_linear_param_grad_add",
            Bool(),
            False,
            "with mp_async_allreduce: fuse the weight-gradient accumulation",
        ),
    )
)
"""Paddle's ``hybrid_configs['mp_configs']``: settings of tensor (model) parallelism."""
HYBRID_DEGREES = ("mp_degree", "pp_degree", "sharding_degree", "sep_degree")
HYBRID_CONFIGS = Config(
    (
        KeySpec("dp_degree", Int(-1), -1, "data-parallel ranks (-1: all ranks)"),
        KeySpec("mp_degree", Int(1), 1, "tensor (model) parallel ranks"),
        KeySpec("pp_degree", Int(1), 1, "pipeline stages"),
        KeySpec("sharding_degree", Int(1), 1, "ranks the optimizer state is split over"),
        KeySpec("sep_degree", Int(1), 1, "sequence-parallel ranks"),
        KeySpec(
            "order",
            StrList(),
            ["dp", "pp", "sharding", "sep", "mp"],
            "order of the rank axes (also Strategy.hybrid_parallel_order, as in Paddle)",
        ),
        KeySpec(
            "mp_configs",
            SubConfig(MP_CONFIGS),
            MP_CONFIGS.defaults(),
            "tensor-parallel settings, Paddle's MpConfig (merged over the current ones)",
        ),
    )
)
TRAINER_DESC_CONFIGS = Config(
    (
        KeySpec("dump_fields_path", Str(), "", "directory of the dumped fields"),
        KeySpec("dump_fields", StrList(), [], "variables dumped each step"),
        KeySpec("dump_param", StrList(), [], "parameters dumped each step"),
        KeySpec("stat_var_names", StrList(), [], "variables whose statistics are collected"),
    )
)
"""Paddle's ``trainer_desc_configs``: what its static-graph trainer dumps while it trains."""
