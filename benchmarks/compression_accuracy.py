"""Every training method of the demo task against the uncompressed baseline, same run.

    python benchmarks/compression_accuracy.py --seeds 0,1,2 --epochs 20

For each seed and method (``longboat.tools.demo_methods.METHODS``) 2 local Gloo ranks train
the demo convnet on scikit-learn's digits; reports the test accuracy (mean over seeds), its
difference from ``baseline`` in percentage points (paired by seed), and the gradient bytes
rank 0 sent per step (mean, and in the last step: after every warm-up) with their ratios to
the baseline's, as a Markdown table for
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics

from longboat.launch.local import launch_local
from longboat.tools.demo_methods import METHODS
from longboat.tools.demo_train import DemoConfig, train_rank


def run_method(method: str, seed: int, epochs: int) -> dict[str, float]:
    cfg = DemoConfig(2, epochs, 64, 0.05, 0.9, seed, method)
    first = launch_local(train_rank, (cfg,), nproc=2)[0]
    return {
        "accuracy": first["accuracy"],
        "bytes": first["bytes_per_step"],
        "last": first["last_step_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    methods = ["baseline", *(m for m in args.methods.split(",") if m != "baseline")]
    runs = {m: [run_method(m, s, args.epochs) for s in seeds] for m in methods}
    base = runs["baseline"]
    print(f"demo task, 2 ranks, {args.epochs} epochs, seeds {args.seeds}\n")
    print(
        "| method | test accuracy (mean) | Δ vs baseline (pp, mean / worst) "
        "| bytes/step (mean) | ratio | last step's bytes | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for m in methods:
        acc = [r["accuracy"] for r in runs[m]]
        delta = [100 * (a - b["accuracy"]) for a, b in zip(acc, base, strict=True)]
        nbytes = statistics.median(r["bytes"] for r in runs[m])
        ratio = nbytes / statistics.median(r["bytes"] for r in base)
        last = statistics.median(r["last"] for r in runs[m])
        last_ratio = last / statistics.median(r["last"] for r in base)
        print(
            f"| {m} | {100 * statistics.mean(acc):.2f} % | {statistics.mean(delta):+.2f} / "
            f"{min(delta):+.2f} | {nbytes:,.0f} | {ratio:.3f} | {last:,.0f} | {last_ratio:.4f} |"
        )


if __name__ == "__main__":
    main()
