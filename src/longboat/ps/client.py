"""Moved to ``longboat.ps.trainer.client``. This re-export stays only while
``longboat/kvstore/store.py`` (being split by another change) still imports this path; delete it
once that imports the new one."""

from longboat.ps.trainer.client import PSError

__all__ = ["PSError"]
