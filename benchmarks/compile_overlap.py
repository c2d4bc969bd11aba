"""When in backward does the first gradient bucket launch: eager vs torch.compile.

    python benchmarks/compile_overlap.py --layers 8 --width 1024 --bucket-mb 4 --steps 5

2 local ranks (Gloo) train ``--layers`` Linear(width, width) layers with ``--bucket-mb``
buckets. The statistic is the fraction of backward elapsed when bucket 0 is launched, for two
spans of backward: the ``loss.backward()`` call (until it returns, the wait for the last
allreduces included), and the autograd pass alone (from the first gradient of the output, a
hook on it, to the reducer's end-of-backward callback: compute only). Reported per way of
running, as the median over the steps after the first (which compiles): eager; ``lb.compile``
after ``lb.distribute``; ``model.compile()`` on the model it returns (the same cut graph);
``torch.compile`` before it (longboat recompiles it cut at the
buckets); and plain ``torch.compile`` of the distributed model, which loses overlap.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

WAYS = (
    "eager",
    "lb.compile after",
    "model.compile() after",
    "torch.compile before",
    "plain torch.compile after",
)


class _Clock:
    """A reducer observer that times backward's start, bucket 0's launch and backward's end."""

    def __init__(self) -> None:
        self.start = self.launch = self.end = 0.0

    def forward_begin(self) -> None:
        pass

    def forward_end(self, output: Any) -> None:
        output.register_hook(self._began)

    def _began(self, grad: torch.Tensor) -> None:
        self.start = time.perf_counter()

    def bucket_ready(self, bucket: int) -> None:
        pass

    def launched(self, bucket: int, comm: int, tensor: torch.Tensor, handle: Any) -> Any:
        if bucket == 0:
            self.launch = time.perf_counter()
        return handle

    def backward_end(self) -> None:
        self.end = time.perf_counter()

    def synced(self) -> None:
        pass

    def fractions(self, call_start: float, call_end: float) -> tuple[float, float]:
        """Of the ``backward()`` call, and of the autograd pass."""
        return (
            (self.launch - call_start) / (call_end - call_start),
            (self.launch - self.start) / (self.end - self.start),
        )


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())))


def rank_main(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]] | None:
    import longboat as lb

    lb.init(backend="gloo")
    out: dict[str, list[tuple[float, float]]] = {}
    for way in WAYS:
        torch._dynamo.reset()
        model = _model(args.layers, args.width)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if way == "torch.compile before":
            model = torch.compile(model)
        dmodel, dopt = lb.distribute(model, opt, lb.Strategy(fuse_grad_size_in_MB=args.bucket_mb))
        runs: Any = dmodel
        if way == "lb.compile after":
            lb.compile(dmodel)
        elif way == "model.compile() after":
            dmodel.compile()
        elif way == "plain torch.compile after":
            runs = torch.compile(dmodel)
        clock = _Clock()
        dmodel.reducer.observer = clock  # type: ignore[assignment]
        x = torch.randn(args.batch, args.width)
        fractions = []
        for _ in range(args.steps):
            dopt.zero_grad()
            loss = runs(x).square().mean()
            start = time.perf_counter()
            loss.backward()
            fractions.append(clock.fractions(start, time.perf_counter()))
            dopt.step()
        out[way] = fractions
    return out if lb.rank() == 0 else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64, help="samples per rank (default 64)")
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    from longboat.launch.local import launch_local

    result = launch_local(rank_main, (args,), nproc=2, timeout=1800)[0]
    print("| way of running | of the backward() call | of the autograd pass | per step (call) |")
    print("|---|---|---|---|")
    for way, fractions in result.items():
        call, autograd = (statistics.median(f[i] for f in fractions[1:]) for i in (0, 1))
        shown = ", ".join(f"{f[0]:.0%}" for f in fractions)
        print(f"| {way} | {call:.0%} | {autograd:.0%} | {shown} |")


if __name__ == "__main__":
    main()
