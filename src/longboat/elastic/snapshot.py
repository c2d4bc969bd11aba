"""Snapshots of nested state (dicts, lists, tensors, plain values) into buffers kept from one
snapshot to the next: `State`'s in-memory commit, and the host copy its node keeps
(`longboat.elastic.node_copy`)."""

from __future__ import annotations

import copy
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
