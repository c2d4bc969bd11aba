"""Which allreduce algorithm and gradient compressor a Strategy selects: the one rule the
collective engine, the auto-tuner and the timeline share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from longboat.registry import ALGORITHMS, COMPRESSORS, Entry

if TYPE_CHECKING:
    from longboat.strategy.core import Strategy


@dataclass(frozen=True)
class AllreduceChoice:
    """The selected algorithm, its timeline label, and whether the start-up broadcast of rank
    0's state goes through it (its declaration says so)."""

    algorithm: str
    label: str
    broadcast: bool


def selected_algorithm(strategy: Strategy) -> str:
    """The allreduce algorithm ``strategy`` selects (``use_hierarchical_allreduce`` wins)."""
    if strategy.use_hierarchical_allreduce:
        return "hierarchical"
    return str(strategy.allreduce_algorithm)


def allreduce_choice(strategy: Strategy) -> AllreduceChoice:
    """The selected algorithm with its label (``+fp16`` under ``fp16_allreduce``)."""
    name = selected_algorithm(strategy)
    label = f"{name}+fp16" if strategy.fp16_allreduce else name
    return AllreduceChoice(name, label, ALGORITHMS.entry(name).broadcast)


def selected_compressor(strategy: Strategy) -> Entry:
    """The compressor ``strategy`` selects: one whose ``switch`` field is on, else ``fp16``
    under ``fp16_allreduce``, else ``gradient_compression`` ('none' counts bytes only)."""
    for entry in COMPRESSORS.entries():
        if entry.switch is not None and getattr(strategy, entry.switch) is True:
            return entry
    name = "fp16" if strategy.fp16_allreduce else str(strategy.gradient_compression)
    return COMPRESSORS.entry(name)


def compressor_config(strategy: Strategy, entry: Entry) -> dict[str, Any]:
    """``entry``'s ``<name>_configs`` as a plain dict ({} when it declares no config)."""
    if entry.config is None:
        return {}
    return entry.config.plain(getattr(strategy, f"{entry.name}_configs"))
