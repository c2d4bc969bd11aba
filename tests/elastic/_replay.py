"""Single-process replay of the committed steps of an elastic run (the reference)."""

from __future__ import annotations

import torch

from tests.elastic import elastic_probe as probe


def replay(history: list, samples: int) -> list[list[float]]:
    """Train the probe's model on exactly the recorded global batches: each step averages the
    per-rank mean-loss gradients over that step's ranks, as the reducer does."""
    dataset = probe.data(samples)
    net = probe.model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for _world, batches in history:
        grads = [torch.zeros_like(p) for p in net.parameters()]
        for indices in batches:
            net.zero_grad()
            x, y = dataset.tensors[0][indices], dataset.tensors[1][indices]
            torch.nn.functional.mse_loss(net(x), y).backward()
            for g, p in zip(grads, net.parameters(), strict=True):
                g += p.grad / len(batches)
        for g, p in zip(grads, net.parameters(), strict=True):
            p.grad = g
        optimizer.step()
    return [p.detach().flatten().tolist() for p in net.parameters()]
