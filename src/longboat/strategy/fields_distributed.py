"""The DistributedStrategy group of the Strategy's field table (Fleet's DistributedStrategy
table and its ``*_configs`` dicts), in table order."""

from __future__ import annotations

from longboat.strategy.configs import (
    A_SYNC_CONFIGS,
    ADAPTIVE_LOCALSGD_CONFIGS,
    AMP_CONFIGS,
    GRADIENT_MERGE_CONFIGS,
    HYBRID_CONFIGS,
    LAMB_CONFIGS,
    LARS_CONFIGS,
    LOCALSGD_CONFIGS,
    PIPELINE_CONFIGS,
    RECOMPUTE_CONFIGS,
    SHARDING_CONFIGS,
    TENSOR_PARALLEL_CONFIGS,
    TRAINER_DESC_CONFIGS,
)
from longboat.strategy.registered import algorithm_names, compressor_names
from longboat.strategy.spec import (
    FieldSpec,
    implemented,
    mapped,
    not_applicable,
    outside_data_parallel,
    refused_when_used,
)
from longboat.strategy.table_views import TableConfigs, Tables
from longboat.strategy.values import Bool, Choice, Config, Float, Int, OptionalPath, RegistryChoice


def _outside(
    name: str, what: str, reason: str, config: Config | None = None
) -> tuple[FieldSpec, ...]:
    """The ``name`` switch and its ``name_configs`` (if ``config``), refused when used."""
    status = outside_data_parallel(reason)
    switch = FieldSpec(name, Bool(), False, what, status)
    if config is None:
        return (switch,)
    return switch, FieldSpec(f"{name}_configs", config, None, f"{what}: settings", status)


_ONE_REPLICA = (
    "longboat keeps a full replica of the model and optimizer on every rank and only "
    "averages gradients; use torch.distributed.pipelining / FSDP / DTensor for this"
)

DISTRIBUTED_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "mode",
        Choice(("collective", "ps")),
        "collective",
        "training mode: allreduce between equal trainers, or parameter servers",
        implemented("'ps': longboat.ps (gRPC servers, see docs/ps.md)"),
    ),
    FieldSpec(
        "a_sync",
        Bool(),
        True,
        "asynchronous parameter updates in parameter-server mode",
        implemented("ignored in collective mode; in mode='ps': False sync, True async/geo"),
    ),
    FieldSpec(
        "a_sync_configs",
        A_SYNC_CONFIGS,
        None,
        "parameter-server communicator settings (needs mode='ps')",
        implemented(
            "read: k_steps, max_merge_var_num, send_queue_size, send_wait_times, "
            "update_on_server; the others are accepted and have no effect"
        ),
    ),
    FieldSpec(
        "sparse_table_configs",
        TableConfigs(),
        Tables(),
        "Paddle's sparse table settings by table name (needs mode='ps'): update rule, learning "
        "rate, initial range, Adagrad/Adam constants, row width, days before unseen rows go",
        mapped(
            "the SparseEmbedding with that name (optimizer, hparams, init_scale, lazy, "
            "evict_after), applied by lb.distribute in mode ps; other keys are refused"
        ),
    ),
    FieldSpec(
        "trainer_desc_configs",
        TRAINER_DESC_CONFIGS,
        None,
        "what Paddle's parameter-server trainer dumps to files while it trains",
        refused_when_used(
            "Paddle's static-graph trainer writes these variables to dump files each step; "
            "with longboat your own training loop runs, so save what you need there "
            "(torch.save)"
        ),
    ),
    FieldSpec(
        "elastic",
        Bool(),
        False,
        "elastic training: ranks may join and leave",
        implemented(
            "a marker: a job is elastic when started with `longboat launch --nnodes MIN:MAX`; "
            "True in a job started otherwise logs that pointer once"
        ),
    ),
    FieldSpec(
        "auto",
        Bool(),
        False,
        "let longboat choose the allreduce algorithm, fuse_grad_size_in_MB and nccl_comm_num "
        "by timing a few training steps of each (fields set explicitly stay fixed)",
        implemented(
            "the first communicating steps try each setting (1 warm-up + 3 timed steps); the "
            "slowest rank's median decides; the choice and the table are logged on rank 0"
        ),
    ),
    FieldSpec(
        "sync_nccl_allreduce",
        Bool(),
        True,
        "wait for each allreduce on its communicator stream before the next one",
        implemented(),
    ),
    FieldSpec(
        "nccl_comm_num",
        Int(1, 64),
        1,
        "number of communicators used in parallel; left at its default, from the topology: "
        "2 across nodes on CPU (Gloo), else 1",
        implemented(),
    ),
    FieldSpec(
        "allreduce_algorithm",
        RegistryChoice(algorithm_names),
        "topology",
        "how gradient buckets are allreduced: a registered allreduce algorithm (see "
        "'Plug-ins' below); topology (the default) picks from where the ranks run: "
        "shm on one node (CPU), hierarchical across nodes of several ranks each (CPU), the "
        "backend's own (native) on NCCL and with one rank per node; auto picks per bucket size "
        "by a start-up measurement",
        implemented(),
    ),
    FieldSpec(
        "use_hierarchical_allreduce",
        Bool(),
        False,
        "allreduce inside each node first, then across nodes",
        implemented(),
    ),
    FieldSpec(
        "hierarchical_allreduce_inter_nranks",
        Int(1),
        1,
        "ranks in each lower-level group of hierarchical allreduce (usually GPUs per node); "
        "left at its default, the ranks per node of the cluster topology",
        implemented(),
    ),
    FieldSpec(
        "sync_batch_norm",
        Bool(),
        False,
        "batch-norm statistics computed across all ranks",
        mapped("longboat.SyncBatchNorm (lb.convert_sync_batchnorm), on CPU and GPU, across nodes"),
    ),
    FieldSpec(
        "fuse_all_reduce_ops",
        Bool(),
        True,
        "allreduce gradients in fused buckets instead of one call per tensor",
        implemented(),
    ),
    FieldSpec(
        "fuse_grad_size_in_MB",
        Float(0, lo_open=True),
        32.0,
        "bucket size limit, in MB of gradients per fused allreduce; left at its default, from "
        "the topology: 2 across nodes on CPU (Gloo), else 32",
        implemented(),
    ),
    FieldSpec(
        "fuse_grad_size_in_TFLOPS",
        Float(0, lo_open=True),
        20.0,
        "at most this many layers per fused allreduce bucket (a float as in Paddle, rounded up)",
        implemented(),
    ),
    FieldSpec(
        "last_comm_group_size_MB",
        Float(0, lo_open=True),
        1.0,
        "size of the last bucket (the last gradients of backward), so little is left to send after it",
        implemented(),
    ),
    FieldSpec(
        "find_unused_parameters",
        Bool(),
        False,
        "allow parameters that get no gradient in a step",
        implemented(),
    ),
    FieldSpec(
        "broadcast_buffers",
        Bool(),
        False,
        "broadcast rank 0's buffers (BatchNorm statistics) before every training forward, "
        "as DDP does by default",
        implemented(),
    ),
    FieldSpec(
        "cudnn_exhaustive_search",
        Bool(),
        True,
        "benchmark all cuDNN convolution algorithms and cache the fastest",
        mapped("torch.backends.cudnn.benchmark"),
        per_rank=True,
    ),
    FieldSpec(
        "conv_workspace_size_limit",
        Int(0),
        4000,
        "cuDNN convolution workspace limit, in MiB",
        mapped("environment variable CUDNN_CONV_WSCAP_DBG (MiB)"),
        per_rank=True,
    ),
    FieldSpec(
        "cudnn_batchnorm_spatial_persistent",
        Bool(),
        True,
        "use cuDNN's persistent spatial batch-norm kernel",
        not_applicable(
            "PyTorch chooses the cuDNN batch-norm kernel itself (the persistent one for "
            "channels_last inputs) and offers no switch to change that; both values are "
            "Paddle defaults (True before 2.1, False since) and are accepted, with no effect"
        ),
        per_rank=True,
        paddle_defaults=(False,),
    ),
    FieldSpec(
        "amp",
        Bool(),
        False,
        "automatic mixed precision with loss scaling",
        mapped(
            "torch.autocast, with Fleet's dynamic loss scaling for float16; custom op lists and use_pure_fp16 are refused by lb.distribute"
        ),
    ),
    FieldSpec(
        "amp_configs",
        AMP_CONFIGS,
        None,
        "mixed-precision settings",
        mapped(
            "torch.autocast, with Fleet's dynamic loss scaling for float16; custom op lists and use_pure_fp16 are refused by lb.distribute"
        ),
    ),
    FieldSpec(
        "recompute",
        Bool(),
        False,
        "recompute the activations of checkpointed submodules in backward to save memory",
        mapped("torch.utils.checkpoint on recompute_configs['checkpoints'] (lb.distribute)"),
    ),
    FieldSpec(
        "recompute_configs",
        RECOMPUTE_CONFIGS,
        None,
        "recompute settings",
        mapped("torch.utils.checkpoint; enable_offload: torch.autograd.graph.save_on_cpu"),
    ),
    FieldSpec(
        "gradient_merge",
        Bool(),
        False,
        "accumulate gradients over k_steps micro-batches before communicating",
        implemented(),
    ),
    FieldSpec(
        "gradient_merge_configs",
        GRADIENT_MERGE_CONFIGS,
        None,
        "gradient-merge settings",
        implemented(),
    ),
    FieldSpec(
        "localsgd",
        Bool(),
        False,
        "local SGD: average parameters every k steps instead of gradients every step",
        implemented(),
    ),
    FieldSpec(
        "localsgd_configs",
        LOCALSGD_CONFIGS,
        None,
        "local-SGD settings",
        implemented(),
    ),
    FieldSpec(
        "adaptive_localsgd",
        Bool(),
        False,
        "local SGD with an adaptive number of local steps",
        implemented(),
    ),
    FieldSpec(
        "adaptive_localsgd_configs",
        ADAPTIVE_LOCALSGD_CONFIGS,
        None,
        "adaptive local-SGD settings",
        implemented(),
    ),
    FieldSpec(
        "dgc",
        Bool(),
        False,
        "deep gradient compression: communicate only the largest gradient entries",
        implemented(),
    ),
    FieldSpec(
        "lars",
        Bool(),
        False,
        "layer-wise adaptive rate scaling (LARS) optimizer",
        implemented(),
    ),
    FieldSpec(
        "lars_configs",
        LARS_CONFIGS,
        None,
        "LARS settings",
        implemented(),
    ),
    FieldSpec(
        "lamb",
        Bool(),
        False,
        "layer-wise adaptive moments (LAMB) optimizer",
        implemented(),
    ),
    FieldSpec(
        "lamb_configs",
        LAMB_CONFIGS,
        None,
        "LAMB settings",
        implemented(),
    ),
    FieldSpec(
        "fp16_allreduce",
        Bool(),
        False,
        "cast gradients to float16 for the allreduce",
        implemented(
            "buckets cast to float16 for the allreduce, cast back; divided before, so no overflow"
        ),
    ),
    FieldSpec(
        "gradient_compression",
        RegistryChoice(compressor_names),
        "none",
        "how gradient buckets are compressed for the allreduce: a registered gradient "
        "compressor (see 'Plug-ins' below), 'none' for no compression",
        implemented("fp16_allreduce=True is the same as 'fp16'; DGC is selected by dgc=True"),
    ),
    FieldSpec(
        "timeline",
        OptionalPath(),
        None,
        "record a Chrome-trace timeline of every rank (forward, backward, each allreduce on "
        "its communicator, optimizer, data waits) into this file; view it in Perfetto or with "
        "`longboat timeline`",
        implemented("per-rank files trace.rank<r>.json, merged into the file by rank 0 at exit"),
    ),
    FieldSpec(
        "stall_warning_seconds",
        Float(0),
        60.0,
        "warn when a rank has waited this long for an allreduce, naming the ranks that have not "
        "arrived and the tensors they are missing (0: inspector off)",
        implemented(),
    ),
    FieldSpec(
        "stall_shutdown_seconds",
        Float(0),
        0.0,
        "abort the job (exit status 70) when a wait lasts this long (0: at the job timeout, "
        "LONGBOAT_TIMEOUT, which bounds every collective anyway)",
        implemented(),
        per_rank=True,
    ),
    *_outside(
        "pipeline",
        "pipeline parallelism: model stages on different ranks",
        _ONE_REPLICA,
        PIPELINE_CONFIGS,
    ),
    FieldSpec(
        "sharding",
        Bool(),
        False,
        "sharding (ZeRO): optimizer state, gradients or parameters split across ranks",
        implemented(
            "ZeRO stage 1 (optimizer state) and stage 2 (+ gradients) inside data "
            "parallelism, stage 3 (+ parameters) on torch's FSDP2, see docs/sharding.md"
        ),
    ),
    FieldSpec(
        "sharding_configs",
        SHARDING_CONFIGS,
        None,
        "sharding (ZeRO): optimizer state, gradients or parameters split across ranks: settings",
        implemented(
            "read: stage (1, 2 or 3), sharding_degree, dp_degree (1 or world / sharding_degree), "
            "comm_overlap (opt-in: the all-gather during the next forward); segment_broadcast_MB has "
            "no effect (the all-gather goes bucket by bucket); "
            "gradient_merge_acc_step, optimize_offload, segment_anchors, mp_degree and "
            "pp_degree are refused at their non-default values; stage 3 also reads units and "
            "offload"
        ),
    ),
    *_outside(
        "tensor_parallel",
        "tensor (model) parallelism: weight matrices split across ranks",
        _ONE_REPLICA,
        TENSOR_PARALLEL_CONFIGS,
    ),
    FieldSpec(
        "hybrid_configs",
        HYBRID_CONFIGS,
        None,
        "degrees of Paddle's hybrid parallelism; only dp_degree (data parallelism) is accepted",
        outside_data_parallel(
            "mp_degree, pp_degree, sharding_degree and sep_degree above 1 split the model or "
            "its optimizer state, and mp_configs configures the split of tensor parallelism; "
            + _ONE_REPLICA
        ),
    ),
)
