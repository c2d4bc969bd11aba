"""What a ``KVStore`` call was given, parsed and checked: keys (MXNet's key rules), per-device
values, outputs, row ids and shapes. Nothing here talks to the servers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from longboat.kvstore.errors import InvalidArgumentError
from longboat.kvstore.sparse import RowSparse
from longboat.words import plural

Key = int | str
Part = torch.Tensor | RowSparse
Value = Part | Sequence[Part]


class KeyRules:
    """One store's key rules: keys are int or str, one store uses one kind (MXNet's "Mixed
    key types are not allowed"), and one call one kind ("inconsistent types of keys")."""

    def __init__(self) -> None:
        self.key_type: type | None = None

    def check(self, what: str, key: Key) -> None:
        if not isinstance(key, int | str) or isinstance(key, bool):
            raise TypeError(f"{what}: keys are int or str, got {type(key).__name__}")
        if self.key_type is None:
            self.key_type = type(key)
        elif not isinstance(key, self.key_type):
            raise InvalidArgumentError(
                f"Mixed key types are not allowed: this store uses {self.key_type.__name__} "
                f"keys, {what} got {key!r}"
            )

    def pairs(
        self, what: str, key: Key | Sequence[Key], value: Value | Sequence[Value]
    ) -> list[tuple[Key, list[Part]]]:
        """(key, its per-device parts) for a key and value, or lists of both."""
        if isinstance(key, int | str):
            self.check(what, key)
            return [(key, split(what, key, value))]
        if isinstance(value, RowSparse):  # not iterable: a TypeError, as list() would raise
            raise TypeError(
                f"{what} of a list of keys needs a list of values, one per key; got one RowSparse"
            )
        keys, values = list(key), list(value)
        check_same_type(keys)
        if len(keys) != len(values):
            raise ValueError(
                f"{what}: {plural(len(keys), 'key')} but {plural(len(values), 'value')}"
            )
        for k in keys:
            self.check(what, k)
        return [(k, split(what, k, v)) for k, v in zip(keys, values, strict=True)]

    def outputs(self, what: str, key: Key | Sequence[Key], out: Any) -> tuple[list[Key], list[Any]]:
        """The keys of a pull and one output (or None) per key."""
        single = isinstance(key, int | str)
        keys = [key] if isinstance(key, int | str) else list(key)
        check_same_type(keys)
        for k in keys:
            self.check(what, k)
        if single or out is None:
            outs: list[Any] = [out] * len(keys)
        elif isinstance(out, torch.Tensor | RowSparse):
            raise InvalidArgumentError(
                f"{what} of a list of keys needs a list of outputs, one per key; got one "
                f"{kind_name(out)}"
            )
        else:
            outs = list(out)
        if len(outs) != len(keys):
            raise InvalidArgumentError(
                f"{what}: {plural(len(keys), 'key')} but {plural(len(outs), 'output')}"
            )
        return keys, outs


def split(what: str, key: Key, value: Value | Sequence[Value]) -> list[Part]:
    """A key's per-device parts: ``value`` itself or its items, each a tensor or RowSparse
    (anything else, such as a nested list, is refused). A torch sparse tensor (the gradient of
    ``nn.Embedding(sparse=True)``) becomes the ``RowSparse`` of its rows."""
    given = [value] if isinstance(value, torch.Tensor | RowSparse) else list(value)
    parts = [p for p in given if isinstance(p, torch.Tensor | RowSparse)]
    if not parts or len(parts) != len(given):
        raise TypeError(f"{what} {key!r}: give a tensor or a non-empty list of tensors")
    return [
        RowSparse.from_sparse(p.detach())
        if isinstance(p, torch.Tensor) and p.layout != torch.strided
        else p.detach()
        for p in parts
    ]


def check_same_type(keys: Sequence[Any]) -> None:
    if len({type(k) for k in keys}) > 1:
        raise AssertionError("inconsistent types of keys detected.")


def check_same_shape(what: str, key: Key, parts: Sequence[torch.Tensor]) -> None:
    if any(p.shape != parts[0].shape for p in parts):
        shapes = [tuple(p.shape) for p in parts]
        raise InvalidArgumentError(f"{what} {key!r}: per-device values differ in shape {shapes}")


def check_shape(what: str, key: Key, got: torch.Size, want: torch.Size) -> None:
    if tuple(got) != tuple(want):
        noun = "the value has" if what in ("push", "init") else "out has"
        raise InvalidArgumentError(
            f"{what} {key!r}: {noun} shape {tuple(got)}, the key holds {tuple(want)}"
        )


def merge(what: str, key: Key, parts: Sequence[torch.Tensor], on_device: bool) -> torch.Tensor:
    """The sum of per-device values: on the first value's device when ``on_device``, else on
    the CPU."""
    check_same_shape(what, key, parts)
    where = parts[0].device if on_device else torch.device("cpu")
    total = parts[0].to(where, copy=True)
    for p in parts[1:]:
        total += p.to(where)
    return total


def kind_name(value: Any) -> str:
    """What a refused output is, for error messages (``Tensor``, ``list``, ...)."""
    return "Tensor" if isinstance(value, torch.Tensor) else type(value).__name__


def parse_row_ids(key: Key, rows: Any) -> torch.Tensor:
    """``rows`` as a flat int64 CPU tensor. Row numbers may come in any real dtype, as MXNet's
    float32 arrays do (MXNet casts them); a value that is not a whole number is refused, named,
    instead of being truncated."""
    try:
        ids = torch.as_tensor(rows).reshape(-1).cpu()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(
            f"row_sparse_pull {key!r}: row_ids must be a 1-D tensor or list of row numbers; "
            f"got {kind_name(rows)} ({exc})"
        ) from None
    dtype = str(ids.dtype).removeprefix("torch.")
    if ids.numel() and (ids.is_complex() or ids.dtype == torch.bool):
        raise InvalidArgumentError(
            f"row_sparse_pull {key!r}: row_ids must be row numbers, got dtype {dtype}"
        )
    if ids.is_floating_point():
        whole = ids == ids.round()
        if not bool(whole.all()):
            bad = float(ids[~whole][0])
            raise InvalidArgumentError(
                f"row_sparse_pull {key!r}: row_ids must be whole row numbers; {dtype} value "
                f"{bad!r} is not one"
            )
    return ids.to(torch.int64)


__all__ = [
    "Key",
    "KeyRules",
    "Part",
    "Value",
    "check_same_shape",
    "check_same_type",
    "check_shape",
    "kind_name",
    "merge",
    "parse_row_ids",
    "split",
]
