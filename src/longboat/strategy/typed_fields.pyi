"""The declared Strategy fields, typed, for type checkers and editors.

Generated from the field table by
``python -m longboat.strategy --write-docs docs/strategy.md``: do not edit.
"""

import os
from collections.abc import Mapping
from typing import Any, Literal, overload

from longboat.strategy.table_views import Tables
from longboat.strategy.views import ConfigView, GroupView, SubConfigView

class ASyncConfigs(ConfigView):
    """The keys of ``Strategy.a_sync_configs``."""
    @overload
    def __getitem__(self, key: Literal["k_steps", "max_merge_var_num", "send_queue_size", "min_send_grad_num_before_recv", "thread_pool_size", "send_wait_times", "lr_decay_steps"]) -> int: ...
    @overload
    def __getitem__(self, key: Literal["mode"]) -> str: ...
    @overload
    def __getitem__(self, key: Literal["independent_recv_thread", "runtime_split_send_recv", "launch_barrier", "update_on_server"]) -> bool: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

class TrainerDescConfigs(ConfigView):
    """The keys of ``Strategy.trainer_desc_configs``."""
    @overload
    def __getitem__(self, key: Literal["dump_fields_path"]) -> str: ...
    @overload
    def __getitem__(self, key: Literal["dump_fields", "dump_param", "stat_var_names"]) -> list[str]: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

class AmpConfigs(ConfigView):
    """The keys of ``Strategy.amp_configs``."""
    @overload
    def __getitem__(self, key: Literal["init_loss_scaling", "incr_ratio", "decr_ratio"]) -> float: ...
    @overload
    def __getitem__(self, key: Literal["incr_every_n_steps", "decr_every_n_nan_or_inf"]) -> int: ...
    @overload
    def __getitem__(self, key: Literal["use_dynamic_loss_scaling", "use_pure_fp16", "use_fp16_guard"]) -> bool: ...
    @overload
    def __getitem__(self, key: Literal["custom_white_list", "custom_black_list", "custom_black_varnames"]) -> list[str]: ...
    @overload
    def __getitem__(self, key: Literal["dtype"]) -> Literal["float16", "bfloat16"]: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

class RecomputeConfigs(ConfigView):
    """The keys of ``Strategy.recompute_configs``."""
    @overload
    def __getitem__(self, key: Literal["checkpoints"]) -> list[str]: ...
    @overload
    def __getitem__(self, key: Literal["enable_offload"]) -> bool: ...
    @overload
    def __getitem__(self, key: Literal["checkpoint_shape"]) -> list[int]: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

class GradientMergeConfigs(ConfigView):
    """The keys of ``Strategy.gradient_merge_configs``."""
    @overload
    def __getitem__(self, key: Literal["k_steps"]) -> int: ...
    @overload
    def __getitem__(self, key: Literal["avg"]) -> bool: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

class LocalsgdConfigs(ConfigView):
    """The keys of ``Strategy.localsgd_configs``."""
    @overload
    def __getitem__(self, key: Literal["k_steps", "begin_step"]) -> int: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

class AdaptiveLocalsgdConfigs(ConfigView):
    """The keys of ``Strategy.adaptive_localsgd_configs``."""
    @overload
    def __getitem__(self, key: Literal["init_k_steps", "begin_step"]) -> int: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

class LarsConfigs(ConfigView):
    """The keys of ``Strategy.lars_configs``."""
    @overload
    def __getitem__(self, key: Literal["lars_coeff", "lars_weight_decay", "epsilon"]) -> float: ...
    @overload
    def __getitem__(self, key: Literal["exclude_from_weight_decay"]) -> list[str]: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

class LambConfigs(ConfigView):
    """The keys of ``Strategy.lamb_configs``."""
    @overload
    def __getitem__(self, key: Literal["lamb_weight_decay"]) -> float: ...
    @overload
    def __getitem__(self, key: Literal["exclude_from_weight_decay"]) -> list[str]: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

class PipelineConfigs(ConfigView):
    """The keys of ``Strategy.pipeline_configs``."""
    @overload
    def __getitem__(self, key: Literal["micro_batch_size", "accumulate_steps", "micro_batch"]) -> int: ...
    @overload
    def __getitem__(self, key: Literal["schedule_mode"]) -> Literal["1F1B", "F-then-B"]: ...
    @overload
    def __getitem__(self, key: Literal["p2p_cache_shape", "enable_partial_send_recv"]) -> bool: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

class ShardingConfigs(ConfigView):
    """The keys of ``Strategy.sharding_configs``."""
    @overload
    def __getitem__(self, key: Literal["sharding_degree", "stage", "gradient_merge_acc_step", "dp_degree", "mp_degree", "pp_degree"]) -> int: ...
    @overload
    def __getitem__(self, key: Literal["segment_broadcast_MB"]) -> float: ...
    @overload
    def __getitem__(self, key: Literal["comm_overlap", "offload", "optimize_offload"]) -> bool: ...
    @overload
    def __getitem__(self, key: Literal["segment_anchors", "units"]) -> list[str]: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

class TensorParallelConfigs(ConfigView):
    """The keys of ``Strategy.tensor_parallel_configs``."""
    @overload
    def __getitem__(self, key: Literal["tensor_parallel_degree", "tensor_init_seed"]) -> int: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

class HybridConfigs(ConfigView):
    """The keys of ``Strategy.hybrid_configs``."""
    @overload
    def __getitem__(self, key: Literal["dp_degree", "mp_degree", "pp_degree", "sharding_degree", "sep_degree"]) -> int: ...
    @overload
    def __getitem__(self, key: Literal["order"]) -> list[str]: ...
    @overload
    def __getitem__(self, key: Literal["mp_configs"]) -> SubConfigView: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

class DeclaredFields:
    """The declared fields of ``longboat.Strategy``, typed: its attributes and
    keywords. Other names (the registries' ``<name>_configs``) read and take ``Any``.
    """

    def __init__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        mode: Literal["collective", "ps"] = ...,
        a_sync: bool = ...,
        a_sync_configs: Mapping[str, Any] = ...,
        sparse_table_configs: Mapping[str, Mapping[str, Any]] = ...,
        trainer_desc_configs: Mapping[str, Any] = ...,
        elastic: bool = ...,
        auto: bool = ...,
        sync_nccl_allreduce: bool = ...,
        nccl_comm_num: int = ...,
        allreduce_algorithm: str = ...,
        use_hierarchical_allreduce: bool = ...,
        hierarchical_allreduce_inter_nranks: int = ...,
        sync_batch_norm: bool = ...,
        fuse_all_reduce_ops: bool = ...,
        fuse_grad_size_in_MB: float = ...,
        fuse_grad_size_in_TFLOPS: float = ...,
        last_comm_group_size_MB: float = ...,
        find_unused_parameters: bool = ...,
        broadcast_buffers: bool = ...,
        cudnn_exhaustive_search: bool = ...,
        conv_workspace_size_limit: int = ...,
        cudnn_batchnorm_spatial_persistent: bool = ...,
        amp: bool = ...,
        amp_configs: Mapping[str, Any] = ...,
        recompute: bool = ...,
        recompute_configs: Mapping[str, Any] = ...,
        gradient_merge: bool = ...,
        gradient_merge_configs: Mapping[str, Any] = ...,
        localsgd: bool = ...,
        localsgd_configs: Mapping[str, Any] = ...,
        adaptive_localsgd: bool = ...,
        adaptive_localsgd_configs: Mapping[str, Any] = ...,
        dgc: bool = ...,
        lars: bool = ...,
        lars_configs: Mapping[str, Any] = ...,
        lamb: bool = ...,
        lamb_configs: Mapping[str, Any] = ...,
        fp16_allreduce: bool = ...,
        gradient_compression: str = ...,
        timeline: str | os.PathLike[str] | None = ...,
        stall_warning_seconds: float = ...,
        stall_shutdown_seconds: float = ...,
        pipeline: bool = ...,
        pipeline_configs: Mapping[str, Any] = ...,
        sharding: bool = ...,
        sharding_configs: Mapping[str, Any] = ...,
        tensor_parallel: bool = ...,
        tensor_parallel_configs: Mapping[str, Any] = ...,
        hybrid_configs: Mapping[str, Any] = ...,
        enable_sequential_execution: bool = ...,
        fuse_elewise_add_act_ops: bool = ...,
        fuse_bn_act_ops: bool = ...,
        fuse_relu_depthwise_conv: bool = ...,
        fuse_broadcast_ops: bool = ...,
        fuse_all_optimizer_ops: bool = ...,
        enable_inplace: bool = ...,
        enable_backward_optimizer_op_deps: bool = ...,
        cache_runtime_context: bool = ...,
        memory_optimize: bool = ...,
        enable_addto: bool = ...,
        enable_auto_fusion: bool = ...,
        fuse_bn_add_act_ops: bool = ...,
        fuse_gemm_epilogue: bool = ...,
        fused_attention: bool = ...,
        fused_feedforward: bool = ...,
        num_threads: int = ...,
        num_iteration_per_drop_scope: int = ...,
        num_iteration_per_run: int = ...,
        use_thread_barrier: bool = ...,
        fp16_compress: bool = ...,
        fleet_desc_configs: Mapping[str, Mapping[str, Any]] = ...,
        _fuse_grad_size_in_TFLOPS: float = ...,
        hybrid_parallel_order: list[str] | tuple[str, ...] = ...,
        sync_param_name: list[str] | tuple[str, ...] = ...,
        build_strategy: Any = ...,
        BuildStrategy: Any = ...,
        execution_strategy: Any = ...,
        ExecutionStrategy: Any = ...,
        **fields: Any,
    ) -> None: ...
    mode: Literal["collective", "ps"]
    """training mode: allreduce between equal trainers, or parameter servers"""
    a_sync: bool
    """asynchronous parameter updates in parameter-server mode"""
    @property
    def a_sync_configs(self) -> ASyncConfigs:
        """parameter-server communicator settings (needs mode='ps')"""
    @a_sync_configs.setter
    def a_sync_configs(self, value: Mapping[str, Any]) -> None: ...
    @property
    def sparse_table_configs(self) -> Tables:
        """Paddle's sparse table settings by table name (needs mode='ps'): update rule, learning rate, initial range, Adagrad/Adam constants, row width, days before unseen rows go"""
    @sparse_table_configs.setter
    def sparse_table_configs(self, value: Mapping[str, Mapping[str, Any]]) -> None: ...
    @property
    def trainer_desc_configs(self) -> TrainerDescConfigs:
        """what Paddle's parameter-server trainer dumps to files while it trains"""
    @trainer_desc_configs.setter
    def trainer_desc_configs(self, value: Mapping[str, Any]) -> None: ...
    elastic: bool
    """elastic training: ranks may join and leave"""
    auto: bool
    """let longboat choose the allreduce algorithm, fuse_grad_size_in_MB and nccl_comm_num by timing a few training steps of each (fields set explicitly stay fixed)"""
    sync_nccl_allreduce: bool
    """wait for each allreduce on its communicator stream before the next one"""
    nccl_comm_num: int
    """number of communicators used in parallel; left at its default, from the topology: 2 across nodes on CPU (Gloo), else 1"""
    allreduce_algorithm: str
    """how gradient buckets are allreduced: a registered allreduce algorithm (see 'Plug-ins' below); topology (the default) picks from where the ranks run: shm on one node (CPU), hierarchical across nodes of several ranks each (CPU), the backend's own (native) on NCCL and with one rank per node; auto picks per bucket size by a start-up measurement"""
    use_hierarchical_allreduce: bool
    """allreduce inside each node first, then across nodes"""
    hierarchical_allreduce_inter_nranks: int
    """ranks in each lower-level group of hierarchical allreduce (usually GPUs per node); left at its default, the ranks per node of the cluster topology"""
    sync_batch_norm: bool
    """batch-norm statistics computed across all ranks"""
    fuse_all_reduce_ops: bool
    """allreduce gradients in fused buckets instead of one call per tensor"""
    fuse_grad_size_in_MB: float
    """bucket size limit, in MB of gradients per fused allreduce; left at its default, from the topology: 2 across nodes on CPU (Gloo), else 32"""
    fuse_grad_size_in_TFLOPS: float
    """at most this many layers per fused allreduce bucket (a float as in Paddle, rounded up)"""
    last_comm_group_size_MB: float
    """size of the last bucket (the last gradients of backward), so little is left to send after it"""
    find_unused_parameters: bool
    """allow parameters that get no gradient in a step"""
    broadcast_buffers: bool
    """broadcast rank 0's buffers (BatchNorm statistics) before every training forward, as DDP does by default"""
    cudnn_exhaustive_search: bool
    """benchmark all cuDNN convolution algorithms and cache the fastest"""
    conv_workspace_size_limit: int
    """cuDNN convolution workspace limit, in MiB"""
    cudnn_batchnorm_spatial_persistent: bool
    """use cuDNN's persistent spatial batch-norm kernel"""
    amp: bool
    """automatic mixed precision with loss scaling"""
    @property
    def amp_configs(self) -> AmpConfigs:
        """mixed-precision settings"""
    @amp_configs.setter
    def amp_configs(self, value: Mapping[str, Any]) -> None: ...
    recompute: bool
    """recompute the activations of checkpointed submodules in backward to save memory"""
    @property
    def recompute_configs(self) -> RecomputeConfigs:
        """recompute settings"""
    @recompute_configs.setter
    def recompute_configs(self, value: Mapping[str, Any]) -> None: ...
    gradient_merge: bool
    """accumulate gradients over k_steps micro-batches before communicating"""
    @property
    def gradient_merge_configs(self) -> GradientMergeConfigs:
        """gradient-merge settings"""
    @gradient_merge_configs.setter
    def gradient_merge_configs(self, value: Mapping[str, Any]) -> None: ...
    localsgd: bool
    """local SGD: average parameters every k steps instead of gradients every step"""
    @property
    def localsgd_configs(self) -> LocalsgdConfigs:
        """local-SGD settings"""
    @localsgd_configs.setter
    def localsgd_configs(self, value: Mapping[str, Any]) -> None: ...
    adaptive_localsgd: bool
    """local SGD with an adaptive number of local steps"""
    @property
    def adaptive_localsgd_configs(self) -> AdaptiveLocalsgdConfigs:
        """adaptive local-SGD settings"""
    @adaptive_localsgd_configs.setter
    def adaptive_localsgd_configs(self, value: Mapping[str, Any]) -> None: ...
    dgc: bool
    """deep gradient compression: communicate only the largest gradient entries"""
    lars: bool
    """layer-wise adaptive rate scaling (LARS) optimizer"""
    @property
    def lars_configs(self) -> LarsConfigs:
        """LARS settings"""
    @lars_configs.setter
    def lars_configs(self, value: Mapping[str, Any]) -> None: ...
    lamb: bool
    """layer-wise adaptive moments (LAMB) optimizer"""
    @property
    def lamb_configs(self) -> LambConfigs:
        """LAMB settings"""
    @lamb_configs.setter
    def lamb_configs(self, value: Mapping[str, Any]) -> None: ...
    fp16_allreduce: bool
    """cast gradients to float16 for the allreduce"""
    gradient_compression: str
    """how gradient buckets are compressed for the allreduce: a registered gradient compressor (see 'Plug-ins' below), 'none' for no compression"""
    @property
    def timeline(self) -> str | None:
        """record a Chrome-trace timeline of every rank (forward, backward, each allreduce on its communicator, optimizer, data waits) into this file; view it in Perfetto or with `longboat timeline`"""
    @timeline.setter
    def timeline(self, value: str | os.PathLike[str] | None) -> None: ...
    stall_warning_seconds: float
    """warn when a rank has waited this long for an allreduce, naming the ranks that have not arrived and the tensors they are missing (0: inspector off)"""
    stall_shutdown_seconds: float
    """abort the job (exit status 70) when a wait lasts this long (0: at the job timeout, LONGBOAT_TIMEOUT, which bounds every collective anyway)"""
    pipeline: bool
    """pipeline parallelism: model stages on different ranks"""
    @property
    def pipeline_configs(self) -> PipelineConfigs:
        """pipeline parallelism: model stages on different ranks: settings"""
    @pipeline_configs.setter
    def pipeline_configs(self, value: Mapping[str, Any]) -> None: ...
    sharding: bool
    """sharding (ZeRO): optimizer state, gradients or parameters split across ranks"""
    @property
    def sharding_configs(self) -> ShardingConfigs:
        """sharding (ZeRO): optimizer state, gradients or parameters split across ranks: settings"""
    @sharding_configs.setter
    def sharding_configs(self, value: Mapping[str, Any]) -> None: ...
    tensor_parallel: bool
    """tensor (model) parallelism: weight matrices split across ranks"""
    @property
    def tensor_parallel_configs(self) -> TensorParallelConfigs:
        """tensor (model) parallelism: weight matrices split across ranks: settings"""
    @tensor_parallel_configs.setter
    def tensor_parallel_configs(self, value: Mapping[str, Any]) -> None: ...
    @property
    def hybrid_configs(self) -> HybridConfigs:
        """degrees of Paddle's hybrid parallelism; only dp_degree (data parallelism) is accepted"""
    @hybrid_configs.setter
    def hybrid_configs(self, value: Mapping[str, Any]) -> None: ...
    enable_sequential_execution: bool
    """run ops in program order"""
    fuse_elewise_add_act_ops: bool
    """fuse elementwise add with the following activation"""
    fuse_bn_act_ops: bool
    """fuse batch norm with the following activation"""
    fuse_relu_depthwise_conv: bool
    """fuse ReLU with depthwise convolution"""
    fuse_broadcast_ops: bool
    """broadcast the initial parameters in coalesced buckets"""
    fuse_all_optimizer_ops: bool
    """update all parameters in one fused optimizer step"""
    enable_inplace: bool
    """let op outputs reuse their inputs' memory"""
    enable_backward_optimizer_op_deps: bool
    """start the optimizer update only after the whole backward pass"""
    cache_runtime_context: bool
    """cache each op's runtime context between iterations"""
    memory_optimize: bool
    """reuse variable memory across the program"""
    enable_addto: bool
    """accumulate gradients in place with addto ops"""
    enable_auto_fusion: bool
    """fuse element-wise op groups automatically"""
    fuse_bn_add_act_ops: bool
    """fuse batch norm, add and activation"""
    fuse_gemm_epilogue: bool
    """fuse matmul with the following bias add"""
    fused_attention: bool
    """use the fused multi-head attention op"""
    fused_feedforward: bool
    """use the fused feed-forward op"""
    num_threads: int
    """CPU threads for intra-op parallelism"""
    num_iteration_per_drop_scope: int
    """iterations between two drops of the local scope of temporaries"""
    num_iteration_per_run: int
    """iterations an executor runs per call"""
    use_thread_barrier: bool
    """trainer threads wait on a barrier (parameter-server mode)"""
    fp16_compress: bool
    """Paddle's name of ``fp16_allreduce``"""
    @property
    def fleet_desc_configs(self) -> Tables:
        """Paddle's name of ``sparse_table_configs``"""
    @fleet_desc_configs.setter
    def fleet_desc_configs(self, value: Mapping[str, Mapping[str, Any]]) -> None: ...
    _fuse_grad_size_in_TFLOPS: float
    """Paddle's name of ``fuse_grad_size_in_TFLOPS``"""
    @property
    def hybrid_parallel_order(self) -> list[str]:
        """Paddle's name of ``hybrid_configs['order']``"""
    @hybrid_parallel_order.setter
    def hybrid_parallel_order(self, value: list[str] | tuple[str, ...]) -> None: ...
    @property
    def sync_param_name(self) -> list[str]:
        """Paddle's name of ``hybrid_configs['mp_configs']['sync_param_name']``"""
    @sync_param_name.setter
    def sync_param_name(self, value: list[str] | tuple[str, ...]) -> None: ...
    @property
    def build_strategy(self) -> GroupView:
        """the BuildStrategy fields, as a live view"""
    @build_strategy.setter
    def build_strategy(self, value: Any) -> None: ...
    @property
    def BuildStrategy(self) -> GroupView:
        """the BuildStrategy fields, as a live view"""
    @BuildStrategy.setter
    def BuildStrategy(self, value: Any) -> None: ...
    @property
    def execution_strategy(self) -> GroupView:
        """the ExecutionStrategy fields, as a live view"""
    @execution_strategy.setter
    def execution_strategy(self, value: Any) -> None: ...
    @property
    def ExecutionStrategy(self) -> GroupView:
        """the ExecutionStrategy fields, as a live view"""
    @ExecutionStrategy.setter
    def ExecutionStrategy(self, value: Any) -> None: ...
