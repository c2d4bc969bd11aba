"""Moved to ``longboat.ps.trainer.kv`` (``lb.ps.KVClient``). This re-export stays only while
``longboat/kvstore/store.py`` (being split by another change) still imports this path; delete it
once that imports the new one."""

from longboat.ps.trainer.kv import KVClient

__all__ = ["KVClient"]
