"""The Strategy's field table: the three groups' tables, in order, as one ``FIELDS``.

Field names, defaults and groups follow PaddlePaddle Fleet's ``DistributedStrategy`` (the
DistributedStrategy, BuildStrategy and ExecutionStrategy tables of Paddle's collective-training
guide) and its ``*_configs`` dicts. Adding a field is one ``FieldSpec`` in its group's table:
``fields_distributed``, ``fields_build`` or ``fields_execution``. The choices of
``allreduce_algorithm`` and ``gradient_compression``, and one ``<name>_configs`` field per
gradient compressor that declares a config, come from the registries (``longboat.registry``)
when first used.
"""

from __future__ import annotations

from longboat.strategy.fields_build import BUILD_FIELDS
from longboat.strategy.fields_distributed import DISTRIBUTED_FIELDS
from longboat.strategy.fields_execution import EXECUTION_FIELDS
from longboat.strategy.registered import FieldTable

TRAINING_OPT = "training optimisations"

FIELDS = FieldTable((*DISTRIBUTED_FIELDS, *BUILD_FIELDS, *EXECUTION_FIELDS))
