"""longboat: data-parallel distributed training for PyTorch.

    import longboat as lb
    lb.init()
    model, optimizer = lb.distribute(model, optimizer, lb.Strategy(nccl_comm_num=2))

Names are imported on first use, so `import longboat` stays cheap for the CLI and launcher.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and editors see of the names imported on first use
    from longboat.strategy import DistributedStrategy as DistributedStrategy
    from longboat.strategy import Strategy as Strategy
    from longboat.strategy import StrategyError as StrategyError

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Strategy": "longboat.strategy",
    "DistributedStrategy": "longboat.strategy",
    "StrategyError": "longboat.strategy",
    "init": "longboat.session",
    "is_initialized": "longboat.cluster",
    "cluster_info": "longboat.cluster:cluster",
    "topology": "longboat.cluster",
    "rank": "longboat.cluster",
    "world_size": "longboat.cluster",
    "local_rank": "longboat.cluster",
    "local_world_size": "longboat.cluster",
    "node_rank": "longboat.cluster",
    "num_nodes": "longboat.cluster",
    "barrier": "longboat.cluster",
    "shutdown": "longboat.cluster",
    "distribute": "longboat.dispatch",
    "compile": "longboat.integrations.compile:compile_model",
    "ddp_comm_hook": "longboat.integrations.ddp_hook",
    "DistributedSampler": "longboat.data.sampler",
    "SyncBatchNorm": "longboat.collective.sync_bn",
    "convert_sync_batchnorm": "longboat.collective.sync_bn",
    "save_checkpoint": "longboat.checkpoint",
    "load_checkpoint": "longboat.checkpoint",
    "save_sharded_checkpoint": "longboat.sharding.checkpoint",
    "load_sharded_checkpoint": "longboat.sharding.checkpoint",
    "is_server": "longboat.launch.roles",
    "is_worker": "longboat.launch.roles",
    "ps": "longboat.ps",
    "log_every": "longboat.metrics",
    "LogEvery": "longboat.metrics",
    "trace": "longboat.trace",
    "elastic": "longboat.elastic",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'longboat' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    imported = importlib.import_module(module)
    value = imported if module == f"longboat.{name}" else getattr(imported, attr or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
