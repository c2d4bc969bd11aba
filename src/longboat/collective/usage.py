"""Which ranks produced which gradients, known without stalling the GPU.

The reducer appends one flag per parameter to its last bucket (or sends the flags apart):
1 where this rank produced a gradient. After the allreduce each flag counts the ranks that
used its parameter, at no extra communication. This module keeps that bookkeeping off the
hot path:

* **Marks live on the host.** Each gradient hook records "used" in a Python list; the flags
  tensor is written once per backward, when the last bucket launches: one ``fill_`` kernel
  when every parameter was used here (the common case), else one non-blocking copy from
  pinned memory. Writing a Python scalar into a device tensor per gradient would be a
  pageable host-to-device copy that blocks the host every time.
* **Counts are read back only when needed.** With ``find_unused_parameters`` the reducer
  must know which parameters no rank used (their ``.grad`` stays None): one blocking read per
  backward, the single host synchronisation that setting costs. Without it, a rank that
  missed a gradient knows it on the host and raises at once; every other rank learns it from
  a non-blocking copy of the counts into pinned memory, checked at its next step once the
  copy has landed (an event query, never a wait).

On the CPU (Gloo) reads are free, so counts are checked at once there.
"""

from __future__ import annotations

import torch


def reads_block(device: torch.device) -> bool:
    """Whether reading a tensor on ``device`` from the host waits for queued device work."""
    return device.type != "cpu"


class PendingCounts:
    """A non-blocking copy of the reduced flags into host memory, readable once it landed."""

    def __init__(self, flags: torch.Tensor):
        pinned = flags.device.type == "cuda"
        self._host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=pinned)
        self._host.copy_(flags, non_blocking=True)
        self._event: torch.cuda.Event | None = None
        if pinned:
            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        """True once the copy finished (never blocks)."""
        return self._event is None or self._event.query()

    def counts(self) -> list[int]:
        """Ranks that used each parameter; call when :meth:`ready`."""
        return [round(v) for v in self._host.tolist()]


class UsageMarks:
    """Host-side "this rank produced a gradient" marks for one backward pass."""

    def __init__(self, n: int):
        self._used = [False] * n
        self._count = 0

    def reset(self) -> None:
        self._used = [False] * len(self._used)
        self._count = 0

    def mark(self, i: int) -> None:
        if not self._used[i]:
            self._used[i] = True
            self._count += 1

    @property
    def all_used(self) -> bool:
        return self._count == len(self._used)

    def unused(self) -> list[int]:
        """Indices of parameters this rank produced no gradient for."""
        return [i for i, used in enumerate(self._used) if not used]

    def write(self, flags: torch.Tensor) -> None:
        """Put the marks into the device ``flags`` without blocking the host."""
        if self.all_used:
            flags.fill_(1.0)
            return
        staging = torch.empty(
            len(self._used), dtype=flags.dtype, pin_memory=flags.device.type == "cuda"
        )
        staging.numpy()[:] = self._used  # host memory: no tensor op, no device work
        flags.copy_(staging, non_blocking=True)


def read_counts(flags: torch.Tensor) -> list[int]:
    """The reduced flags as per-parameter rank counts (one blocking read on a GPU)."""
    return [round(v) for v in flags.detach().to("cpu").tolist()]
