"""The Strategy: every distributed-training setting, typed, validated and explained.

Fields follow PaddlePaddle Fleet's ``DistributedStrategy`` (DistributedStrategy, BuildStrategy and
ExecutionStrategy tables). The field table lives in ``longboat.strategy.fields`` (one
module per group: ``fields_distributed``, ``fields_build``, ``fields_execution``; the
per-feature config tables in ``configs``, the conflict rules in ``conflicts``, what comes from
the algorithm and compressor registries in ``registered``); validation, defaults, environment
overrides, docs and the printed table all derive from it.
"""

from __future__ import annotations

from longboat.strategy.conflicts import CONFLICTS
from longboat.strategy.core import (
    KNOWN_ENV_VARS,
    ConfigView,
    DistributedStrategy,
    GroupView,
    Strategy,
    field_spec,
    fields_by_status,
)
from longboat.strategy.fields import FIELDS
from longboat.strategy.render import plugins_markdown, reference_markdown
from longboat.strategy.spec import Conflict, FieldSpec, Status
from longboat.strategy.values import StrategyError, UnknownFieldError

__all__ = [
    "CONFLICTS",
    "FIELDS",
    "KNOWN_ENV_VARS",
    "Conflict",
    "ConfigView",
    "DistributedStrategy",
    "FieldSpec",
    "GroupView",
    "Status",
    "Strategy",
    "StrategyError",
    "UnknownFieldError",
    "field_spec",
    "fields_by_status",
    "plugins_markdown",
    "reference_markdown",
]
