"""What ``KVStore.set_optimizer`` takes: MXNet's optimizer names and arguments, run as torch's
optimizers on the servers (``longboat.ps.shared.optim``).

    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1/256))
    kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=1e-3))
    kv.set_optimizer(torch.optim.SGD(params, lr=0.1))  # a torch optimizer's first group works too

``rescale_grad`` multiplies every pushed gradient before it leaves the worker (MXNet applies it
inside the update: the same arithmetic). ``wd`` is L2 weight decay added to the gradient, as in
both MXNet and torch. SGD (with momentum) matches MXNet's update exactly; Adam and AdaGrad are
torch's, whose ``eps`` sits outside the square root (MXNet's AdaGrad puts it inside).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from longboat.ps.shared.optim import check_hparams, describe_torch_optimizer


@dataclass(frozen=True)
class Optimizer:
    """A server optimizer: ``name`` of ``longboat.ps.shared.optim.HPARAMS``, its hyper-parameters
    (torch's names) and the gradient scale applied on the worker."""

    name: str
    hparams: dict[str, Any] = field(default_factory=dict)
    rescale_grad: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "hparams", check_hparams(self.name, dict(self.hparams)))


def SGD(  # noqa: N802 - MXNet's class-like spelling
    learning_rate: float = 0.01, momentum: float = 0.0, wd: float = 0.0, rescale_grad: float = 1.0
) -> Optimizer:
    return Optimizer(
        "sgd", {"lr": learning_rate, "momentum": momentum, "weight_decay": wd}, rescale_grad
    )


def Adam(  # noqa: N802
    learning_rate: float = 0.001,
    beta1: float = 0.9,
    beta2: float = 0.999,
    epsilon: float = 1e-8,
    wd: float = 0.0,
    rescale_grad: float = 1.0,
) -> Optimizer:
    hparams = {"lr": learning_rate, "betas": [beta1, beta2], "eps": epsilon, "weight_decay": wd}
    return Optimizer("adam", hparams, rescale_grad)


def AdaGrad(  # noqa: N802
    learning_rate: float = 0.01, eps: float = 1e-7, wd: float = 0.0, rescale_grad: float = 1.0
) -> Optimizer:
    return Optimizer("adagrad", {"lr": learning_rate, "eps": eps, "weight_decay": wd}, rescale_grad)


_BY_NAME = {"sgd": SGD, "adam": Adam, "adagrad": AdaGrad}


def create(name: str, **kwargs: Any) -> Optimizer:
    """``create("sgd", learning_rate=0.1)``: MXNet's ``mx.optimizer.create``."""
    factory = _BY_NAME.get(name.lower())
    if factory is None:
        raise ValueError(f"unknown optimizer {name!r}; the servers run {sorted(_BY_NAME)}")
    return factory(**kwargs)


def as_optimizer(optimizer: Optimizer | torch.optim.Optimizer) -> Optimizer:
    """``optimizer`` as a server ``Optimizer`` (a torch optimizer: its first param group)."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        name, groups = describe_torch_optimizer(optimizer)
        return Optimizer(name, groups[0])
    raise TypeError(
        f"set_optimizer takes a longboat.kvstore.optimizer.Optimizer (e.g. "
        f"kvstore.optimizer.SGD(learning_rate=0.1)) or a torch SGD/Adam/Adagrad, "
        f"not {type(optimizer).__name__}"
    )


__all__ = ["SGD", "AdaGrad", "Adam", "Optimizer", "as_optimizer", "create"]
