"""``sparse_table_configs``: Paddle's parameter-server table settings, as far as longboat's
sparse tables (``longboat.ps.SparseEmbedding``) can honour them.

Each table's settings are stored under Paddle's ``TableParameter`` paths relative to the table
(``accessor.embedx_sgd_param.adagrad.learning_rate``). Three spellings are accepted: those
paths, the same prefixed with ``table_parameters.<table>.`` (Paddle's ``sparse_table_configs``
keys) and Paddle's short ``sparse_*`` keys (``fleet_desc_configs``). A key longboat cannot
honour is refused, naming it and the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from longboat.strategy.values import Choice, Float, Int, Rejected, ValueType, closest

SGD_RULES = {
    "SparseNaiveSGDRule": "sgd",
    "StdAdaGradSGDRule": "adagrad",
    "SparseAdaGradSGDRule": "adagrad",
    "SparseAdamSGDRule": "adam",
}
"""Paddle's embedding update rules and the longboat server optimizer each maps to
(StdAdaGradSGDRule keeps a sum of squares per element, as torch's Adagrad does)."""
RULE_BLOCK = {"SparseNaiveSGDRule": "naive", "StdAdaGradSGDRule": "adagrad",
              "SparseAdaGradSGDRule": "adagrad", "SparseAdamSGDRule": "adam"}  # fmt: skip
SGD = "accessor.embedx_sgd_param"
RULE_DEFAULTS: dict[str, dict[str, Any]] = {
    "naive": {"learning_rate": 0.05, "initial_range": 1e-4},
    "adagrad": {"learning_rate": 0.05, "initial_range": 1e-4, "initial_g2sum": 3.0},
    "adam": {"learning_rate": 0.001, "initial_range": 1e-4, "beta1_decay_rate": 0.9,
             "beta2_decay_rate": 0.999, "ada_epsilon": 1e-8},
}  # fmt: skip
"""What Paddle's ``fleet_desc_configs`` setter fills in for each update rule's block."""
FLEET_DESC_DEFAULTS: dict[str, Any] = {
    "table_class": "MemorySparseTable",
    "accessor.accessor_class": "SparseAccessor",
    "accessor.ctr_accessor_param.delete_after_unseen_days": 30,
}
"""Paddle's ``fleet_desc_configs`` defaults of the table settings longboat honours (the accessor:
longboat's tables are plain embedding rows; Paddle's default is its CTR accessor)."""

_POSITIVE = Float(0, lo_open=True)
_UNIT = Float(0, 1, hi_open=True)

PATHS: dict[str, ValueType] = {
    "table_class": Choice(("MemorySparseTable",)),
    "accessor.accessor_class": Choice(("SparseAccessor",)),
    "accessor.embedx_dim": Int(1),
    f"{SGD}.name": Choice(tuple(SGD_RULES)),
    **{f"{SGD}.{block}.learning_rate": _POSITIVE for block in ("naive", "adagrad", "adam")},
    **{f"{SGD}.{block}.initial_range": Float(0) for block in ("naive", "adagrad", "adam")},
    f"{SGD}.adagrad.initial_g2sum": _POSITIVE,
    f"{SGD}.adam.beta1_decay_rate": _UNIT,
    f"{SGD}.adam.beta2_decay_rate": _UNIT,
    f"{SGD}.adam.ada_epsilon": _POSITIVE,
    "accessor.ctr_accessor_param.delete_after_unseen_days": Int(0),
}
"""Every ``TableParameter`` path longboat honours, with its value type."""

REFUSED_VALUES: dict[str, str] = {
    "table_class": "only the in-memory hash table exists ('MemorySparseTable'): longboat's "
    "lazy tables keep their rows in server memory, there is no SSD table",
    "accessor.accessor_class": "only 'SparseAccessor' (plain embedding rows): longboat's "
    "tables keep no show/click statistics, so the CTR accessors cannot work; set "
    "sparse_accessor_class='DownpourSparseValueAccessor' (use_cvm=False in Paddle)",
    f"{SGD}.name": "longboat's server optimizers are SGD, Adagrad and Adam "
    "(SparseNaiveSGDRule, SparseAdaGradSGDRule or StdAdaGradSGDRule, SparseAdamSGDRule)",
}
RULES_REFUSED = {
    "SparseSharedAdamSGDRule": "SparseSharedAdamSGDRule keeps one pair of Adam moments per row, "
    "longboat's Adam one per element: use 'adam' (SparseAdamSGDRule)",
}

_SHORT_VALUES = {
    "sparse_table_class": {"DownpourSparseTable": "MemorySparseTable"},
    "sparse_accessor_class": {"DownpourSparseValueAccessor": "SparseAccessor"},
    "sparse_optimizer": {"naive": "SparseNaiveSGDRule", "adagrad": "SparseAdaGradSGDRule",
                         "std_adagrad": "StdAdaGradSGDRule", "adam": "SparseAdamSGDRule",
                         "shared_adam": "SparseSharedAdamSGDRule"},
}  # fmt: skip
_EMBEDX = "embedx_"  # Paddle's prefix of the short keys with accessors other than its CTR ones
_SHORT_FIXED = {
    "sparse_table_class": "table_class",
    "sparse_accessor_class": "accessor.accessor_class",
    "sparse_embedx_dim": "accessor.embedx_dim",
    "sparse_optimizer": f"{SGD}.name",
    "sparse_delete_after_unseen_days": "accessor.ctr_accessor_param.delete_after_unseen_days",
}
_SHORT_RULE = {  # short key -> key inside the block of the chosen rule
    "sparse_learning_rate": "learning_rate",
    "sparse_initial_range": "initial_range",
    "sparse_initial_g2sum": "initial_g2sum",
    "sparse_beta1_decay_rate": "beta1_decay_rate",
    "sparse_beta2_decay_rate": "beta2_decay_rate",
    "sparse_ada_epsilon": "ada_epsilon",
}
SHORT_KEYS = (*_SHORT_FIXED, *_SHORT_RULE)
DEFAULT_RULE = "SparseAdaGradSGDRule"  # Paddle's sparse_optimizer default

REFUSED_KEYS: dict[str, str] = {
    "shard_num": "rows are sharded by id across the servers (id % servers); there are no "
    "shards inside a server",
    "sparse_shard_num": "rows are sharded by id across the servers (id % servers); there are no "
    "shards inside a server",
    "accessor.embedx_threshold": "Paddle's show/click score threshold has no counterpart; "
    "longboat admits rows by update count: SparseEmbedding(admit_count=n, lazy=True)",
    "sparse_embedx_threshold": "Paddle's show/click score threshold has no counterpart; "
    "longboat admits rows by update count: SparseEmbedding(admit_count=n, lazy=True)",
    "weight_bounds": "longboat's server optimizers do not clip weights",
    "sparse_weight_bounds": "longboat's server optimizers do not clip weights",
    "accessor.fea_dim": "the row width is the SparseEmbedding's embedding_dim (embedx_dim)",
    "sparse_fea_dim": "the row width is the SparseEmbedding's embedding_dim (embedx_dim)",
}
"""Known Paddle keys that cannot be honoured, and why (matched on the last path parts)."""
_EMBED = (
    "embed_sgd_param is the update rule of the one-wide embed_w column Paddle's accessors keep "
    "beside the embedding; a longboat table row is the embedding alone (embedx, the "
    "SparseEmbedding's embedding_dim): set the embedx rule instead ("
)
_CTR = (
    "a show/click statistic of Paddle's CTR accessors; longboat's tables keep no show/click "
    "statistics (use sparse_accessor_class='DownpourSparseValueAccessor')"
)
PS_FIELDS_REFUSED: dict[str, str] = {
    "adam_d2sum": "it picks Paddle's d2sum variant of Adam for the dense parameters on the "
    "servers; longboat's servers run torch's Adam (fleet.distributed_optimizer(torch.optim.Adam("
    "...)))",
    "fs_client_param": "it configures the HDFS client Paddle's servers save tables through; "
    "longboat's servers write checkpoints to a directory (longboat launch --checkpoint-dir): "
    "mount the file system there",
}
"""Paddle's parameter-server DistributedStrategy fields with no counterpart, and why."""
REFUSED_PREFIXES: dict[str, str] = {
    "accessor.embed_sgd_param.": _EMBED + f"{SGD}.<rule>.<key>, or the sparse_* keys)",
    "embed_sparse_": _EMBED + "the embedx_sparse_* or sparse_* keys)",
    "accessor.ctr_accessor_param.": _CTR,
    "accessor.table_accessor_save_param.": "Paddle pipes each save mode's table files through "
    "these converter commands; longboat writes its own checkpoint files and runs no converter "
    "(convert the files fleet.save_persistables / lb.ps.save() writes, if needed)",
}
"""Known Paddle key prefixes that cannot be honoured, and why."""
for _key in ("nonclk_coeff", "click_coeff", "base_threshold", "delta_threshold",
             "delta_keep_days", "show_click_decay_rate", "delete_threshold"):  # fmt: skip
    REFUSED_KEYS[f"sparse_{_key}"] = _CTR


def fleet_desc(value: Any) -> Any:
    """Paddle's ``fleet_desc_configs`` setter: each table's settings, normalised, over what
    that setter fills in (``fleet_desc_defaults``). A value that is not valid is returned as
    given, for the field's check to refuse."""
    if not isinstance(value, Mapping):
        return value
    out: dict[str, Any] = {}
    for table, settings in value.items():
        if not isinstance(table, str) or not isinstance(settings, Mapping):
            return value
        try:
            given = normalise(table, settings)
        except Rejected:
            return value
        out[table] = {**fleet_desc_defaults(given), **given}
    return out


def fleet_desc_defaults(settings: Mapping[str, Any]) -> dict[str, Any]:
    """What Paddle's ``fleet_desc_configs`` setter fills in for a table, of the settings
    longboat honours: the table and accessor class, the days before unseen rows go, and the
    update rule (Paddle's default: Adagrad) with its block's defaults."""
    rule = settings.get(f"{SGD}.name", DEFAULT_RULE)
    prefix = f"{SGD}.{RULE_BLOCK[rule]}."
    block = {prefix + key: value for key, value in RULE_DEFAULTS[RULE_BLOCK[rule]].items()}
    return {**FLEET_DESC_DEFAULTS, f"{SGD}.name": rule, **block}


def normalise(table: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` of ``table`` under ``TableParameter`` paths, each value checked."""
    short = {str(k): _unprefixed(str(k)) for k in settings}
    rules = [v for k, v in settings.items() if short[str(k)] == "sparse_optimizer"]
    rule = rules[0] if rules and isinstance(rules[0], str) else None
    rule = _SHORT_VALUES["sparse_optimizer"].get(rule, rule) if rule else None
    rule = rule or settings.get(f"{SGD}.name") or DEFAULT_RULE
    out: dict[str, Any] = {}
    for key, value in settings.items():
        name = short[str(key)]
        path = _path(table, name, rule if isinstance(rule, str) else DEFAULT_RULE, str(key))
        if path in out:
            raise Rejected(f"table {table!r}: {key!r} sets {path!r} twice")
        if name in _SHORT_VALUES and isinstance(value, str):
            value = _SHORT_VALUES[name].get(value, value)
        out[path] = _checked(table, key, path, value)
    return out


def _unprefixed(key: str) -> str:
    """Paddle's ``embedx_sparse_*`` keys (its spelling for accessors other than its CTR ones)
    as the ``sparse_*`` keys."""
    return key.removeprefix(_EMBEDX) if key.startswith(_EMBEDX + "sparse_") else key


def refusal(path: str) -> str | None:
    """Why the Paddle key or path ``path`` cannot be honoured, if it is a known one."""
    return (
        REFUSED_KEYS.get(path)
        or REFUSED_KEYS.get(path.rsplit(".", 1)[-1])
        or next((why for p, why in REFUSED_PREFIXES.items() if f"{path}.".startswith(p)), None)
    )


def _path(table: str, key: str, rule: str, given: str) -> str:
    """The ``TableParameter`` path of ``key`` (``given`` by the user: messages name it)."""
    prefix = f"table_parameters.{table}."
    path = key.removeprefix(prefix)
    if key in _SHORT_FIXED:
        path = _SHORT_FIXED[key]
    elif key in _SHORT_RULE:
        path = f"{SGD}.{RULE_BLOCK.get(rule, 'adagrad')}.{_SHORT_RULE[key]}"
    if path in PATHS:
        return path
    why = refusal(path)
    if why:
        raise Rejected(f"table {table!r}: {given!r} cannot be honoured: {why}")
    best = closest(given, [*PATHS, *SHORT_KEYS])
    hint = f"; did you mean {best!r}?" if best else ""
    raise Rejected(
        f"table {table!r}: {given!r} is not a sparse table setting longboat honours{hint} "
        f"(valid: {', '.join(SHORT_KEYS)}, or the TableParameter paths {', '.join(PATHS)})"
    )


def _checked(table: str, key: str, path: str, value: Any) -> Any:
    vtype = PATHS[path]
    try:
        return vtype.check(value)
    except Rejected:
        why = RULES_REFUSED.get(value) if isinstance(value, str) else None
        why = f": {why or REFUSED_VALUES[path]}" if why or path in REFUSED_VALUES else ""
        raise Rejected(f"table {table!r}: {key}={value!r} is not {vtype.describe()}{why}") from None
