"""Live tensor bytes per rank after a training step: unsharded vs sharding stage 3 (FSDP2).

    python benchmarks/sharding_stage3_memory.py              # 4 Gloo ranks on the CPU

Each system trains a small tied-head transformer LM (``tests/sharding/_lm.py``) with AdamW for
a few steps; after the last ``optimizer.step()`` each rank counts every tensor storage alive in
the process once (parameters, gradients, optimizer state, buffers, anything else kept), a
sharded parameter by its local shard. Prints a Markdown table for docs/sharding.md.
"""

from __future__ import annotations

import argparse
import gc
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests._dist import run_ranks  # noqa: E402 - after the path tweak
from tests.sharding._lm import TiedLM  # noqa: E402

MB = 1e6
SYSTEMS = {"unsharded": None, "stage 3": 3}


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process, each once (DTensors by shard)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    warnings.simplefilter("ignore", FutureWarning)  # isinstance() on torch's deprecated names
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            t = obj._local_tensor if isinstance(obj, DTensor) else obj
            if t.is_meta or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, AttributeError, ReferenceError):
            continue
    return sum(seen.values())


def _measure(stage: int | None, args: argparse.Namespace) -> dict[str, Any]:
    import longboat as lb

    torch.manual_seed(0)
    net = TiedLM(args.vocab, args.dim, args.layers)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    strategy = lb.Strategy(allreduce_algorithm="native")
    if stage is not None:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage}
    model, opt = lb.distribute(net, optimizer, strategy)
    del net, optimizer
    g = torch.Generator().manual_seed(1 + lb.rank())
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        del logits
    gc.collect()
    live = live_tensor_bytes()
    return {"live": live}


def _rank(rank: int, world: int, stage: int | None, args: argparse.Namespace) -> dict[str, Any]:
    import longboat as lb

    lb.init(backend="gloo")
    return _measure(stage, args)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rows = {  # each system in processes of its own: nothing of another is left alive
        name: run_ranks(_rank, args.nproc, stage, args, timeout=900)
        for name, stage in SYSTEMS.items()
    }
    params = sum(p.numel() for p in TiedLM(args.vocab, args.dim, args.layers).parameters())
    print(
        f"tied-head LM (vocab {args.vocab}, dim {args.dim}, {args.layers} blocks): "
        f"{params / 1e6:.2f}M float32 parameters ({4 * params / MB:.1f} MB), AdamW, "
        f"{args.nproc} Gloo ranks; live tensor MB per rank after the step"
    )
    print("| system | " + " | ".join(f"rank {r}" for r in range(args.nproc)) + " |")
    print("|---" * (args.nproc + 1) + "|")
    for name in SYSTEMS:
        cells = " | ".join(f"{row['live'] / MB:.1f}" for row in rows[name])
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
