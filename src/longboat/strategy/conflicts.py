"""The Strategy's conflict table: pairs of fields that cannot hold these values together.

Checked when the strategy is used (``Strategy.check``: lb.distribute, fleet), not on
assignment, so fields can be set in any order."""

from __future__ import annotations

from longboat.strategy.configs import A_SYNC_CONFIGS, SHARDING_CONFIGS
from longboat.strategy.spec import Conflict, Values, both_on


def _dgc_with_fp16_amp(v: Values) -> bool:
    return v["dgc"] is True and v["amp"] is True and v["amp_configs"]["dtype"] == "float16"


def _ps_configs_in_collective(v: Values) -> bool:
    return v["mode"] == "collective" and v["a_sync_configs"] != A_SYNC_CONFIGS.defaults()


def _sharding_stage(v: Values, *stages: int) -> bool:
    return v["sharding"] is True and v["sharding_configs"]["stage"] in stages


_SHARDING_REFUSED_KEYS = {
    "gradient_merge_acc_step": "use gradient_merge=True with gradient_merge_configs['k_steps']",
    "optimize_offload": "offloading the optimizer state to CPU memory is not implemented",
    "segment_anchors": "the all-gather goes bucket by bucket (fuse_grad_size_in_MB)",
    "mp_degree": "model parallelism is outside data parallelism (torch.distributed.tensor)",
    "pp_degree": "pipeline parallelism is outside data parallelism (torch.distributed.pipelining)",
}


def _on(x: object) -> bool:
    return x is True


_STAGE3_REFUSED = (
    ("dgc", _on, "True", "reduce-scatters whole gradients: use stage 1, or drop dgc"),
    (
        "gradient_compression",
        lambda x: x not in ("none", "fp16", "bf16"),
        "not 'none'/'fp16'/'bf16'",
        "reduce-scatters in one dtype: use 'fp16' or 'bf16' (the reduce dtype), or stage 1",
    ),
    (
        "allreduce_algorithm",
        lambda x: x not in ("topology", "native"),
        "not 'topology'/'native'",
        "reduces with the backend's own collectives: use 'native', or stage 1",
    ),
    (
        "use_hierarchical_allreduce",
        _on,
        "True",
        "reduces with its own collectives: sharding_degree below the world size shards "
        "within groups and replicates across them (HSDP)",
    ),
    *(
        (name, _on, "True", f"keeps parameters as shards, and {what}: use stage 1 or 2")
        for name, what in (
            ("lars", "LARS's layer norms are not taken over them"),
            ("lamb", "LAMB's layer norms are not taken over them"),
            ("sync_batch_norm", "sync BN is not supported on them"),
        )
    ),
    (
        "timeline",
        lambda x: x is not None,
        "set",
        "reduces inside FSDP2, and the timeline records longboat's reducer: drop timeline",
    ),
    *(
        (name, _on, "True", "wraps the module before it is compiled: compile it yourself")
        for name in ("fuse_elewise_add_act_ops", "fuse_bn_act_ops", "fuse_relu_depthwise_conv")
    ),
)


def _sharding_key_refused(v: Values) -> bool:
    c = v["sharding_configs"]
    return v["sharding"] is True and any(
        c[k] != SHARDING_CONFIGS.defaults()[k] for k in _SHARDING_REFUSED_KEYS
    )


_SHARDING_CONFLICTS: tuple[Conflict, ...] = (
    *(
        Conflict(
            "sharding",
            other,
            lambda v, o=other, bad=bad: _sharding_stage(v, 3) and bad(v[o]),
            f"sharding stage 3 runs on torch's FSDP2, which {why}",
            f"sharding True with sharding_configs['stage'] == 3 and {other} {what}",
        )
        for other, bad, what, why in _STAGE3_REFUSED
    ),
    Conflict(
        "sharding",
        "sharding_configs",
        _sharding_key_refused,
        "these sharding_configs keys are not implemented: "
        + "; ".join(f"{k}: {why}" for k, why in _SHARDING_REFUSED_KEYS.items())
        + "; set them back to their defaults",
        "sharding True and any of " + ", ".join(_SHARDING_REFUSED_KEYS) + " not at its default",
    ),
    Conflict(
        "sharding",
        "mode",
        lambda v: v["sharding"] is True and v["mode"] == "ps",
        "in mode='ps' the servers hold the optimizer state already; sharding splits it across "
        "collective trainers: use mode='collective', or drop sharding",
        "sharding True and mode == 'ps'",
    ),
    both_on(
        "sharding",
        "find_unused_parameters",
        "a parameter no rank used is skipped by a plain optimizer, but it is part of a flat "
        "shard under sharding and would still move (momentum, weight decay); make every "
        "parameter take part in the loss, or freeze it (requires_grad_(False))",
    ),
    *(
        both_on(
            "sharding",
            other,
            f"{what} trains each rank on its own gradients between averagings, and under "
            "sharding a rank steps only its slice of the parameters: drop one",
        )
        for other, what in (("localsgd", "local SGD"), ("adaptive_localsgd", "adaptive local SGD"))
    ),
    both_on(
        "sharding",
        "auto",
        "auto swaps the gradient reducer while training, and the shards are laid out over "
        "its buckets; set the communication settings yourself, or drop sharding",
    ),
    *(
        Conflict(
            "sharding",
            other,
            lambda v, o=other: _sharding_stage(v, 2) and v[o] is True,
            f"sharding stage 2 reduce-scatters every step's gradients; {why}: use "
            "sharding_configs['stage']=1, or drop one",
            f"sharding True with sharding_configs['stage'] == 2 and {other} True",
        )
        for other, why in (("dgc", "DGC sends sparse top-k allreduces instead"),)
    ),
    Conflict(
        "sharding",
        "gradient_compression",
        lambda v: (
            _sharding_stage(v, 2) and v["gradient_compression"] not in ("none", "fp16", "bf16")
        ),
        "sharding stage 2 reduce-scatters the gradients (in float16 or bfloat16 when asked), "
        "and the other compressors compress allreduces: use sharding_configs['stage']=1, or "
        "gradient_compression 'none', 'fp16' or 'bf16'",
        "sharding True with sharding_configs['stage'] == 2 and gradient_compression not "
        "'none'/'fp16'/'bf16'",
    ),
    Conflict(
        "sharding",
        "allreduce_algorithm",
        lambda v: (
            _sharding_stage(v, 2)
            and (
                v["allreduce_algorithm"] not in ("topology", "native")
                or v["use_hierarchical_allreduce"] is True
            )
        ),
        "sharding stage 2 reduce-scatters with the backend's own collective, not an allreduce "
        "algorithm: use allreduce_algorithm='topology' or 'native', or "
        "sharding_configs['stage']=1",
        "sharding True with sharding_configs['stage'] == 2 and allreduce_algorithm not "
        "'topology'/'native' (or use_hierarchical_allreduce True)",
    ),
)


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
            and v["allreduce_algorithm"] not in ("topology", "native", "hierarchical")
        ),
        "use_hierarchical_allreduce=True selects the hierarchical algorithm; it cannot also be "
        "another one",
        "use_hierarchical_allreduce True and allreduce_algorithm not "
        "'topology'/'native'/'hierarchical'",
    ),
    Conflict(
        "mode",
        "a_sync_configs",
        _ps_configs_in_collective,
        "a_sync_configs only configures the parameter-server mode; set mode='ps' or remove them",
        "mode == 'collective' and any a_sync_configs key is not at its default",
    ),
    Conflict(
        "mode",
        "sparse_table_configs",
        lambda v: v["mode"] == "collective" and bool(v["sparse_table_configs"]),
        "sparse tables live on parameter servers; set mode='ps' (fleet.init() without "
        "is_collective does) or remove sparse_table_configs",
        "mode == 'collective' and sparse_table_configs not empty",
    ),
    Conflict(
        "recompute",
        "recompute_configs",
        lambda v: v["recompute"] is True and not v["recompute_configs"]["checkpoints"],
        "recompute needs the submodules to recompute: set recompute_configs['checkpoints'] "
        "to names from model.named_modules()",
        "recompute True and recompute_configs['checkpoints'] empty",
    ),
    *_SHARDING_CONFLICTS,
)
"""Declarative conflict rules, checked when the strategy is used (``Strategy.check``)."""
