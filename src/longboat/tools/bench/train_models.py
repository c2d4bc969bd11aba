"""`longboat bench train`'s models: small CPU-sized ones (mlp, convnet, resnet, transformer),
GPU-sized ResNet-50 and GPT-2 small, tiny variants for tests; each with its synthetic samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class _Block(nn.Module):
    """ResNet basic block."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


def resnet(width: int = 16, classes: int = 10) -> nn.Module:
    """A CIFAR-style ResNet (3 stages of 2 basic blocks) for 3x32x32 inputs."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
    ]
    cin = width
    for stage, cout in enumerate((width, 2 * width, 4 * width)):
        for block in range(2):
            layers.append(_Block(cin, cout, 2 if stage and not block else 1))
            cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


class TinyTransformer(nn.Module):
    """Token embedding, a pre-norm encoder and mean-pooled classification."""

    def __init__(self, vocab: int, dim: int, layers: int, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


class _Bottleneck(nn.Module):
    """ResNet bottleneck block (1x1, 3x3, 1x1 convolutions, expansion 4)."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.short(x))


def resnet50(classes: int = 1000) -> nn.Module:
    """ResNet-50's layout (3-4-6-3 bottlenecks, 25.6 M parameters) for 3x224x224 inputs."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
        for block in range(blocks):
            layers.append(_Bottleneck(cin, width, 2 if stage and not block else 1))
            cin = 4 * width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


class CausalLM(nn.Module):
    """A GPT-style decoder: token and position embeddings, pre-norm causal blocks, LM head."""

    def __init__(self, vocab: int, dim: int, layers: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(seq, dim)
        layer = nn.TransformerEncoderLayer(
            dim, dim // 64, 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        h = self.embed(tokens) + self.position.weight[:seq]
        h = self.blocks(h, mask=self.mask[:seq, :seq], is_causal=True)
        return self.head(self.norm(h))  # (batch, seq, vocab): next-token logits


def mlp(widths: Sequence[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def convnet() -> nn.Module:
    """A small VGG-style convnet for 3x32x32 inputs."""

    def block(a: int, b: int) -> list[nn.Module]:
        return [nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU()]

    return nn.Sequential(
        *block(3, 32),
        *block(32, 32),
        nn.MaxPool2d(2),
        *block(32, 64),
        *block(64, 64),
        nn.MaxPool2d(2),
        *block(64, 128),
        *block(128, 128),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: how to build it, one sample's input, its batch per rank."""

    name: str
    batch: int
    kind: str  # "vector", "image", "imagenet", "tokens" or "lm"
    arg: Any

    def build(self) -> nn.Module:
        torch.manual_seed(0)
        if self.kind == "vector":
            return mlp(self.arg)
        if self.name.startswith("convnet"):
            return convnet()
        if self.kind == "image":
            return resnet(self.arg)
        if self.kind == "imagenet":
            return resnet50()
        vocab, dim, layers, seq = self.arg
        if self.kind == "lm":
            return CausalLM(vocab, dim, layers, seq)
        return TinyTransformer(vocab, dim, layers)

    def sample(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "vector":
            x = torch.randn(self.arg[0], generator=generator)
        elif self.kind in ("image", "imagenet"):
            size = 224 if self.kind == "imagenet" else 32
            x = torch.randn(3, size, size, generator=generator)
        else:
            vocab, _, _, seq = self.arg
            x = torch.randint(0, vocab, (seq,), generator=generator)
            if self.kind == "lm":  # next-token targets
                return x, torch.randint(0, vocab, (seq,), generator=generator)
        return x, torch.randint(0, 10, (), generator=generator)


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", 64, "vector", (512, 2048, 2048, 512, 10)),
    "mlp-0.3M": ModelSpec("mlp-0.3M", 64, "vector", (256, 512, 256, 128, 10)),
    "convnet": ModelSpec("convnet", 32, "image", None),
    "resnet": ModelSpec("resnet", 32, "image", 16),
    "transformer": ModelSpec("transformer", 16, "tokens", (1000, 128, 2, 64)),
    # GPU-sized: ResNet-50 (25.6 M parameters) and GPT-2 small (124 M, 163 M with its LM head
    # untied)
    "resnet50": ModelSpec("resnet50", 128, "imagenet", None),
    "gpt2-small": ModelSpec("gpt2-small", 8, "lm", (50257, 768, 12, 1024)),
    # tiny variants: end-to-end tests and quick checks
    "mlp-tiny": ModelSpec("mlp-tiny", 8, "vector", (16, 32, 10)),
    "resnet-tiny": ModelSpec("resnet-tiny", 4, "image", 4),
    "transformer-tiny": ModelSpec("transformer-tiny", 4, "tokens", (50, 16, 1, 8)),
    "gpt2-tiny": ModelSpec("gpt2-tiny", 2, "lm", (64, 64, 1, 16)),
}


class SyntheticDataset(torch.utils.data.Dataset):
    """Random samples made on access (the cost a real pipeline's decoding would have)."""

    def __init__(self, spec: ModelSpec, length: int, seed: int):
        self.spec, self.length, self.seed = spec, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.spec.sample(torch.Generator().manual_seed(self.seed * 1_000_003 + i))
