"""``hvd.DistributedOptimizer``'s arguments checked as Horovod checks them: the op and options,
the parameters' names, and the same parameters on every rank."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from longboat.comm.exchange import allgather_bytes
from longboat.horovod.torch.compression import Compression, Compressor
from longboat.horovod.torch.negotiation import ReduceOp
from longboat.horovod.torch.ops import Average, Sum
from longboat.optim.staged import already_distributed, is_distributed


def checked_arguments(
    optimizer: torch.optim.Optimizer,
    op: ReduceOp,
    gradient_predivide_factor: float,
    backward_passes_per_step: int,
    compression: type[Compressor],
) -> ReduceOp:
    """DistributedOptimizer's arguments refused as Horovod refuses them (and an optimizer
    another wrapper already averages); the op as a ReduceOp."""
    if is_distributed(optimizer):  # its gradients are averaged already: twice is refused
        raise ValueError(
            f"{already_distributed(optimizer)}: pass hvd.DistributedOptimizer the plain "
            "optimizer, and use one of the two"
        )
    op = ReduceOp(int(op))
    if op == ReduceOp.Adasum:
        raise NotImplementedError(
            "op=hvd.Adasum is not implemented in longboat.horovod; use hvd.Average or hvd.Sum"
        )
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer supports op=hvd.Average or hvd.Sum, got {op.name}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if compression not in (Compression.none, Compression.fp16):
        raise ValueError(
            "DistributedOptimizer supports compression=hvd.Compression.none or "
            "hvd.Compression.fp16 (longboat's fused fp16 compressor); custom compressors work "
            "with hvd.allreduce"
        )
    return op


def all_named(
    optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, Any]] | None
) -> list[tuple[str, Any]]:
    """``named_parameters`` as a list, or Horovod's generated names
    ``allreduce.noname.<group>.<index>`` for every parameter of every param group."""
    if named_parameters is not None:
        return list(named_parameters)
    return [
        (f"allreduce.noname.{i}.{j}", p)
        for i, group in enumerate(optimizer.param_groups)
        for j, p in enumerate(group["params"])
    ]


def parameter_names(named: list[tuple[str, Any]]) -> dict[torch.Tensor, str]:
    """Horovod's ``parameter_names``: parameter -> name, in name order."""
    if any(not isinstance(item, tuple) for item in named):
        return {}  # refused by trainable_named with Horovod's message
    return {p: n for n, p in sorted(named, key=lambda item: item[0])}


def trainable_named(
    optimizer: torch.optim.Optimizer, named: list[tuple[str, Any]]
) -> list[tuple[str, nn.Parameter]]:
    """The optimizer's trainable parameters with their names, in model order; Horovod's errors.

    ``named``: from `all_named` (generated names when the caller gave none).
    """
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually "
            "produced by model.named_parameters()."
        )
    dups = sorted(n for n, count in Counter(n for n, _ in named).items() if count > 1)
    if dups:
        raise ValueError(
            "Parameter names in named_parameters must be unique. Found duplicates: "
            + ", ".join(dups)
        )
    unnamed = {id(p) for p in in_optimizer} - {id(p) for _, p in named}
    if unnamed:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not "
            "named. Python object ids: " + ", ".join(map(str, sorted(unnamed)))
        )
    wanted = {id(p) for p in in_optimizer}
    chosen = [(n, p) for n, p in named if id(p) in wanted and p.requires_grad]
    if not chosen:
        raise ValueError("the optimizer has no parameters that require grad: nothing to reduce")
    return chosen


def check_same_everywhere(named: list[tuple[str, nn.Parameter]], group: Any = None) -> None:
    """Every rank must reduce the same names, shapes and dtypes, in the same order."""
    mine = [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in named]
    everyone = [json.loads(b) for b in allgather_bytes(json.dumps(mine).encode(), group)]
    for r, theirs in enumerate(everyone[1:], start=1):
        if theirs == everyone[0]:
            continue
        for a, b in zip(everyone[0], theirs, strict=False):
            if a != b:
                raise ValueError(
                    f"Mismatched DistributedOptimizer parameters: rank 0 has {a[0]!r} "
                    f"{a[1]} {a[2]}, rank {r} has {b[0]!r} {b[1]} {b[2]} at the same position. "
                    "Every rank must build the same model and pass the same named_parameters"
                )
        raise ValueError(
            f"Mismatched DistributedOptimizer parameters: rank 0 has {len(everyone[0])} "
            f"parameters to reduce, rank {r} has {len(theirs)}"
        )
