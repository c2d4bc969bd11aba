"""The Strategy's conflict table: pairs of fields that cannot hold these values together.

Checked when the strategy is used (``Strategy.check``: lb.distribute, fleet), not on
assignment, so fields can be set in any order."""

from __future__ import annotations

from longboat.strategy.configs import A_SYNC_CONFIGS
from longboat.strategy.spec import Conflict, Values, both_on


def _dgc_with_fp16_amp(v: Values) -> bool:
    return v["dgc"] is True and v["amp"] is True and v["amp_configs"]["dtype"] == "float16"


def _ps_configs_in_collective(v: Values) -> bool:
    return v["mode"] == "collective" and v["a_sync_configs"] != A_SYNC_CONFIGS.defaults()


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
)
"""Declarative conflict rules, checked when the strategy is used (``Strategy.check``)."""
