"""Cost of the timeline and stall-inspector hooks per training step, measured in process.

    python benchmarks/timeline_overhead.py --buckets 8 --steps 20000

Drives an `Observer` through the calls one synchronised step makes (forward begin/end, per
bucket: ready, launched (+ completion callback); backward end, synced, optimizer step) with the
timeline off / stall inspector on / timeline on, and reports microseconds per step. The
end-to-end comparison against DDP in the same run is `longboat bench train --set timeline=...`.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from longboat.trace.observer import Observer
from longboat.trace.recorder import Recorder
from longboat.trace.stall import StallWatch


def per_step_us(observer: Observer | None, buckets: int, steps: int) -> float:
    """Per step: the hooks' calls (skipped without observer) around the same stand-in work
    (one future per bucket, completed after backward)."""
    tensor = torch.zeros(1024)
    on = observer is not None
    start = time.perf_counter()
    for _ in range(steps):
        if on:
            observer.forward_begin()
            observer.forward_end(tensor)
        futures = []
        for b in range(buckets):
            future: torch.futures.Future = torch.futures.Future()
            if on:
                observer.bucket_ready(b)
                observer.launched(b, b % 2, tensor, future)
            futures.append(future)
        if on:
            observer.backward_end()
        for f in futures:
            f.set_result(None)
        if on:
            observer.synced()
            with observer.optimizer_step():
                pass
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args()
    store = torch.distributed.HashStore()
    names = [[f"layer{b}.weight"] for b in range(args.buckets)]
    with tempfile.TemporaryDirectory() as tmp:
        watch = StallWatch(store, "bench", 0, 2, names, warning_s=60.0)
        cases = {
            "no observer (timeline off, stall inspector off)": None,
            "stall inspector only (default)": Observer(None, watch, "native"),
            "timeline on + stall inspector": Observer(
                Recorder(f"{tmp}/t.json", 0, 1, 2), watch, "native"
            ),
        }
        base = per_step_us(None, args.buckets, args.steps)
        print(f"| hooks ({args.buckets} buckets per step) | µs added per step |")
        print("|---|---|")
        for label, observer in cases.items():
            added = per_step_us(observer, args.buckets, args.steps) - base
            print(f"| {label} | {max(added, 0.0):.1f} |")
        watch.close()


if __name__ == "__main__":
    main()
