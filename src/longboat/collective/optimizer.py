"""The collective engine's optimizer stages (gradient merge, local SGD, AMP loss scaling, DGC
momentum; see `longboat.optim.staged` for their order) and Fleet's optimizer-fusion mapping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from longboat.collective.amp import LossScaler
from longboat.collective.localsgd import AdaptiveLocalSGD, LocalSGD
from longboat.collective.model import DistributedModel
from longboat.optim.staged import Stage, StagedOptimizer, StageKind, StepRest, ZeroGradRest


class MergeGate(Stage):
    """``step`` and ``zero_grad`` act only at gradient-merge boundaries."""

    kind = StageKind.GRADIENT_MERGE
    decides_on_gradients = True

    def __init__(self, model: DistributedModel) -> None:
        self.model = model

    def step(self, rest: StepRest, closure: Any = None, **kwargs: Any) -> Any:
        if not self.model.is_merge_boundary():
            return None
        return rest(closure, **kwargs)

    def zero_grad(self, rest: ZeroGradRest, set_to_none: bool) -> None:
        if self.model.is_merge_boundary():
            rest(set_to_none)


def use_multi_tensor_kernels(optimizer: torch.optim.Optimizer) -> bool:
    """Fleet's ``fuse_all_optimizer_ops``: torch's multi-tensor (foreach) optimizer path.

    Returns False when this optimizer has no foreach implementation.
    """
    if "foreach" not in optimizer.defaults:
        return False
    for group in optimizer.param_groups:
        group["foreach"] = True
    return True


class LocalSGDStep(Stage):
    """After each step, local SGD averages parameters on its schedule; the adaptive variant
    chooses its k from ``step(loss=...)`` and the learning rate of ``optimizer``."""

    kind = StageKind.LOCAL_SGD

    def __init__(self, sgd: LocalSGD | AdaptiveLocalSGD, optimizer: torch.optim.Optimizer) -> None:
        self.sgd, self.optimizer = sgd, optimizer

    def step(self, rest: StepRest, closure: Any = None, **kwargs: Any) -> Any:
        loss = kwargs.pop("loss", None)
        result = rest(closure, **kwargs)
        sgd = self.sgd
        if isinstance(sgd, AdaptiveLocalSGD):
            if loss is None:
                raise ValueError(
                    "adaptive_localsgd chooses k from the loss: call optimizer.step(loss=loss)"
                )
            sgd.step(loss, lr=self.optimizer.param_groups[0]["lr"])
        else:
            sgd.step()
        return result


class LossScaling(Stage):
    """Skip the step when the reduced gradients overflowed (on every rank); adapt the scale."""

    kind = StageKind.LOSS_SCALING
    decides_on_gradients = True

    def __init__(self, model: DistributedModel) -> None:
        self.model = model  # its reducer is read at each step: a rebuild replaces it

    @property
    def scaler(self) -> LossScaler:
        assert self.model.amp is not None and self.model.amp.scaler is not None
        return self.model.amp.scaler

    def step(self, rest: StepRest, closure: Any = None, **kwargs: Any) -> Any:
        model = self.model
        finite = model.reducer.last_finite
        result = rest(closure, **kwargs) if finite else None
        self.scaler.update(finite)
        return result


class DGCMomentum(Stage):
    """Once DGC sends sparse it applies the momentum, so the optimizer's is off for the step."""

    kind = StageKind.DGC_MOMENTUM
    decides_on_gradients = True

    def __init__(self, compressors: Sequence[Any], optimizer: torch.optim.Optimizer) -> None:
        self.compressors = list(compressors)  # the DGC compressors' states (``sparse_active``)
        self.optimizer = optimizer

    def step(self, rest: StepRest, closure: Any = None, **kwargs: Any) -> Any:
        if not any(c.sparse_active for c in self.compressors):
            return rest(closure, **kwargs)
        groups = self.optimizer.param_groups
        saved = [g["momentum"] for g in groups]
        for g in groups:
            g["momentum"] = 0.0
        try:
            return rest(closure, **kwargs)
        finally:
            for g, m in zip(groups, saved, strict=True):
                g["momentum"] = m


def dgc_momentum(optimizer: torch.optim.Optimizer | None) -> float:
    """The momentum DGC takes over from ``optimizer``; raises if DGC cannot wrap it."""
    if isinstance(optimizer, StagedOptimizer):
        optimizer = optimizer.inner
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
