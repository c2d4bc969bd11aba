"""Measure on one GPU the two device figures `longboat sim` uses for GPU clusters by default.

    python benchmarks/sim_gpu_probe.py [--out probe.json] [--steps 200]

* jitter: the coefficient of variation (standard deviation / mean) of one training step's wall
  time, each step ended by a host synchronisation (as a step that logs its loss is), for
  ResNet-50 (batch 128, bf16 autocast, channels_last) and a GPT-2-small-sized decoder
  (batch 8 x 1024 tokens, bf16 autocast), synthetic data, momentum SGD;
* contention: how much slower the ResNet-50 step runs while a second stream copies a 512 MiB
  buffer back and forth without pause (a collective's device-memory traffic at its worst:
  the whole memory bandwidth), and the copy's bandwidth alone.

Prints and writes a JSON report. Needs CUDA and torchvision.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


def resnet50() -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    import torchvision

    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(128, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (128,), device="cuda")
    return model, lambda: (x, y)


class Decoder(nn.Module):
    """GPT-2 small's shape: 12 layers, width 768, 12 heads, vocabulary 50257."""

    def __init__(self, vocab: int = 50257, d: int = 768, layers: int = 12, ctx: int = 1024):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        layer = nn.TransformerEncoderLayer(d, 12, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)  # fmt: skip
        self.body = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.mask = nn.Transformer.generate_square_subsequent_mask(ctx)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.emb(tokens) + self.pos(pos)
        mask = self.mask.to(tokens.device)
        return self.head(self.body(h, mask=mask, is_causal=True))


def decoder() -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    model = Decoder().cuda()
    x = torch.randint(0, 50257, (8, 1024), device="cuda")
    return model, lambda: (x, x)


def step_fn(model: nn.Module, batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Callable:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        x, y = batch()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        loss = F.cross_entropy(out.float().flatten(0, -2), y.flatten())
        loss.backward()
        opt.step()

    return step


def timed(step: Callable, n: int) -> list[float]:
    """Wall seconds of ``n`` steps, each ended by waiting for the current stream only (a
    device-wide synchronisation would also wait for the contention probe's copies)."""
    stream = torch.cuda.current_stream()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        stream.synchronize()
        times.append(time.perf_counter() - t)
    return times


def jitter(step: Callable, steps: int) -> dict[str, float]:
    timed(step, 30)
    times = timed(step, steps)
    mean = statistics.fmean(times)
    median = statistics.median(times)
    mad = statistics.median(abs(t - median) for t in times)
    return {
        "steps": steps,
        "mean_s": mean,
        "cv": statistics.stdev(times) / mean,
        "robust_cv": 1.4826 * mad / median,
        "max_over_median": max(times) / median,
    }


def contention(step: Callable, steps: int = 30) -> dict[str, float]:
    alone = statistics.median(timed(step, steps))
    a = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.cuda.stream(side):
        for _ in range(50):
            b.copy_(a)
    side.synchronize()
    copy_s = (time.perf_counter() - t) / 50
    window = alone * (steps + 5) * 2
    with torch.cuda.stream(side):
        for _ in range(int(window / copy_s) + 1):
            b.copy_(a)
    together = statistics.median(timed(step, steps))
    busy = not side.query()
    side.synchronize()
    return {
        "step_alone_s": alone,
        "step_with_copy_s": together,
        "slowdown": together / alone - 1,
        "copy_GBps_read_plus_write": 2 * a.numel() / copy_s / 1e9,
        "copy_still_running_at_end": busy,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON report")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per model")
    parser.add_argument("--contention-only", action="store_true", help="skip the jitter runs")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    props = torch.cuda.get_device_properties(0)
    report: dict = {"device": props.name, "sms": props.multi_processor_count,
                    "torch": torch.__version__}  # fmt: skip
    r_model, r_batch = resnet50()
    r_step = step_fn(r_model, r_batch)
    if not args.contention_only:
        report["resnet50"] = jitter(r_step, args.steps)
    report["resnet50_contention"] = contention(r_step)
    del r_model, r_step
    torch.cuda.empty_cache()
    if not args.contention_only:
        d_model, d_batch = decoder()
        report["decoder"] = jitter(step_fn(d_model, d_batch), args.steps)
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
