"""Count, on the CPU, what would stall the host if the model lived on a GPU.

CI has no GPU, so a training step runs on CPU tensors under :class:`HostSyncCounter`, which
treats the model's tensors (parameters, buffers, the reducer's bucket buffers and flags) and
everything computed from them as device-resident, and records each operation that on a GPU
makes the host wait for the device:

* ``read``: a device value read on the host (``item()``, ``bool(t)``, ``float(t)``,
  ``tolist()``, ``numpy()``, ``cpu()`` / ``to("cpu")`` without ``non_blocking``);
* ``copy``: a blocking copy between a device tensor and a host one, e.g. a Python scalar
  written into a device tensor (``t[i] = 1.0`` copies a fresh host scalar in).

Non-blocking copies (``copy_(src, non_blocking=True)``, as from pinned memory) are not counted:
on a real GPU, ``benchmarks/gpu_check.py`` runs the same steps under
``torch.cuda.set_sync_debug_mode``, which also catches a non-blocking copy from pageable memory.
Residency propagates through operations (an output is on the device if an input is), except
that ``copy_`` leaves its destination where it was. The dispatch mode sees the thread that
entered it (the autograd engine carries it into backward); ``tolist`` and the other host reads
are patched on ``torch.Tensor`` for the duration.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

_HOST_READS = ("tolist", "numpy", "cpu", "to")


class HostSyncCounter(TorchDispatchMode):
    """Records host-blocking operations on "device" tensors; see the module docstring."""

    def __init__(self, device_tensors: Iterable[torch.Tensor]):
        super().__init__()
        self._device: dict[int, StorageWeakRef] = {}
        self.events: list[tuple[str, str]] = []  # (kind, operation)
        self._saved: dict[str, Any] = {}
        for t in device_tensors:
            self.place(t)

    # -- residency ----------------------------------------------------------------------------

    def place(self, t: torch.Tensor) -> None:
        """Treat ``t``'s storage as device memory."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        self._device[storage._cdata] = StorageWeakRef(storage)

    def on_device(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        try:
            ref = self._device.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return False
        return ref is not None and not ref.expired()

    # -- counting -----------------------------------------------------------------------------

    def counts(self) -> Counter:
        return Counter(kind for kind, _ in self.events)

    @property
    def total(self) -> int:
        return len(self.events)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        from_device = any(self.on_device(t) for t in tensors)
        if func is aten._local_scalar_dense.default and from_device:
            self.events.append(("read", str(func)))
        if func in (aten.copy_.default, aten._foreach_copy_.default):
            pairs = (
                zip(args[0], args[1], strict=True)
                if func is aten._foreach_copy_.default
                else [args[:2]]
            )
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if not non_blocking and any(self.on_device(d) != self.on_device(x) for d, x in pairs):
                self.events.append(("copy", str(func)))
            return func(*args, **kwargs)  # the destination keeps its residency
        out = func(*args, **kwargs)
        if from_device:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.place(t)
        return out

    # -- host reads that do not dispatch on CPU tensors ----------------------------------------

    def __enter__(self) -> HostSyncCounter:
        counter = self
        for name in _HOST_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def patched(t, *args, __name=name, __original=original, **kwargs):  # noqa: ANN001
                if counter._reads_to_host(t, __name, args, kwargs):
                    counter.events.append(("read", f"Tensor.{__name}"))
                    with _disable_current_modes():
                        result = __original(t, *args, **kwargs)
                        return result.clone() if isinstance(result, torch.Tensor) else result
                return __original(t, *args, **kwargs)

            setattr(torch.Tensor, name, patched)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        super().__exit__(*exc)

    def _reads_to_host(self, t: torch.Tensor, name: str, args: tuple, kwargs: dict) -> bool:
        if not self.on_device(t):
            return False
        if name != "to":
            return True
        device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        return device is not None and device.type == "cpu" and not non_blocking


def device_tensors_of(
    model: torch.nn.Module, reducer: Any, optimizer: Any = None
) -> list[torch.Tensor]:
    """The tensors a GPU run would keep on the device: parameters, buffers, bucket buffers;
    under sharding also the gradient slices and the shard optimizer's state."""
    from longboat.sharding.zero.held import state_tensors
    from longboat.sharding.zero.step import step_of

    tensors = [*model.parameters(), *model.buffers()]
    tensors += [buffer for buffer, _ in reducer.bucket_layouts()]
    tensors.append(reducer._flags)
    tensors += list(getattr(reducer.collective, "slices", []))
    sharded = step_of(optimizer) if optimizer is not None else None
    if sharded is not None:
        tensors += state_tensors(sharded)
    return tensors
