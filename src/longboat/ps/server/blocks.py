"""A server's dense blocks: a value, its optimizer and a version (updates applied).

A push's effect depends on the block's ``update``: "optimizer" (a server-side optimizer step),
"sum" (the value becomes the mean gradient: trainers run the optimizer), "delta" (geo: the
value moves by the pushed delta) or "assign" (kv default: the value becomes the push).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from longboat.ps.shared import optim
from longboat.ps.shared.request import RequestError, meta_int

UPDATES = ("optimizer", "sum", "delta", "assign")
REDUCES = ("mean", "sum")


@dataclass
class DenseBlock:
    value: torch.Tensor
    update: str
    sync: bool
    optimizer: str | None
    hparams: dict[str, Any]
    group: int = 0
    opt: torch.optim.Optimizer | None = None
    version: int = 0
    pending: dict[int, torch.Tensor] = field(default_factory=dict)
    reduce: str = "mean"  # how one step's pushes of all trainers combine (sync), or scale (async)
    round_lr: tuple[int, Any] | None = None  # (trainer, learning rate) of this step's first push


def make_block(key: str, spec: dict[str, Any], value: torch.Tensor, sync: bool) -> DenseBlock:
    """A block holding ``value`` configured by ``spec`` (update, optimizer, hparams, ...)."""
    update = spec.get("update", "optimizer")
    if update not in UPDATES:
        raise RequestError(f"block {key!r}: update must be one of {UPDATES}, got {update!r}")
    reduce = spec.get("reduce", "mean")
    if reduce not in REDUCES:
        raise RequestError(f"block {key!r}: reduce must be one of {REDUCES}, got {reduce!r}")
    name = spec.get("optimizer") if update == "optimizer" else None
    if update == "optimizer" and not (isinstance(name, str) and value.is_floating_point()):
        raise RequestError(
            f"block {key!r}: update 'optimizer' needs an optimizer name and a floating-point "
            f"value, got {name!r} and {value.dtype}"
        )
    hparams = spec.get("hparams") or {}
    if not isinstance(hparams, dict):
        raise RequestError(f"block {key!r}: hparams must be an object")
    group = meta_int(spec, "group", 0)
    if group < 0:
        raise RequestError(f"block {key!r}: 'group' must be >= 0, got {group}")
    block = DenseBlock(value, update, sync, name, hparams, group, reduce=reduce)
    if name is not None:
        try:
            block.opt = optim.make_dense(name, [block.value], hparams)
        except (ValueError, TypeError, IndexError, KeyError) as exc:  # torch's own checks too
            raise RequestError(f"block {key!r}: {type(exc).__name__}: {exc}") from None
    return block


def apply_block(block: DenseBlock, grad: torch.Tensor, lr: Any) -> None:
    """Apply one (combined) push to ``block`` by its update rule; bump its version."""
    with torch.no_grad():
        if block.update == "optimizer":
            assert block.opt is not None
            if lr is not None:
                block.opt.param_groups[0]["lr"] = float(lr)
            block.value.grad = grad
            block.opt.step()
            block.value.grad = None
        elif block.update == "sum":
            block.value.copy_(grad)
        elif block.update == "delta":
            block.value.add_(grad)
        else:
            block.value.copy_(grad)
    block.version += 1


def block_state(block: DenseBlock) -> dict[str, Any]:
    """``block`` for a checkpoint (tensors, numbers, strings: weights_only-safe)."""
    config = {
        "group": block.group,
        "update": block.update,
        "sync": block.sync,
        "optimizer": block.optimizer,
        "hparams": block.hparams,
        "reduce": block.reduce,
    }
    return {
        "value": block.value.detach().clone(),
        "version": block.version,
        "config": json.dumps(config),
        "opt": block.opt.state_dict() if block.opt is not None else {},
    }


def load_block(saved: dict[str, Any]) -> DenseBlock:
    """The block a ``block_state`` describes."""
    cfg = json.loads(saved["config"])
    block = DenseBlock(
        saved["value"].clone(),
        cfg["update"],
        cfg["sync"],
        cfg["optimizer"],
        cfg["hparams"],
        cfg["group"],
        version=int(saved["version"]),
        reduce=cfg.get("reduce", "mean"),
    )
    if cfg["optimizer"] is not None:
        block.opt = optim.make_dense(cfg["optimizer"], [block.value], cfg["hparams"])
        block.opt.load_state_dict(saved["opt"])
    return block
