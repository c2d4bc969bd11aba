"""The Strategy's field table and conflict table: adding a field is one ``FieldSpec`` here.

Field names, defaults and groups follow PaddlePaddle Fleet's ``DistributedStrategy`` (the
DistributedStrategy, BuildStrategy and ExecutionStrategy tables of Paddle's collective-training
guide) and its ``*_configs`` dicts.
"""

from __future__ import annotations

from types import MappingProxyType

from longboat.strategy.spec import (
    Conflict,
    FieldSpec,
    Values,
    both_on,
    implemented,
    mapped,
    not_applicable,
)
from longboat.strategy.values import (
    Bool,
    Choice,
    Config,
    Float,
    FloatList,
    Int,
    KeySpec,
    OptionalPath,
    StrList,
)

TRAINING_OPT = "training optimisations"

_TORCH_COMPILE = "torch.compile of the model (its graph fuser fuses such ops)"

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
DGC_CONFIGS = Config(
    (
        KeySpec("rampup_begin_step", Int(0), 0, "step at which gradient compression starts"),
        KeySpec("rampup_step", Int(1), 1, "steps over which sparsity ramps up"),
        KeySpec(
            "sparsity",
            FloatList(Float(0, 1, hi_open=True)),
            [0.999],
            "sparsity schedule during ramp-up (fraction of gradient entries dropped)",
        ),
        KeySpec(
            "min_numel",
            Int(1),
            16384,
            "tensors with fewer elements are sent dense, not sparsified (longboat's key)",
        ),
    )
)
POWERSGD_CONFIGS = Config(
    (
        KeySpec("rank", Int(1), 1, "rank of the low-rank approximation of each gradient matrix"),
        KeySpec("start_step", Int(0), 10, "plain allreduces before compression starts (warm-up)"),
        KeySpec("warm_start", Bool(), True, "reuse last step's Q instead of a fresh random one"),
        KeySpec("error_feedback", Bool(), True, "carry what compression lost into the next step"),
        KeySpec(
            "min_compression_bytes", Int(0), 64 << 10, "buckets smaller than this go uncompressed"
        ),
        KeySpec("seed", Int(0), 0, "seed of the initial Q (the same on every rank)"),
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

_SPECS: tuple[FieldSpec, ...] = (
    # ---- DistributedStrategy ------------------------------------------------------------
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
        "number of communicators used in parallel (1 on one node, 2 across nodes is typical)",
        implemented(),
    ),
    FieldSpec(
        "allreduce_algorithm",
        Choice(("native", "ring", "hierarchical", "shm", "auto")),
        "native",
        "how gradient buckets are allreduced: the backend's own (native), a ring of "
        "point-to-point messages, hierarchical (intra-node, then inter-node), shared memory "
        "among the ranks of one node, or auto (chosen per bucket size by a start-up measurement)",
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
        "bucket size limit, in MB of gradients per fused allreduce",
        implemented(),
    ),
    FieldSpec(
        "fuse_grad_size_in_TFLOPS",
        Int(1),
        20,
        "at most this many layers per fused allreduce bucket",
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
            "channels_last inputs) and offers no switch to change that; remove this setting"
        ),
        per_rank=True,
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
        "dgc_configs",
        DGC_CONFIGS,
        None,
        "deep-gradient-compression settings",
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
        Choice(("none", "fp16", "bf16", "powersgd")),
        "none",
        "how gradient buckets are compressed for the allreduce: not at all, cast to float16 or "
        "bfloat16 (half the bytes), or PowerSGD's low-rank approximation with error feedback",
        implemented("fp16_allreduce=True is the same as 'fp16'; DGC is selected by dgc=True"),
    ),
    FieldSpec(
        "powersgd_configs",
        POWERSGD_CONFIGS,
        None,
        "PowerSGD settings (with gradient_compression='powersgd')",
        implemented(),
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
    # ---- BuildStrategy ------------------------------------------------------------------
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
        not_applicable(
            "PyTorch has no graph pass that rewrites ops in place; in-place reuse is chosen in "
            "the model code (e.g. nn.ReLU(inplace=True)); remove this setting"
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
        not_applicable(
            "eager PyTorch ops have no per-op runtime context to cache; remove this setting"
        ),
        group="BuildStrategy",
    ),
    # ---- ExecutionStrategy --------------------------------------------------------------
    FieldSpec(
        "num_threads",
        Int(1),
        1,
        "CPU threads for intra-op parallelism",
        mapped("torch.set_num_threads"),
        group="ExecutionStrategy",
        per_rank=True,
    ),
    FieldSpec(
        "num_iteration_per_drop_scope",
        Int(1),
        10,
        "iterations between two drops of the local scope of temporaries",
        not_applicable(
            "PyTorch frees temporaries as soon as they are unreferenced, so there is no scope "
            "to drop; remove this setting"
        ),
        group="ExecutionStrategy",
    ),
    FieldSpec(
        "num_iteration_per_run",
        Int(1),
        3,
        "iterations an executor runs per call",
        not_applicable(
            "longboat has no executor: your own loop runs one iteration per optimizer step; "
            "remove this setting and loop in your training code"
        ),
        group="ExecutionStrategy",
    ),
    FieldSpec(
        "use_thread_barrier",
        Bool(),
        False,
        "trainer threads wait on a barrier (parameter-server mode)",
        mapped("a per-step barrier of all trainers on the servers (half-async mode)"),
        group="ExecutionStrategy",
    ),
)

FIELDS: MappingProxyType[str, FieldSpec] = MappingProxyType({s.name: s for s in _SPECS})
"""Every field, in table order (the order of docs, printing and ``check_implemented``)."""


def _dgc_with_fp16_amp(v: Values) -> bool:
    return v["dgc"] is True and v["amp"] is True and v["amp_configs"]["dtype"] == "float16"


def _ps_configs_in_collective(v: Values) -> bool:
    return v["mode"] == "collective" and v["a_sync_configs"] != FIELDS["a_sync_configs"].default


CONFLICTS: tuple[Conflict, ...] = (
    both_on(
        "localsgd",
        "gradient_merge",
        "both change when gradients are communicated; use one of them",
    ),
    both_on(
        "localsgd",
        "adaptive_localsgd",
        "adaptive local SGD already is local SGD with a varying k; enable only one",
    ),
    Conflict(
        "dgc",
        "amp",
        _dgc_with_fp16_amp,
        "DGC's sparse top-k communication needs float32 gradients, and amp with "
        "amp_configs['dtype']='float16' produces float16 ones; use dtype 'bfloat16' or drop one",
        "both True and amp_configs['dtype'] == 'float16'",
    ),
    both_on(
        "dgc",
        "fp16_allreduce",
        "DGC sends sparse float32 values; a float16 allreduce would undo its error feedback",
    ),
    both_on("lars", "lamb", "both replace the optimizer; choose one"),
    both_on("dgc", "lars", "DGC is built on momentum SGD and cannot wrap the LARS optimizer"),
    both_on("dgc", "lamb", "DGC is built on momentum SGD and cannot wrap the LAMB optimizer"),
    both_on("dgc", "localsgd", "DGC compresses every step's gradients; local SGD skips them"),
    both_on(
        "dgc",
        "adaptive_localsgd",
        "DGC compresses every step's gradients; adaptive local SGD skips them",
    ),
    Conflict(
        "dgc",
        "gradient_compression",
        lambda v: v["dgc"] is True and v["gradient_compression"] != "none",
        "DGC is itself the gradient compressor; set gradient_compression='none' or dgc=False",
        "dgc True and gradient_compression not 'none'",
    ),
    Conflict(
        "fp16_allreduce",
        "gradient_compression",
        lambda v: v["fp16_allreduce"] is True and v["gradient_compression"] not in ("none", "fp16"),
        "fp16_allreduce=True selects the fp16 compressor; it cannot also be another one",
        "fp16_allreduce True and gradient_compression not 'none'/'fp16'",
    ),
    Conflict(
        "localsgd",
        "gradient_compression",
        lambda v: (v["localsgd"] or v["adaptive_localsgd"]) and v["gradient_compression"] != "none",
        "local SGD averages parameters, not gradients: there is no gradient allreduce to compress",
        "localsgd or adaptive_localsgd True and gradient_compression not 'none'",
    ),
    Conflict(
        "use_hierarchical_allreduce",
        "allreduce_algorithm",
        lambda v: (
            v["use_hierarchical_allreduce"] is True
            and v["allreduce_algorithm"] not in ("native", "hierarchical")
        ),
        "use_hierarchical_allreduce=True selects the hierarchical algorithm; it cannot also be "
        "another one",
        "use_hierarchical_allreduce True and allreduce_algorithm not 'native'/'hierarchical'",
    ),
    Conflict(
        "mode",
        "a_sync_configs",
        _ps_configs_in_collective,
        "a_sync_configs only configures the parameter-server mode; set mode='ps' or remove them",
        "mode == 'collective' and any a_sync_configs key is not at its default",
    ),
)
"""Declarative conflict rules, checked after every change."""
