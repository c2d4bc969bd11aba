"""The store type names MXNet's ``kv.create`` accepts, and what each one means here."""

from __future__ import annotations

from dataclasses import dataclass

from longboat.kvstore.errors import InvalidArgumentError


@dataclass(frozen=True)
class StoreKind:
    """How a store type behaves: on servers (``dist``) or in this process, per-device lists
    summed on the first value's device (``device``) or on the CPU, ``sync`` or async, and
    whether MXNet allows gradient compression on it (only when 'device' or 'dist' is in the
    type name: ``nccl`` and the plain local types refuse it)."""

    dist: bool
    device: bool
    sync: bool = True

    @property
    def compression(self) -> bool:
        return self.dist or self.device


KINDS: dict[str, StoreKind] = {
    "local": StoreKind(dist=False, device=False),
    "local_update_cpu": StoreKind(dist=False, device=False),
    "local_allreduce_cpu": StoreKind(dist=False, device=False),
    "device": StoreKind(dist=False, device=True),
    "local_allreduce_device": StoreKind(dist=False, device=True),
    "nccl": StoreKind(dist=False, device=False),  # sums on the first value's device: see below
    "dist_sync": StoreKind(dist=True, device=False),
    "dist_device_sync": StoreKind(dist=True, device=True),
    "dist_sync_device": StoreKind(dist=True, device=True),
    "dist_async": StoreKind(dist=True, device=False, sync=False),
}
TYPES = tuple(KINDS)

REFUSED = {
    "horovod": "MXNet's 'horovod' store is Horovod's allreduce, not a key-value store on "
    "servers: use longboat.horovod.torch (hvd.allreduce, hvd.DistributedOptimizer) or "
    "lb.distribute for collective training",
    "byteps": "BytePS is not part of longboat: use a dist_sync store (longboat launch "
    "--servers N --workers M) or lb.distribute for collective training",
}


def kind_of(name: str) -> StoreKind:
    """The ``StoreKind`` of type ``name`` (case-insensitive, as in MXNet); refuses unknown
    names and the types that are not key-value stores here, saying why."""
    lowered = name.lower()
    if lowered in REFUSED:
        raise InvalidArgumentError(f"KVStore type {name!r} is not supported: {REFUSED[lowered]}")
    if lowered not in KINDS:
        raise InvalidArgumentError(
            f"unknown KVStore type {name!r}; choose one of {', '.join(TYPES)}"
        )
    return KINDS[lowered]


def sums_on_device(name: str) -> bool:
    """Whether per-device lists are summed on the first value's device (device types and
    ``nccl``) rather than on the CPU."""
    return kind_of(name).device or name.lower() == "nccl"


__all__ = ["KINDS", "REFUSED", "TYPES", "StoreKind", "kind_of", "sums_on_device"]
