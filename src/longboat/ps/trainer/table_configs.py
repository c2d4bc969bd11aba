"""Apply ``Strategy.sparse_table_configs`` (Paddle's table settings, checked and normalised
by ``longboat.strategy.sparse_tables``) to the model's ``SparseEmbedding`` tables."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import nn

from longboat.ps.trainer.sparse import SparseEmbedding
from longboat.strategy import StrategyError
from longboat.strategy.sparse_tables import DEFAULT_RULE, RULE_BLOCK, SGD, SGD_RULES

PADDLE_INITIAL_G2SUM = 3.0  # Paddle's default initial_g2sum of SparseAdaGradSGDRule
_RULE_OF = {v: k for k, v in SGD_RULES.items()}


def apply_sparse_table_configs(model: nn.Module, configs: Mapping[str, Mapping[str, Any]]) -> None:
    """Set each named table's optimizer, hyper-parameters, initial range, laziness and
    eviction from ``configs``; StrategyError naming a table the model does not have."""
    tables = {m.name: m for m in model.modules() if isinstance(m, SparseEmbedding)}
    for name, settings in configs.items():
        table = tables.get(name)
        if table is None:
            known = ", ".join(sorted(tables)) or "none"
            raise StrategyError(
                f"Strategy.sparse_table_configs names table {name!r}, but the model has no "
                f"SparseEmbedding of that name (its tables: {known}); use the name= given to "
                "SparseEmbedding"
            )
        _apply(table, settings)


def _apply(table: SparseEmbedding, settings: Mapping[str, Any]) -> None:
    dim = settings.get("accessor.embedx_dim")
    if dim is not None and dim != table.embedding_dim:
        raise StrategyError(
            f"sparse_table_configs[{table.name!r}] sets embedx_dim={dim}, but the "
            f"SparseEmbedding has embedding_dim={table.embedding_dim}; make them equal"
        )
    rule = settings.get(f"{SGD}.name") or _RULE_OF.get(table.optimizer, DEFAULT_RULE)
    block = RULE_BLOCK[rule]
    for path in settings:
        parts = path.split(".")
        if path.startswith(f"{SGD}.") and len(parts) == 4 and parts[2] != block:
            raise StrategyError(
                f"sparse_table_configs[{table.name!r}] sets {path}, but the table's update rule "
                f"is {rule} (its settings go under {SGD}.{block}); set {SGD}.name to match"
            )
    own = {k.rsplit(".", 1)[-1]: v for k, v in settings.items() if k.startswith(f"{SGD}.{block}.")}
    optimizer = SGD_RULES[rule]
    hparams = dict(table.hparams) if optimizer == table.optimizer else {"lr": table.hparams["lr"]}
    if "learning_rate" in own:
        hparams["lr"] = own["learning_rate"]
    if optimizer == "adagrad" and {"learning_rate", "initial_g2sum"} & set(own):
        # Paddle scales the step by sqrt(g2sum0 / (g2sum0 + sum g^2)); torch's Adagrad divides by
        # sqrt(acc0 + sum g^2): the same with lr * sqrt(g2sum0) and acc0 = g2sum0
        g2sum = float(own.get("initial_g2sum", PADDLE_INITIAL_G2SUM))
        hparams["lr"] = float(hparams["lr"]) * math.sqrt(g2sum)
        hparams["initial_accumulator_value"] = g2sum
    if optimizer == "adam":
        betas = list(hparams.get("betas", [0.9, 0.999]))
        betas[0] = own.get("beta1_decay_rate", betas[0])
        betas[1] = own.get("beta2_decay_rate", betas[1])
        hparams["betas"] = betas
        if "ada_epsilon" in own:
            hparams["eps"] = own["ada_epsilon"]
    table.optimizer, table.hparams = optimizer, hparams
    if "initial_range" in own:
        table.init_scale = float(own["initial_range"])
    days = settings.get("accessor.ctr_accessor_param.delete_after_unseen_days")
    if days is not None:
        table.evict_after = int(days)
    if "table_class" in settings or days:
        table.lazy = True  # Paddle's tables create rows on first use
