"""What the timeline and the stall inspector are asked to do: a frozen config built once.

``lb.distribute`` (collective and parameter-server) and ``lb.init`` build it from the
Strategy's ``timeline``, ``stall_warning_seconds`` and ``stall_shutdown_seconds``; below them
the recorder and the watches take this config, never the Strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class TraceFields(Protocol):
    """Anything carrying the three fields (a ``longboat.Strategy`` does)."""

    @property
    def timeline(self) -> str | None: ...

    @property
    def stall_warning_seconds(self) -> float: ...

    @property
    def stall_shutdown_seconds(self) -> float: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceConfig:
    """Timeline recording and stall inspection of one job."""

    timeline: str | None
    """Where the merged Chrome trace goes (``trace.rank<r>.json`` beside it); None: off."""
    stall_warning_seconds: float
    """Log who is missing once a wait lasts this long; 0 turns the inspector off."""
    stall_shutdown_seconds: float
    """Abort the job once a wait lasts this long; 0: at the job timeout."""

    @classmethod
    def of(cls, fields: TraceConfig | TraceFields) -> TraceConfig:
        """The config of ``fields`` (a Strategy, or a config already)."""
        if isinstance(fields, TraceConfig):
            return fields
        return cls(
            timeline=str(fields.timeline) if fields.timeline else None,
            stall_warning_seconds=float(fields.stall_warning_seconds),
            stall_shutdown_seconds=float(fields.stall_shutdown_seconds),
        )

    @property
    def inspects_stalls(self) -> bool:
        """The stall inspector is on."""
        return self.stall_warning_seconds > 0
