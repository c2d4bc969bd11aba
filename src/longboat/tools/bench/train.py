"""`longboat bench train`: training throughput and scaling, longboat and torch DDP side by side.

DLPerf's method: per rank count, every rank holds the same model twice, once under
``lb.distribute`` and once under ``DistributedDataParallel``; warm-up steps are discarded, then
timed rounds of ``--steps`` steps alternate between the two (order flipped every round, so
machine noise hits both alike), and the median round gives the step time. Reported per system and
rank count: samples/s (global batch / step time), speedup and scaling efficiency versus 1 rank,
and the longboat/DDP step-time ratio (median of adjacent round pairs). With ``--data loader`` the
batches come from a DataLoader over a synthetic dataset and the time spent waiting for them is
measured: a run that waits for input for more than `INPUT_BOUND_FRACTION` of its step is flagged
input-bound (more ranks will not make it faster; add loader workers).

``--device cuda`` runs one rank per GPU over NCCL (``resnet50`` and ``gpt2-small`` are sized
like ResNet-50 and GPT-2 small, with no torchvision needed); with ``--set amp=true`` the DDP and
no-sync baselines run under the same ``torch.autocast`` (and a GradScaler for float16), so every
system does the same arithmetic. The no-sync row is the plain training loop. DDP runs twice: at
its defaults, and "lean" (``broadcast_buffers=False, gradient_as_bucket_view=True``, what its
docs suggest for speed, and what longboat does by default); each ratio is paired round by round.
With ``--compile`` every system runs compiled: longboat through ``lb.compile`` (its graph cut at
longboat's buckets), DDP and the no-sync floor through ``torch.compile`` (DDP's graph cut at its
own buckets by torch), so the ratios compare compiled steps with compiled steps.

With sharding in longboat's Strategy (``--set sharding=true --set 'sharding_configs={"stage":
2}'``), two systems join the same rounds: longboat with that Strategy less sharding, and DDP
stepping torch's ``ZeroRedundancyOptimizer`` (ZeRO stage 1). A second table gives each one's
step time with its quartiles, sharded longboat over it (paired round by round) and its memory
per rank after the warm-up, the largest over the ranks: optimizer state and gradient bytes by
tensor storage, and on a GPU the bytes it keeps allocated and its peak (`train_memory`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from longboat.tools.bench.train_models import (
    MODELS,
    CausalLM,
    ModelSpec,
    SyntheticDataset,
    TinyTransformer,
    convnet,
    mlp,
    resnet,
    resnet50,
)
from longboat.tools.bench.train_rank import (
    CPU,
    DDP_LEAN,
    DDP_ZERO,
    NO_SYNC,
    UNSHARDED,
    Config,
    System,
    rank_main,
    train_step,
)
from longboat.tools.bench.train_report import (
    INPUT_BOUND_FRACTION,
    markdown,
    paired,
    plot,
    render,
    sharding_table,
    summarise,
)
from longboat.tools.progress import progress

__all__ = [
    "CPU",
    "DDP_LEAN",
    "DDP_ZERO",
    "INPUT_BOUND_FRACTION",
    "MODELS",
    "NO_SYNC",
    "UNSHARDED",
    "CausalLM",
    "Config",
    "ModelSpec",
    "SyntheticDataset",
    "System",
    "TinyTransformer",
    "add_arguments",
    "convnet",
    "markdown",
    "mlp",
    "paired",
    "plot",
    "rank_main",
    "render",
    "resnet",
    "resnet50",
    "run",
    "run_model",
    "sharding_table",
    "strategy_fields",
    "summarise",
    "train_step",
]


def run_model(
    config: Config, nprocs: Sequence[int], done: Callable[..., None] | None = None
) -> list[dict[str, Any]]:
    """Launch each rank count (local ranks), or measure in place under a launcher;
    ``done(last=...)`` is called after each rank count."""
    if "RANK" in os.environ:
        result = rank_main(config)
        return summarise({int(os.environ["WORLD_SIZE"]): result}) if result else []
    from longboat.launch.local import launch_local

    env = {"LONGBOAT_BACKEND": "nccl"} if config.device == "cuda" else None
    raw = {}
    for n in nprocs:
        raw[n] = launch_local(rank_main, (config,), nproc=n, env=env, timeout=3600)[0]
        if done is not None:
            done(last=f"{config.model} x{n}")
    return summarise(raw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="mlp", help=f"comma list of {', '.join(MODELS)} (default mlp)"
    )
    p.add_argument("--nproc", default="1,2", help="rank counts to run (default 1,2)")
    p.add_argument("--strategy", default=None, help="Strategy YAML/JSON file for longboat's side")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a Strategy field for longboat's side (YAML value), repeatable",
    )
    p.add_argument("--warmup", type=int, default=5, help="discarded warm-up steps (default 5)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed round (default 10)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per system (default 7)")
    p.add_argument(
        "--data",
        choices=("memory", "loader"),
        default="memory",
        help="input from one tensor in memory, or a DataLoader over synthetic samples",
    )
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers with --data loader")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (Gloo) or cuda (one GPU per rank, NCCL; --nproc at most the GPUs seen)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="run every system under torch.compile: longboat through lb.compile (cut at its "
        "buckets), DDP and no-sync through torch.compile",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--png", default=None, metavar="FILE", help="also plot samples/s vs ranks")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables")


def strategy_fields(path: str | None, sets: Sequence[str]) -> dict[str, Any]:
    """Fields from ``--strategy FILE`` (non-default ones) and ``--set`` on top."""
    import yaml

    from longboat.strategy import Strategy

    fields: dict[str, Any] = {}
    if path:
        loaded = Strategy.load(path)
        fields = {k: v for k, v in loaded.to_dict().items() if loaded.source(k) != "default"}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. nccl_comm_num=2")
        fields[key] = yaml.safe_load(value)
    Strategy(**fields)  # refuse bad fields here, before any rank starts
    return fields


def run(args: argparse.Namespace) -> int:
    models = args.model.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        print(f"longboat bench train: unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
        return 2
    nprocs = sorted({int(n) for n in args.nproc.split(",")})
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus == 0 or max(nprocs) > gpus:
            print(
                f"longboat bench train: --device cuda runs one rank per GPU; {gpus} GPU(s) "
                f"seen, --nproc asks for up to {max(nprocs)}"
            )
            return 2
    fields = strategy_fields(args.strategy, args.set)
    results: dict[str, list[dict[str, Any]]] = {}
    runs = len(models) * len(nprocs)
    with progress("bench train", runs, "RANK" not in os.environ, last="-") as done:
        for model in models:
            config = Config(
                model,
                args.warmup,
                args.steps,
                args.rounds,
                args.data,
                args.workers,
                fields,
                args.device,
                args.compile,
            )
            rows = run_model(config, nprocs, done)
            if rows:  # none on a non-zero rank under a launcher
                results[model] = rows
    for model, rows in results.items():
        print(markdown(model, rows)) if args.markdown else render(model, rows)
    if results and args.json:
        with open(args.json, "w") as f:
            json.dump({"strategy": fields, "results": results}, f, indent=1)
    if results and args.png:
        plot(results, args.png)
    return 0
