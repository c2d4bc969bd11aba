"""Moved to ``longboat.ps.shared.auth``. This re-export stays only while ``longboat/launch/``
(being split by another change) still imports this path; delete it once that imports the new one."""

from longboat.ps.shared.auth import AuthError, job_token_file, load_token

__all__ = ["AuthError", "job_token_file", "load_token"]
