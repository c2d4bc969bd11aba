"""Elastic training: lose a node or gain one and keep training, from memory.

    state = lb.elastic.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

    @lb.elastic.run
    def train(state):
        ...
        state.commit()

Run it with ``longboat launch --nnodes MIN:MAX``; see docs/elastic.md.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ElasticError",
    "ElasticSampler",
    "MembershipChanged",
    "ShardsLostError",
    "State",
    "StateLostError",
    "StateMismatchError",
    "is_elastic",
    "run",
    "schedule",
]

_WHERE = {
    "ElasticError": "longboat.elastic.membership",
    "ElasticSampler": "longboat.elastic.sampler",
    "schedule": "longboat.elastic.sampler",
    "MembershipChanged": "longboat.elastic.world",
    "is_elastic": "longboat.elastic.world",
    "ShardsLostError": "longboat.elastic.reshard",
    "State": "longboat.elastic.state",
    "StateMismatchError": "longboat.elastic.state",
    "StateLostError": "longboat.elastic.recovery",
    "run": "longboat.elastic.run",
}


def __getattr__(name: str) -> Any:
    """Import on first use: `longboat.cluster` reads the membership module at start-up."""
    if name not in _WHERE:
        raise AttributeError(f"module 'longboat.elastic' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
