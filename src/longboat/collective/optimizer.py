"""Optimizer glue: gradient-merge gating and Fleet's optimizer-fusion mapping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from longboat.collective.localsgd import AdaptiveLocalSGD, LocalSGD
from longboat.collective.model import DistributedModel
from longboat.optim.extend import extend


class _MergeGate:
    """Mixin: ``step`` and ``zero_grad`` act only at gradient-merge boundaries."""

    _lb_model: DistributedModel

    def step(self, closure: Any = None) -> Any:
        if not self._lb_model.is_merge_boundary():
            return None
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._lb_model.is_merge_boundary():
            super().zero_grad(set_to_none)  # type: ignore[misc]


def gate_for_gradient_merge(
    optimizer: torch.optim.Optimizer, model: DistributedModel
) -> torch.optim.Optimizer:
    """Make ``optimizer`` skip ``step``/``zero_grad`` between merge boundaries (in place)."""
    if isinstance(optimizer, _MergeGate):
        raise ValueError("this optimizer was already passed to lb.distribute")
    return extend(optimizer, _MergeGate, "Merged", _lb_model=model)


def use_multi_tensor_kernels(optimizer: torch.optim.Optimizer) -> bool:
    """Fleet's ``fuse_all_optimizer_ops``: torch's multi-tensor (foreach) optimizer path.

    Returns False when this optimizer has no foreach implementation.
    """
    if "foreach" not in optimizer.defaults:
        return False
    for group in optimizer.param_groups:
        group["foreach"] = True
    return True


class _LocalSGDStep:
    """Mixin: after each optimizer step, local SGD averages parameters on its schedule."""

    _lb_local_sgd: LocalSGD | AdaptiveLocalSGD

    def step(self, closure: Any = None, *, loss: Any = None) -> Any:
        result = super().step(closure)  # type: ignore[misc]
        sgd = self._lb_local_sgd
        if isinstance(sgd, AdaptiveLocalSGD):
            if loss is None:
                raise ValueError(
                    "adaptive_localsgd chooses k from the loss: call optimizer.step(loss=loss)"
                )
            sgd.step(loss, lr=self.param_groups[0]["lr"])  # type: ignore[attr-defined]
        else:
            sgd.step()
        return result


def attach_local_sgd(
    optimizer: torch.optim.Optimizer, sgd: LocalSGD | AdaptiveLocalSGD
) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` also run local SGD's parameter averaging (in place)."""
    return extend(optimizer, _LocalSGDStep, "LocalSGD", _lb_local_sgd=sgd)


class _AmpStep:
    """Mixin: skip the step when the reduced gradients overflowed; adapt the loss scale."""

    _lb_model: DistributedModel

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        model = self._lb_model
        finite = model.reducer.last_finite
        result = super().step(closure, **kwargs) if finite else None  # type: ignore[misc]
        assert model.amp is not None and model.amp.scaler is not None
        model.amp.scaler.update(finite)
        return result


def attach_loss_scaling(
    optimizer: torch.optim.Optimizer, model: DistributedModel
) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` skip overflowed steps on every rank (in place)."""
    return extend(optimizer, _AmpStep, "Amp", _lb_model=model)


class _DGCStep:
    """Mixin: once DGC sends sparse, it applies the momentum, so SGD's is off for the step."""

    _lb_dgc: Sequence[Any]  # the DGC compressors (``sparse_active``)

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        if not any(c.sparse_active for c in self._lb_dgc):
            return super().step(closure, **kwargs)  # type: ignore[misc]
        groups = self.param_groups  # type: ignore[attr-defined]
        saved = [g["momentum"] for g in groups]
        for g in groups:
            g["momentum"] = 0.0
        try:
            return super().step(closure, **kwargs)  # type: ignore[misc]
        finally:
            for g, m in zip(groups, saved, strict=True):
                g["momentum"] = m


def dgc_momentum(optimizer: torch.optim.Optimizer | None) -> float:
    """The momentum DGC takes over from ``optimizer``; raises if DGC cannot wrap it."""
    if not isinstance(optimizer, torch.optim.SGD):
        got = "no optimizer" if optimizer is None else type(optimizer).__name__
        raise ValueError(
            f"dgc=True needs torch.optim.SGD (with or without momentum), got {got}: DGC applies "
            "the momentum itself before sparsifying (Fleet's DGCMomentumOptimizer)"
        )
    groups = optimizer.param_groups
    momenta = {float(g["momentum"]) for g in groups}
    if len(momenta) != 1:
        raise ValueError(f"dgc=True needs one momentum for all parameter groups, got {momenta}")
    if any(g["nesterov"] or g["dampening"] for g in groups):
        raise ValueError("dgc=True supports SGD momentum without nesterov and dampening=0")
    return momenta.pop()


def attach_dgc(
    optimizer: torch.optim.Optimizer, compressors: Sequence[Any]
) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` skip its own momentum while DGC is sparse (in place)."""
    return extend(optimizer, _DGCStep, "DGC", _lb_dgc=list(compressors))
