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
from dataclasses import dataclass
from typing import Any

from longboat.strategy.values import Choice, Float, Int, Rejected, ValueType, closest

SGD_RULES = {
    "SparseNaiveSGDRule": "sgd",
    "SparseAdaGradSGDRule": "adagrad",
    "SparseAdamSGDRule": "adam",
}
"""Paddle's embedding update rules and the longboat server optimizer each maps to."""
RULE_BLOCK = {"SparseNaiveSGDRule": "naive", "SparseAdaGradSGDRule": "adagrad",
              "SparseAdamSGDRule": "adam"}  # fmt: skip
SGD = "accessor.embedx_sgd_param"

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
    "(SparseNaiveSGDRule, SparseAdaGradSGDRule, SparseAdamSGDRule)",
}

_SHORT_VALUES = {
    "sparse_table_class": {"DownpourSparseTable": "MemorySparseTable"},
    "sparse_accessor_class": {"DownpourSparseValueAccessor": "SparseAccessor"},
    "sparse_optimizer": {"naive": "SparseNaiveSGDRule", "adagrad": "SparseAdaGradSGDRule",
                         "adam": "SparseAdamSGDRule"},
}  # fmt: skip
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


@dataclass(frozen=True)
class TableConfigs(ValueType):
    """``{table name: {setting: value}}``, settings normalised to ``TableParameter`` paths."""

    short: str = "dict[str, dict[str, value]] (table name -> settings)"

    def check(self, value: Any) -> dict[str, dict[str, Any]]:
        if not isinstance(value, Mapping):
            raise Rejected()
        out: dict[str, dict[str, Any]] = {}
        for table, settings in value.items():
            if not isinstance(table, str) or not table or not isinstance(settings, Mapping):
                raise Rejected(f"table {table!r} needs a name and a dict of settings")
            out[table] = normalise(table, settings)
        return out

    def plain(self, value: Any) -> dict[str, dict[str, Any]]:
        return {t: dict(s) for t, s in value.items()}


def normalise(table: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` of ``table`` under ``TableParameter`` paths, each value checked."""
    rule = settings.get("sparse_optimizer")
    rule = _SHORT_VALUES["sparse_optimizer"].get(rule, rule) if isinstance(rule, str) else None
    rule = rule or settings.get(f"{SGD}.name") or DEFAULT_RULE
    out: dict[str, Any] = {}
    for key, value in settings.items():
        path = _path(table, str(key), rule if isinstance(rule, str) else DEFAULT_RULE)
        if path in out:
            raise Rejected(f"table {table!r}: {key!r} sets {path!r} twice")
        if key in _SHORT_VALUES and isinstance(value, str):
            value = _SHORT_VALUES[key].get(value, value)
        out[path] = _checked(table, key, path, value)
    return out


def _path(table: str, key: str, rule: str) -> str:
    prefix = f"table_parameters.{table}."
    path = key.removeprefix(prefix)
    if key in _SHORT_FIXED:
        path = _SHORT_FIXED[key]
    elif key in _SHORT_RULE:
        path = f"{SGD}.{RULE_BLOCK.get(rule, 'adagrad')}.{_SHORT_RULE[key]}"
    if path in PATHS:
        return path
    why = REFUSED_KEYS.get(path) or REFUSED_KEYS.get(path.rsplit(".", 1)[-1])
    if why:
        raise Rejected(f"table {table!r}: {key!r} cannot be honoured: {why}")
    best = closest(key, [*PATHS, *SHORT_KEYS])
    hint = f"; did you mean {best!r}?" if best else ""
    raise Rejected(
        f"table {table!r}: {key!r} is not a sparse table setting longboat honours{hint} "
        f"(valid: {', '.join(SHORT_KEYS)}, or the TableParameter paths {', '.join(PATHS)})"
    )


def _checked(table: str, key: str, path: str, value: Any) -> Any:
    vtype = PATHS[path]
    try:
        return vtype.check(value)
    except Rejected:
        why = f": {REFUSED_VALUES[path]}" if path in REFUSED_VALUES else ""
        raise Rejected(f"table {table!r}: {key}={value!r} is not {vtype.describe()}{why}") from None
