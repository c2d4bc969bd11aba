"""Models, data and single-process references shared by the collective tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

IN, CLASSES = 16, 10
GLOBAL_BATCH = 16
STEPS = 20


class MixedNet(nn.Module):
    """24+ parameter tensors of mixed sizes (bias vectors up to a 1 MB weight)."""

    def __init__(self, unused: str = "none"):
        super().__init__()
        widths = [IN, 64, 256, 1024, 64, 48, 32, 32]
        self.blocks = nn.ModuleList()
        for a, b in zip(widths, widths[1:], strict=False):
            self.blocks.append(nn.Linear(a, b))
            self.blocks.append(nn.LayerNorm(b))
        self.head = nn.Linear(widths[-1], CLASSES)
        self.unused_mode = unused
        if unused != "none":
            self.extra = nn.Linear(widths[-1], CLASSES)

    def forward(self, x: torch.Tensor, rank: int = 0) -> torch.Tensor:
        for i in range(0, len(self.blocks), 2):
            x = torch.tanh(self.blocks[i + 1](self.blocks[i](x)))
        out = self.head(x)
        # "partial": the extra layer takes part only on even ranks (per-rank branching)
        if self.unused_mode == "partial" and rank % 2 == 0:
            out = out + self.extra(x)
        return out


@dataclass(frozen=True)
class Config:
    """One training scenario."""

    optimizer: str = "sgd"
    cap_mb: float = 32.0
    comms: int = 1
    k_steps: int = 1
    unused: str = "none"  # none | always | partial
    sync_each_comm: bool = True
    fuse: bool = True
    set_to_none: bool = True  # zero_grad(set_to_none=False) keeps .grad as bucket views
    algorithm: str = "native"

    @property
    def dtype(self) -> torch.dtype:
        # Adam divides by sqrt(v): for gradients near zero it turns last-bit rounding
        # differences (a different summation order across ranks) into visible ones, so Adam
        # runs in float64, where rounding stays far below the tolerance. SGD runs in float32.
        return torch.float64 if self.optimizer == "adam" else torch.float32

    @property
    def name(self) -> str:
        return (
            f"{self.optimizer}-cap{self.cap_mb}-comm{self.comms}-k{self.k_steps}-{self.unused}"
            f"-sync{int(self.sync_each_comm)}-fuse{int(self.fuse)}"
            + ("" if self.set_to_none else "-zeroed")
            + ("" if self.algorithm == "native" else f"-{self.algorithm}")
        )


def build_model(cfg: Config, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MixedNet(cfg.unused).to(cfg.dtype)


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def data(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(STEPS * k_steps, GLOBAL_BATCH, IN) inputs and labels, the same in every process."""
    g = torch.Generator().manual_seed(1234)
    n = STEPS * cfg.k_steps
    x = torch.randn(n, GLOBAL_BATCH, IN, generator=g).to(cfg.dtype)
    y = torch.randint(0, CLASSES, (n, GLOBAL_BATCH), generator=g)
    return x, y


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def reference(cfg: Config, world: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Single-process training on the global batch (mean of the ranks' equal-size shards), for
    the first ``steps`` (at most STEPS) steps of `data`."""
    model = build_model(cfg, seed=0)
    opt = build_optimizer(cfg, model)
    x, y = data(cfg)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(cfg.k_steps):
            i = step * cfg.k_steps + micro
            losses = [
                F.cross_entropy(model(shard(x[i], r, world), rank=r), shard(y[i], r, world))
                for r in range(world)
            ]
            (torch.stack(losses).mean() / cfg.k_steps).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_global_batch(
    model: nn.Module, opt: torch.optim.Optimizer, cfg: Config, world: int, skip: int | None = None
) -> dict[str, torch.Tensor]:
    """Single-process reference without gradient merge: STEPS steps on the global batch (the
    mean of the ranks' equal-size shards' losses), step ``skip`` left out; final parameters."""
    x, y = data(cfg)
    for i in range(STEPS):
        if i == skip:
            continue
        opt.zero_grad()
        losses = [
            F.cross_entropy(model(shard(x[i], r, world)), shard(y[i], r, world))
            for r in range(world)
        ]
        torch.stack(losses).mean().backward()
        opt.step()
    return params_of(model)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}
