"""Moved to `longboat.sharding.zero.memory`; importing it from here still works, with a
DeprecationWarning."""

import warnings

from longboat.sharding.zero.memory import MemoryReport, memory_report, storage_bytes

warnings.warn(
    "longboat.collective.sharding.memory moved to longboat.sharding.zero.memory: import "
    "memory_report from there",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["MemoryReport", "memory_report", "storage_bytes"]
