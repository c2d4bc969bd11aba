"""Local SGD: average parameters every k optimizer steps instead of gradients every step.

This is Fleet's ``localsgd`` / ``adaptive_localsgd`` meta-optimizer. Gradients are *not*
allreduced: every rank takes optimizer steps on its own gradients, and the parameters are
averaged across ranks

* at every step ``t <= begin_step`` (plain synchronous data parallelism for SGD), and
* after that, whenever ``t - last_sync == k`` (every ``k`` steps).

Steps are counted from 1 by :meth:`LocalSGD.step`, which the optimizer wrapper calls right
after each ``optimizer.step()``. One averaging is one coalesced allreduce per (device, dtype)
bucket of the parameters, divided by the world size.

:class:`AdaptiveLocalSGD` recomputes ``k`` at every averaging from the cross-rank mean loss and
the learning rate, as Fleet's ``AdaptiveLocalSGDOptimizer`` does::

    k = clamp(ceil(sqrt(lr_0 * loss_t / (lr_t * loss_0) * init_k_steps)), 1, 16)

where ``loss_0`` and ``lr_0`` are the mean loss and learning rate of step 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from longboat.trace.stall import waiting

__all__ = ["AdaptiveLocalSGD", "LocalSGD"]


def _check_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class LocalSGD:
    """Parameter averaging every ``k_steps`` optimizer steps (Fleet's ``localsgd_configs``).

    Args:
        model_params: the parameters to average (e.g. ``model.parameters()``); every rank
            must pass the same shapes in the same order. Shared tensors are averaged once.
        group: process group to average over; ``None`` is the default (world) group.
        k_steps: optimizer steps between averagings once ``begin_step`` has passed.
        begin_step: parameters are averaged at every step up to and including this one.

    Counters: ``communication_rounds`` (averagings done), ``allreduce_calls`` (collectives
    issued, loss averages of the adaptive variant included) and ``bytes_communicated``
    (payload bytes this rank put into those allreduces). With a single rank nothing is sent
    and the counters stay 0, but :meth:`step` still reports the schedule.
    """

    def __init__(
        self,
        model_params: Iterable[torch.Tensor],
        group: dist.ProcessGroup | None = None,
        k_steps: int = 1,
        begin_step: int = 1,
    ) -> None:
        self._k_steps = _check_int(k_steps, "localsgd_configs.k_steps")
        self.begin_step = _check_int(begin_step, "localsgd_configs.begin_step")
        self.group = group
        self._params = self._unique(model_params)
        self._buckets = self._bucket(self._params)
        self.step_count = 0
        self.last_sync_step = 0
        self.communication_rounds = 0
        self.allreduce_calls = 0
        self.bytes_communicated = 0

    @staticmethod
    def _unique(model_params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        seen: set[int] = set()
        params: list[torch.Tensor] = []
        for i, p in enumerate(model_params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"model_params[{i}] is a {type(p).__name__}, not a tensor")
            if not (p.is_floating_point() or p.is_complex()):
                raise TypeError(
                    f"model_params[{i}] has dtype {p.dtype}; only floating-point parameters "
                    "can be averaged"
                )
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        if not params:
            raise ValueError("LocalSGD got no parameters to average")
        return params

    @staticmethod
    def _bucket(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            buckets.setdefault((p.device, p.dtype), []).append(p)
        return list(buckets.values())

    @property
    def k_steps(self) -> int:
        """Current number of local steps between averagings."""
        return self._k_steps

    @property
    def world_size(self) -> int:
        """Ranks in ``group``; 1 when torch.distributed is not initialised."""
        if not (dist.is_available() and dist.is_initialized()):
            if self.group is not None:
                raise RuntimeError(
                    "LocalSGD was given a process group but torch.distributed "
                    "is not initialised; call lb.init() first"
                )
            return 1
        return dist.get_world_size(self.group)

    def _is_sync_step(self) -> bool:
        if self.step_count <= self.begin_step:
            return True
        return self.step_count - self.last_sync_step >= self._k_steps

    def step(self) -> bool:
        """Count one optimizer step; average the parameters if it is a sync step.

        Returns whether the parameters were averaged at this step.
        """
        self.step_count += 1
        if not self._is_sync_step():
            return False
        self.average_parameters()
        return True

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Average the parameters across ranks now (one allreduce per dtype bucket)."""
        self.last_sync_step = self.step_count
        world = self.world_size
        if world == 1:
            return
        for i, bucket in enumerate(self._buckets):
            flat = _flatten_dense_tensors([p.detach() for p in bucket])
            with waiting(f"local SGD averaging of bucket {i}", self.group):
                self._allreduce(flat)
            flat.div_(world)
            for p, avg in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                p.detach().copy_(avg)
        self.communication_rounds += 1

    def _allreduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        self.allreduce_calls += 1
        self.bytes_communicated += tensor.numel() * tensor.element_size()

    def state_dict(self) -> dict[str, Any]:
        """Schedule state for checkpoints (the parameters themselves are the model's)."""
        return {
            "k_steps": self._k_steps,
            "step_count": self.step_count,
            "last_sync_step": self.last_sync_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._k_steps = int(state["k_steps"])
        self.step_count = int(state["step_count"])
        self.last_sync_step = int(state["last_sync_step"])


class AdaptiveLocalSGD(LocalSGD):
    """Local SGD whose ``k`` follows the loss and learning rate (Fleet's adaptive local SGD).

    ``step(loss, lr)`` must be called after every optimizer step with this rank's loss of that
    step and the current learning rate. At step 1, and at every averaging, the loss is
    averaged across ranks (one extra small allreduce) so every rank computes the same ``k``::

        k = clamp(ceil(sqrt(lr_0 * loss_t / (lr_t * loss_0) * init_k_steps)), 1, 16)

    As in Fleet, step 1 always averages (``begin_step >= 1``), so ``init_k_steps`` acts only
    through this formula. A ratio that is undefined or negative (losses that are not
    positive) leaves ``k`` unchanged; an infinite one (``lr_t == 0``) gives 16.
    """

    MIN_K_STEPS = 1
    MAX_K_STEPS = 16

    def __init__(
        self,
        model_params: Iterable[torch.Tensor],
        group: dist.ProcessGroup | None = None,
        init_k_steps: int = 1,
        begin_step: int = 1,
    ) -> None:
        self.init_k_steps = _check_int(init_k_steps, "adaptive_localsgd_configs.init_k_steps")
        _check_int(begin_step, "adaptive_localsgd_configs.begin_step")
        super().__init__(model_params, group, k_steps=init_k_steps, begin_step=begin_step)
        self.loss_0: float | None = None
        self.lr_0: float | None = None
        self.last_mean_loss: float | None = None

    def step(self, loss: float | torch.Tensor | None = None, lr: float | None = None) -> bool:
        """Count one optimizer step with its ``loss`` and ``lr``; maybe average and adapt k.

        Returns whether the parameters were averaged at this step.
        """
        if loss is None or lr is None:
            raise TypeError(
                "AdaptiveLocalSGD.step needs this step's loss and learning rate: step(loss, lr)"
            )
        lr = float(lr)
        self.step_count += 1
        sync = self._is_sync_step()
        if not (sync or self.step_count == 1):
            return False
        mean_loss = self._mean_loss(loss)
        self.last_mean_loss = mean_loss
        if self.step_count == 1:
            self.loss_0, self.lr_0 = mean_loss, lr
        if sync:
            self.average_parameters()
            self._k_steps = self.next_k(mean_loss, lr)
        return sync

    def next_k(self, mean_loss: float, lr: float) -> int:
        """Fleet's rule for the next number of local steps (clamped to [1, 16])."""
        assert self.loss_0 is not None and self.lr_0 is not None
        num = self.lr_0 * mean_loss * self.init_k_steps
        den = lr * self.loss_0
        ratio = num / den if den != 0 else (math.inf if num > 0 else math.nan)
        if not ratio >= 0:  # NaN or negative: the formula says nothing; keep k
            return self._k_steps
        if ratio >= self.MAX_K_STEPS**2:
            return self.MAX_K_STEPS
        return max(self.MIN_K_STEPS, min(self.MAX_K_STEPS, math.ceil(math.sqrt(ratio))))

    def _mean_loss(self, loss: float | torch.Tensor) -> float:
        device = self._params[0].device
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    f"AdaptiveLocalSGD.step: loss must be a scalar, got shape {tuple(loss.shape)}"
                )
            t = loss.detach().reshape(1).to(device=device, dtype=torch.float64)
        else:
            t = torch.tensor([float(loss)], dtype=torch.float64, device=device)
        world = self.world_size
        if world > 1:
            with waiting("local SGD loss average", self.group):
                self._allreduce(t)
            t.div_(world)
        return float(t.item())

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(loss_0=self.loss_0, lr_0=self.lr_0, init_k_steps=self.init_k_steps)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.loss_0, self.lr_0 = state["loss_0"], state["lr_0"]
        self.init_k_steps = int(state["init_k_steps"])
