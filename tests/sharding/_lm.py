"""A small tied-head transformer LM, its data and a single-process reference loop for the stage
3 tests (float32: FSDP2 shards float32 parameters)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, DIM, SEQ, LAYERS = 37, 16, 6, 2


class Block(nn.Module):
    """Pre-norm attention and MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        # no biases: the key bias has a zero gradient up to rounding, which Adam would amplify
        self.attn = nn.MultiheadAttention(dim, 2, bias=False, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm1(h)
        h = h + self.attn(x, x, x, need_weights=False)[0]
        return h + self.mlp(self.norm2(h))


class TiedLM(nn.Module):
    """Embedding, blocks, norm and a head that is the embedding's weight."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def model(seed: int = 0) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM()


def batches(n: int, size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` global batches of ``size`` sequences: (tokens, next tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def loss_of(net: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = net(tokens)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def part(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of a global batch."""
    return t.chunk(world)[rank]


def train(
    net: nn.Module,
    optimizer: Any,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    rank: int = 0,
    world: int = 1,
    k_steps: int = 1,
    clip: float | None = None,
    scheduler: Any = None,
    clip_fn: Callable[[float], torch.Tensor] | None = None,
) -> list[float]:
    """Train on ``data`` (each global batch split over ``world`` ranks; ``k_steps`` micro
    batches per step, the merged gradient averaged); returns the clipped norms, if any."""
    norms = []
    for step, (tokens, targets) in enumerate(data):
        x, y = part(tokens, rank, world), part(targets, rank, world)
        loss = loss_of(net, x, y)
        if world == 1 and k_steps > 1:
            loss = loss / k_steps
        loss.backward()
        if (step + 1) % k_steps:
            if world > 1:
                optimizer.step()  # the merge gate skips it
                optimizer.zero_grad()
            continue
        if clip is not None:
            assert clip_fn is not None
            norms.append(float(clip_fn(clip)))
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return norms
