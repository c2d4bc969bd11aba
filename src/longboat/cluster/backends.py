"""Which torch.distributed backends run their collectives on the GPU.

NCCL queues each collective on a stream of the GPU and completes its future on the host as
soon as the kernel is queued; Gloo reduces on CPU threads. Everything in longboat that depends
on the difference (where control tensors live, which algorithm is the default, whether one
rank still launches its allreduce) asks here, not for the name "nccl", so that another
backend of NCCL's kind (e.g. a test backend with NCCL's stream semantics) takes the same paths.
"""

from __future__ import annotations

_DEVICE_BACKENDS: set[str] = {"nccl"}


def register_device_backend(name: str) -> None:
    """Declare that backend ``name`` runs collectives on the GPU's streams, as NCCL does."""
    _DEVICE_BACKENDS.add(name.lower())


def runs_on_device(backend: str) -> bool:
    """Whether ``backend``'s collectives run on GPU streams (NCCL) rather than the host."""
    return str(backend).lower() in _DEVICE_BACKENDS
