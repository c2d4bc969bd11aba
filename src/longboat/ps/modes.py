"""Moved to ``longboat.ps.trainer.modes``; earlier docs named this path for registering a PS
mode (``from longboat.ps.modes import Mode, register, wait_all``), so it keeps re-exporting the
registry's public names."""

from longboat.ps.trainer.modes import Mode, ModeContext, get, names, register, unregister, wait_all

__all__ = ["Mode", "ModeContext", "get", "names", "register", "unregister", "wait_all"]
