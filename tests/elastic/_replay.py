"""Single-process replay of the committed steps of an elastic run (the reference)."""

from __future__ import annotations

import torch

from tests.elastic import elastic_probe as probe


def replay_steps(
    net: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    history: list,
) -> list[list[float]]:
    """Train ``net`` on exactly the recorded global batches: each step averages the per-rank
    mean-loss gradients over that step's ranks, as the reducer does."""
    for _world, batches in history:
        grads = [torch.zeros_like(p) for p in net.parameters()]
        for indices in batches:
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x[indices]), y[indices]).backward()
            for g, p in zip(grads, net.parameters(), strict=True):
                g += p.grad / len(batches)
        for g, p in zip(grads, net.parameters(), strict=True):
            p.grad = g
        optimizer.step()
    return [p.detach().flatten().tolist() for p in net.parameters()]


def replay(history: list, samples: int) -> list[list[float]]:
    """The elastic probe's training replayed on its recorded global batches."""
    x, y = probe.data(samples).tensors
    net = probe.model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return replay_steps(net, optimizer, x, y, history)
