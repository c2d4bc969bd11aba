"""Snapshots of nested state (dicts, lists, tensors, plain values) into buffers kept from one
snapshot to the next: `State`'s in-memory commit, and the host copy its node keeps
(`longboat.elastic.node_copy`); `hash_tree`, bit for bit, for `State.digest`."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch


class TensorTree:
    """A snapshot of a nested state whose tensors are copied into buffers kept from one
    snapshot to the next (no allocation per commit).

    ``host=True`` keeps the buffers in host memory (pinned for device tensors, copied without
    blocking the host): call `ready` before reading them from another thread.
    """

    def __init__(self, host: bool = False) -> None:
        self.tree: Any = None
        self._host = host
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None

    def save(self, tree: Any) -> None:
        self._copied = None
        self.tree = self._copy(tree, ())
        if self._host and self._copied is not None:
            self._copied.record()

    def ready(self) -> None:
        """Wait (in the calling thread) until the last `save`'s device-to-host copies landed."""
        if self._copied is not None:
            self._copied.synchronize()

    def _copy(self, node: Any, path: tuple) -> Any:
        if isinstance(node, torch.Tensor):
            return self._copy_tensor(node.detach(), path)
        if isinstance(node, dict):
            return {k: self._copy(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, list | tuple):
            items = [self._copy(v, (*path, i)) for i, v in enumerate(node)]
            return type(node)(items) if isinstance(node, tuple) else items
        return copy.deepcopy(node)

    def _copy_tensor(self, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        to_host = self._host and tensor.device.type != "cpu"
        if tensor.layout != torch.strided:  # sparse: no reusable buffer
            return tensor.to("cpu") if to_host else tensor.clone()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            if to_host:
                pin = tensor.is_cuda and torch.cuda.is_available()
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            else:
                buf = torch.empty_like(tensor, device=tensor.device)
            self._buffers[path] = buf
        buf.copy_(tensor, non_blocking=to_host)
        if to_host and tensor.is_cuda and self._copied is None:
            self._copied = torch.cuda.Event()
        return buf

    def fresh(self) -> Any:
        """The snapshot with its tensors cloned (loading must not alias the buffers)."""
        return clone(self.tree)


def clone(node: Any) -> Any:
    """``node`` with every tensor cloned and every other value deep-copied."""
    if isinstance(node, torch.Tensor):
        return node.clone()
    if isinstance(node, dict):
        return {k: clone(v) for k, v in node.items()}
    if isinstance(node, list):
        return [clone(v) for v in node]
    if isinstance(node, tuple):
        return tuple(clone(v) for v in node)
    return copy.deepcopy(node)


def hash_tree(node: Any) -> int:
    """A signed 64-bit hash of a nested state: tensors by dtype, shape and bytes, dict entries
    in key order, plain values by their repr, other objects by their type alone."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, node)
    return int.from_bytes(h.digest(), "little", signed=True)


def _feed(h: Any, node: Any) -> None:
    if isinstance(node, torch.Tensor):
        t = node.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        if t.numel():
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(node, dict):
        h.update(f"D{len(node)}:".encode())
        for key, value in sorted(node.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0]))):
            _feed(h, key)
            _feed(h, value)
    elif isinstance(node, list | tuple):
        h.update(f"L{len(node)}:".encode())
        for value in node:
            _feed(h, value)
    elif node is None or isinstance(node, bool | int | float | str):
        h.update(f"{type(node).__name__}={node!r};".encode())
    else:
        h.update(f"<{type(node).__name__}>;".encode())
