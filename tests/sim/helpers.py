"""Synthetic profiles for the sim tests."""

from __future__ import annotations

from longboat.sim.profile import Param, Profile


def linear_profile(widths: list[int], backward_s: float = 0.1, forward_s: float = 0.05) -> Profile:
    """An MLP's profile whose gradients become ready evenly through backward, last layer first."""
    params = []
    layers = len(widths) - 1
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        ready = backward_s * (layers - i) / layers
        params.append(Param(f"{i}.weight", (b, a), "float32", str(i), ready))
        params.append(Param(f"{i}.bias", (b,), "float32", str(i), ready))
    return Profile("mlp", 32, forward_s, backward_s, 0.001, 3e9, tuple(params))


def resnet50_like() -> Profile:
    """About 23 M parameters in 146 tensors, shaped like ResNet-50's bottleneck stages."""
    params = []
    shapes = []
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
        for block in range(blocks):
            cin = width * 4 if block else max(64, width * 2)
            for k, (o, i, kk) in enumerate(
                ((width, cin, 1), (width, width, 3), (width * 4, width, 1))
            ):
                shapes.append((f"s{stage}.b{block}.conv{k}", (o, i, kk, kk)))
                shapes.append((f"s{stage}.b{block}.bn{k}", (o,)))
    shapes.append(("fc", (1000, 2048)))
    n = len(shapes)
    for j, (layer, shape) in enumerate(shapes):
        ready = 0.2 * (n - j) / n
        params.append(Param(f"{layer}.weight", shape, "float32", layer, ready))
        if len(shape) == 1 or layer == "fc":
            params.append(Param(f"{layer}.bias", shape[:1], "float32", layer, ready))
    return Profile("resnet50-like", 64, 0.1, 0.2, 0.01, 3 * 4.1e9 * 64, tuple(params))
