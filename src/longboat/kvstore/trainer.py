"""``gluon.Trainer``'s data-parallel step over a KVStore, for torch modules.

    kv = kvstore.create("dist_sync")
    trainer = kvstore.Trainer(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1),
                              kv, update_on_kvstore=True)
    loss.backward(); trainer.step(batch_size)

MXNet's two server modes: ``update_on_kvstore=True`` ships the optimizer to the store
(servers sum the workers' gradients *and* update the weights; workers pull weights);
``False`` lets the servers only sum gradients, which every worker pulls and applies with its own
optimizer (same gradient, same optimizer: the replicas stay equal).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from longboat.kvstore import KVStore, create


class Trainer:
    """Keys 0..n-1 are the parameters in order; worker 0's initial values win."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        kvstore: KVStore | str = "device",
        update_on_kvstore: bool = True,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("kvstore.Trainer got no parameters that require gradients")
        self.optimizer = optimizer
        self.kv = create(kvstore) if isinstance(kvstore, str) else kvstore
        self.update_on_kvstore = update_on_kvstore
        keys = list(range(len(self.params)))
        if update_on_kvstore:
            self.kv.set_optimizer(optimizer)
        self.kv.init(keys, [p.detach() for p in self.params])
        with torch.no_grad():
            self.kv.pull(keys, out=[p.data for p in self.params])

    def step(self, batch_size: int) -> None:
        """Sum every worker's gradients scaled by 1/(batch_size * num_workers) (``batch_size``:
        samples the loss summed over on this worker; 1 for a mean-reduced loss), then update."""
        scale = 1.0 / (batch_size * self.kv.num_workers)
        keys = list(range(len(self.params)))
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach() * scale
            for p in self.params
        ]
        self.kv.push(keys, grads)
        with torch.no_grad():
            if self.update_on_kvstore:
                self.kv.pull(keys, out=[p.data for p in self.params])
                return
            for p, summed in zip(self.params, self.kv.pull(keys), strict=True):
                p.grad = summed.to(p.device, p.dtype)
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
