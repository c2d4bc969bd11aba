"""Which module of the forward reads which trained parameter first, learnt from one forward.

Sharding defers writing the gathered parameters until a module needs them
(`longboat.sharding.zero.gather`). A module needs its own parameters, and sometimes
another's: ``nn.MultiheadAttention`` passes ``self.out_proj.weight`` to its functional form
without calling ``out_proj``; a tied head reads the embedding's weight. `ReadersProfile`
watches the first forward through a ``TorchFunctionMode`` (every op sees the tensors it reads)
and a stack of module pre/post hooks, and records, for every module, the parameters read while
its own code runs (not its children's), and the order in which parameters are first read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle


class _ReadRecorder(TorchFunctionMode):
    """Notes each trained parameter an op receives, against the innermost running module."""

    def __init__(self, index: dict[int, int], on_read: Callable[[int], None]) -> None:
        super().__init__()
        self._index, self._on_read = index, on_read

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                i = self._index.get(id(leaf))
                if i is not None:
                    self._on_read(i)
        return func(*args, **kwargs)


class ReadersProfile:
    """Learn, during the first forward of ``root``, who reads ``params``; then call ``done``.

    ``readers[module]``: indices into ``params`` read while ``module``'s own code ran.
    ``first_read``: parameter indices in the order the forward first read them.
    """

    def __init__(
        self,
        root: nn.Module,
        params: Sequence[torch.Tensor],
        done: Callable[[ReadersProfile], None],
    ) -> None:
        self.readers: dict[nn.Module, set[int]] = {}
        self.first_read: list[int] = []
        self._seen: set[int] = set()
        self._stack: list[nn.Module] = []
        self._index = {id(p): i for i, p in enumerate(params)}
        self._root, self._done = root, done
        self._mode: _ReadRecorder | None = None
        self._scope_hooks: list[RemovableHandle] = []
        self._start_hook = root.register_forward_pre_hook(self._start)

    def _start(self, module: nn.Module, args: Any) -> None:
        self._start_hook.remove()
        for m in self._root.modules():
            self._scope_hooks.append(m.register_forward_pre_hook(self._enter))
            self._scope_hooks.append(m.register_forward_hook(self._leave, always_call=True))
        self._enter(module, args)  # the root's own scope hook was added after this call began
        self._scope_hooks.append(module.register_forward_hook(self._finish, always_call=True))
        self._mode = _ReadRecorder(self._index, self._record)
        self._mode.__enter__()

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._stack.append(module)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack and self._stack[-1] is module:
            self._stack.pop()

    def _record(self, i: int) -> None:
        if self._stack:
            self.readers.setdefault(self._stack[-1], set()).add(i)
        if i not in self._seen:
            self._seen.add(i)
            self.first_read.append(i)

    def _finish(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root's forward ended (or raised): stop watching, hand the profile on."""
        self.cancel()
        self._done(self)

    def cancel(self) -> None:
        """Stop watching (and never call ``done`` unless the forward already ended)."""
        self._start_hook.remove()
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for hook in self._scope_hooks:
            hook.remove()
        self._scope_hooks.clear()
        self._stack.clear()
