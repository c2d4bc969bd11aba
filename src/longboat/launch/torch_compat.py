"""torch's elastic launcher API as each torch release longboat supports (2.11 on) spells it.

Settings that only some releases have are found by looking at the installed torch (the fields
of its dataclasses, the parameters of its agent), never by comparing version numbers. A setting
this torch lacks is left out with a debug log; the caller decides whether longboat applies it
itself (the shutdown grace period: see `agent_accepts`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.launcher.api import LaunchConfig

__all__ = ["agent_accepts", "launch_config", "worker_spec"]

_log = logging.getLogger("longboat.launch")

#: `LaunchConfig` settings that torch's own ``launch_agent`` copies into the `WorkerSpec`.
_SPEC_SETTINGS = (
    "event_log_handler",
    "numa_options",
    "duplicate_stdout_filters",
    "duplicate_stderr_filters",
    "virtual_local_rank",
)


def field_names(cls: type) -> frozenset[str]:
    """The fields of dataclass ``cls``."""
    return frozenset(f.name for f in dataclasses.fields(cls))


def parameter_names(func: Any) -> frozenset[str] | None:
    """The keyword-passable parameters of ``func``; None when it takes any (``**kwargs``)."""
    params = inspect.signature(func).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    passable = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params if p.kind in passable)


def _known(what: str, known: frozenset[str] | None, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` less the names this torch's ``what`` does not have (logged at debug level)."""
    if known is None:
        return dict(values)
    missing = sorted(set(values) - known)
    if missing:
        _log.debug("torch %s: %s has no %s; left out", torch.__version__, what, ", ".join(missing))
    return {name: value for name, value in values.items() if name in known}


def launch_config(**settings: Any) -> LaunchConfig:
    """A `LaunchConfig` with the ``settings`` this torch's LaunchConfig has."""
    return LaunchConfig(**_known("LaunchConfig", field_names(LaunchConfig), settings))


def worker_spec(config: Any, **settings: Any) -> WorkerSpec:
    """A `WorkerSpec` from ``settings`` plus the settings torch copies from ``config`` (a
    `LaunchConfig`), each where both this torch's LaunchConfig and WorkerSpec have it."""
    copied = {name: getattr(config, name) for name in _SPEC_SETTINGS if hasattr(config, name)}
    return WorkerSpec(**_known("WorkerSpec", field_names(WorkerSpec), copied | settings))


@functools.cache
def _agent_parameters(agent: type) -> frozenset[str] | None:
    return parameter_names(agent.__init__)


def agent_accepts(name: str) -> bool:
    """Whether this torch's `LocalElasticAgent` takes the keyword argument ``name``."""
    known = _agent_parameters(LocalElasticAgent)
    return known is None or name in known
