"""``gluon.Trainer``'s data-parallel step over a KVStore, for torch modules.

    kv = kvstore.create("dist_sync")
    trainer = kvstore.Trainer(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1), kv)
    loss.backward(); trainer.step(batch_size)   # the workers' summed gradient * 1 / batch_size

MXNet's two server modes: ``update_on_kvstore=True`` ships the optimizer to the store
(servers sum the workers' gradients *and* update the weights; workers pull weights);
``False`` lets the servers only sum gradients, which every worker pulls and applies with its own
optimizer (same gradient, same optimizer: the replicas stay equal). ``None`` chooses as gluon
does (``choose_update_on_kvstore``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from longboat.kvstore import KVStore, create
from longboat.kvstore.optimizer import Optimizer, as_optimizer
from longboat.ownership import admit

_TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad}


def choose_update_on_kvstore(requested: bool | None, kv: KVStore, from_name: bool) -> bool:
    """gluon's rule. dist_async always updates on the store (``False`` is refused with MXNet's
    message: the servers would keep only the latest worker's gradient); an explicit choice is
    kept; else a store made from a non-dist type name for this one device is not used for
    updates (gluon makes no store then), and otherwise ``MXNET_UPDATE_ON_KVSTORE`` (default 1)
    decides."""
    kind = kv.type.lower()
    if "dist" in kind and "async" in kind:
        if requested is False:
            raise ValueError("Please set update_on_kvstore=True when training in async mode.")
        return True
    if requested is not None:
        return bool(requested)
    if from_name and "dist" not in kind:
        return False
    return bool(int(os.environ.get("MXNET_UPDATE_ON_KVSTORE", "1"))) and kv.is_capable("optimizer")


class Trainer:
    """Keys 0..n-1 are the parameters in order; worker 0's initial values win.

    A second Trainer on the same dist store (keys 0..n-1 again, as gluon) starts as on a fresh
    store: the keys get its worker 0's parameters and the optimizer state starts anew.

    ``optimizer``: a torch SGD/Adam/Adagrad over ``params``, or a ``kvstore.optimizer`` one
    (MXNet's names; its ``rescale_grad`` is gluon's ``scale``). ``compression_params``:
    ``KVStore.set_gradient_compression``'s argument. Sparse gradients (``nn.Embedding(
    sparse=True)``) are pushed as their rows (gluon's row_sparse gradients); with
    ``update_on_kvstore=False`` a dist store refuses them, as gluon does."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer | Optimizer,
        kvstore: KVStore | str = "device",
        update_on_kvstore: bool | None = None,
        *,
        compression_params: Mapping[str, Any] | None = None,
    ) -> None:
        given = list(params)
        if isinstance(optimizer, torch.optim.Optimizer):  # lb.distribute's checks, once
            admit(given, optimizer, "kvstore.Trainer")
        self.params = [p for p in given if p.requires_grad]
        if not self.params:
            raise ValueError("kvstore.Trainer got no parameters that require gradients")
        self._scale = optimizer.rescale_grad if isinstance(optimizer, Optimizer) else 1.0
        self._given = optimizer
        if isinstance(optimizer, Optimizer):
            optimizer = _TORCH[optimizer.name](self.params, **optimizer.hparams)
        self.optimizer = optimizer
        self.kv = create(kvstore) if isinstance(kvstore, str) else kvstore
        self.update_on_kvstore = choose_update_on_kvstore(
            update_on_kvstore, self.kv, isinstance(kvstore, str)
        )
        if compression_params and not (isinstance(kvstore, str) and "dist" not in kvstore):
            self.kv.set_gradient_compression(compression_params)  # gluon: no store, no compression
        keys, values = self._keys(), [p.detach() for p in self.params]
        again = [k for k in keys if self.kv._holds(k)]
        if again and self.kv._kind.dist:
            # another Trainer on this store made these keys: init keeps what they hold (MXNet's
            # dist store accepts int keys again), so give them this Trainer's worker-0 values
            self.kv.init(keys, values)
            self.kv._assign(again, [values[k] for k in again])
            if self.update_on_kvstore:
                self.kv.set_optimizer(as_optimizer(self._given))
        else:
            if self.update_on_kvstore:
                self.kv.set_optimizer(as_optimizer(self._given))
            self.kv.init(keys, values)  # a local store refuses keys inited before (as MXNet)
        with torch.no_grad():
            self.kv.pull(keys, out=[p.data for p in self.params])

    def step(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        """One update with the gradient summed over every worker (and device) times
        ``scale / batch_size`` (gluon's ``rescale_grad``, applied once): ``batch_size`` is what
        that sum should be divided by; the global batch for a summed loss, 1 for a loss that is
        already a mean over the global batch."""
        self._check_fresh(ignore_stale_grad)
        if self.update_on_kvstore:
            self.kv._set_rescale_grad(self._scale / batch_size)
            self.kv.push(self._keys(), self._grads())
            with torch.no_grad():
                self.kv.pull(self._keys(), out=[p.data for p in self.params])
            return
        self.allreduce_grads()
        self.update(batch_size)

    def allreduce_grads(self) -> None:
        """``update_on_kvstore=False``: every parameter's ``.grad`` becomes the sum over the
        workers (unscaled); ``update`` then applies it."""
        self._refuse_on_kvstore("allreduce_grads")
        self._check_fresh(False)
        sparse = [i for i, p in enumerate(self.params) if _is_sparse(p.grad)]
        if sparse and self.kv._kind.dist:
            raise ValueError(
                "Cannot set update_on_kvstore=False on dist kvstore when sparse gradients are "
                f"present. (parameter(s) {sparse}: the workers' sum comes back dense, without "
                "the rows each worker touched; use update_on_kvstore=True, where the servers "
                "apply the summed rows)"
            )
        keys = self._keys()
        self.kv.push(keys, self._grads())
        with torch.no_grad():
            for p, summed in zip(self.params, self.kv.pull(keys), strict=True):
                summed = summed.to(p.device, p.dtype)
                # one worker: the sum has the gradient's rows, kept sparse for its optimizer
                p.grad = (
                    summed.sparse_mask(p.grad.to_sparse().coalesce())
                    if _is_sparse(p.grad)
                    else summed
                )

    def update(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        """``update_on_kvstore=False``: scale the (all-reduced) gradients by
        ``scale / batch_size`` and run the optimizer."""
        self._refuse_on_kvstore("update")
        rescale = self._scale / batch_size
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(rescale)
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _keys(self) -> list[int]:
        return list(range(len(self.params)))

    def _grads(self) -> list[torch.Tensor]:
        return [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach() for p in self.params
        ]

    def _check_fresh(self, ignore_stale_grad: bool) -> None:
        """gluon raises ``UserWarning`` for a parameter that backward did not reach. Skipping
        it (gluon's ``ignore_stale_grad=True``) is refused too: sync servers need every key's
        push each step."""
        stale = [i for i, p in enumerate(self.params) if p.grad is None]
        if not stale:
            return
        skip = (
            "ignore_stale_grad=True (skip them) is not supported: the servers expect every "
            "key each step; "
            if ignore_stale_grad
            else ""
        )
        raise UserWarning(
            f"gradient of parameter(s) {stale} has not been computed by backward since the "
            f"last step; {skip}give every parameter a gradient (zero_grad(set_to_none=False) "
            "before backward pushes zeros for unused ones)"
        )

    def _refuse_on_kvstore(self, what: str) -> None:
        if self.update_on_kvstore:
            raise ValueError(
                f"{what}() when parameters are updated on kvstore is not supported. Try "
                "setting `update_on_kvstore` to False when creating trainer."
            )


def _is_sparse(grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` is a torch sparse gradient (``nn.Embedding(sparse=True)``'s)."""
    return grad is not None and grad.layout != torch.strided
