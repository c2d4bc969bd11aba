"""Optimizers that run on the servers: dense blocks use torch's own optimizers (same math as the
trainer would run), sparse table rows use per-row SGD / Adagrad / Adam written here.

Hyper-parameters cross the wire as JSON; only the keys listed in ``HPARAMS`` are accepted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from longboat.registry import Registry

DenseFactory = Callable[[list[torch.Tensor], dict[str, Any]], torch.optim.Optimizer]
DENSE: Registry[DenseFactory] = Registry("server optimizer")

HPARAMS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 0.01, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
    "adam": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False},
    "adagrad": {
        "lr": 0.01,
        "lr_decay": 0.0,
        "weight_decay": 0.0,
        "initial_accumulator_value": 0.0,
        "eps": 1e-10,
    },
}
_TORCH_CLASSES = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.Adagrad: "adagrad"}


def check_hparams(name: str, hparams: dict[str, Any]) -> dict[str, Any]:
    """``hparams`` completed with defaults; raises ValueError for unknown names or keys."""
    if name not in HPARAMS:
        raise ValueError(f"unknown server optimizer {name!r}; choose one of {sorted(HPARAMS)}")
    unknown = set(hparams) - set(HPARAMS[name])
    if unknown:
        raise ValueError(f"server optimizer {name!r} has no hyper-parameter(s) {sorted(unknown)}")
    out = {**HPARAMS[name], **hparams}
    for key, value in out.items():
        default = HPARAMS[name][key]
        numbers = value if isinstance(value, list) else [value]
        if (
            isinstance(value, list) != isinstance(default, list)
            or (isinstance(value, list) and len(value) != len(default))
            or not all(isinstance(v, int | float) and math.isfinite(v) for v in numbers)
        ):
            shape = f"a list of {len(default)} numbers" if isinstance(default, list) else "a number"
            raise ValueError(f"hyper-parameter {name}.{key} must be {shape}, got {value!r}")
    return out


@DENSE.register("sgd")
def _sgd(params: list[torch.Tensor], h: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, **h)


@DENSE.register("adam")
def _adam(params: list[torch.Tensor], h: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, **{**h, "betas": tuple(h["betas"])})


@DENSE.register("adagrad")
def _adagrad(params: list[torch.Tensor], h: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(params, **h)


def make_dense(
    name: str, params: list[torch.Tensor], hparams: dict[str, Any]
) -> torch.optim.Optimizer:
    """A torch optimizer over a server's block tensors."""
    return DENSE.get(name)(params, check_hparams(name, hparams))


def describe_torch_optimizer(opt: torch.optim.Optimizer) -> tuple[str, list[dict[str, Any]]]:
    """(server optimizer name, hyper-parameters of each param group) for a trainer's optimizer."""
    name = next((n for cls, n in _TORCH_CLASSES.items() if type(opt) is cls), None)
    if name is None:
        raise ValueError(
            f"the servers can run {', '.join(c.__name__ for c in _TORCH_CLASSES)}, not "
            f"{type(opt).__name__}; use one of those, or set a_sync_configs['update_on_server']"
            "=False (sync mode) so the trainers run it"
        )
    groups = []
    for group in opt.param_groups:
        h = {k: group[k] for k in HPARAMS[name] if k in group}
        if "betas" in h:
            h["betas"] = [float(b) for b in h["betas"]]
        if isinstance(h.get("lr"), torch.Tensor):
            h["lr"] = float(h["lr"])
        groups.append(h)
    return name, groups


# ---- sparse rows ------------------------------------------------------------------------------

ROW_STATES: dict[str, tuple[str, ...]] = {
    "sgd": (),
    "adagrad": ("sum",),
    "adam": ("exp_avg", "exp_avg_sq"),
}


@torch.no_grad()
def apply_rows(
    name: str,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
    h: dict[str, Any],
    step: int,
) -> None:
    """Update ``weight[rows]`` (unique local row indices) with ``grad``; ``step`` counts from 1.

    SGD and Adagrad equal torch's dense optimizers on rows with zero gradient left alone;
    Adam is torch.optim.SparseAdam's lazy Adam (only the rows in the batch move).
    """
    lr = float(h["lr"])
    if name == "sgd":
        weight.index_add_(0, rows, grad, alpha=-lr)
    elif name == "adagrad":
        total = state["sum"][rows].addcmul_(grad, grad)
        state["sum"][rows] = total
        clr = lr / (1 + (step - 1) * float(h["lr_decay"]))
        weight.index_add_(0, rows, grad / (total.sqrt() + float(h["eps"])), alpha=-clr)
    elif name == "adam":
        beta1, beta2 = (float(b) for b in h["betas"])
        old_avg, old_sq = state["exp_avg"][rows], state["exp_avg_sq"][rows]
        avg = old_avg + (grad - old_avg) * (1 - beta1)
        sq = old_sq + (grad * grad - old_sq) * (1 - beta2)
        state["exp_avg"][rows], state["exp_avg_sq"][rows] = avg, sq
        step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        weight.index_add_(0, rows, avg / (sq.sqrt() + float(h["eps"])), alpha=-step_size)
    else:
        raise ValueError(f"unknown sparse optimizer {name!r}; choose one of {sorted(ROW_STATES)}")


def row_state(
    name: str, h: dict[str, Any], shape: tuple[int, ...], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Fresh per-row optimizer state for a table shard of ``shape``."""
    if name not in ROW_STATES:
        raise ValueError(f"unknown sparse optimizer {name!r}; choose one of {sorted(ROW_STATES)}")
    init = float(h.get("initial_accumulator_value", 0.0))
    return {
        s: torch.full(shape, init if s == "sum" else 0.0, dtype=dtype) for s in ROW_STATES[name]
    }


@torch.no_grad()
def update_rows(
    name: str,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    grad: torch.Tensor,
    h: dict[str, Any],
    step: int,
) -> None:
    """``apply_rows`` on gathered rows: update ``weight`` (the touched rows, one per ``grad``
    row) and ``state`` (the same rows of each state tensor) in place."""
    lr = float(h["lr"])
    if name == "sgd":
        weight.add_(grad, alpha=-lr)
    elif name == "adagrad":
        total = state["sum"].addcmul_(grad, grad)
        clr = lr / (1 + (step - 1) * float(h["lr_decay"]))
        weight.add_(grad / (total.sqrt() + float(h["eps"])), alpha=-clr)
    elif name == "adam":
        beta1, beta2 = (float(b) for b in h["betas"])
        avg, sq = state["exp_avg"], state["exp_avg_sq"]
        avg.add_((grad - avg) * (1 - beta1))
        sq.add_((grad * grad - sq) * (1 - beta2))
        step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        weight.add_(avg / (sq.sqrt() + float(h["eps"])), alpha=-step_size)
    else:
        raise ValueError(f"unknown sparse optimizer {name!r}; choose one of {sorted(ROW_STATES)}")
