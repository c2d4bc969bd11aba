"""Keep glibc from returning every mid-sized buffer to the kernel (servers with lazy tables).

A server step allocates and frees tensors of a few hundred KB to a few MB (gathered rows,
gradients, probe masks). glibc serves those with fresh ``mmap`` pages, so each costs page
faults on every step (measured: lookups 2.6x slower). ``keep_buffers`` raises the mmap threshold
to 32 MB and the trim threshold to 128 MB with ``mallopt``, once per process; larger blocks
(the tables themselves) are still mapped and unmapped. No-op where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_done = False


def keep_buffers() -> bool:
    """Apply the thresholds (once); whether glibc took them."""
    global _done
    if _done:
        return True
    _done = True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 128 << 20)
    )
