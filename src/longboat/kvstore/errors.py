"""MXNet's error types: scripts' ``except mx.base.MXNetError`` clauses keep working.

MXNet raises ``MXNetError`` (a ``RuntimeError``) when its C++ core refuses a call. The
subclasses here are also the Python builtin that a PyTorch user would expect (``KeyError`` for a
key that was never ``init``-ed, ``ValueError`` for a bad argument), so both kinds of ``except``
clause catch them.
"""

from __future__ import annotations


class MXNetError(RuntimeError):
    """What MXNet raises when the store refuses a call."""


class KeyNotInitError(MXNetError, KeyError):
    """A push or pull of a key that was never ``init``-ed."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class InvalidArgumentError(MXNetError, ValueError):
    """A call MXNet's store refuses: duplicate init, mixed key types, shape mismatch, ..."""


class NotSupportedError(MXNetError, NotImplementedError):
    """An MXNet call this facade does not offer; the message says what to use instead."""


__all__ = ["InvalidArgumentError", "KeyNotInitError", "MXNetError", "NotSupportedError"]
