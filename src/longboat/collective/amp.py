"""Automatic mixed precision for `lb.distribute` (Fleet's ``amp`` and ``amp_configs``).

The wrapped model's forward runs under ``torch.autocast`` in ``amp_configs['dtype']``. With
float16, the loss is scaled transparently: a gradient hook on the model's outputs multiplies
the gradient flowing back by the loss scale S, and the reducer divides by S together with the
world size while copying gradients into its buckets. A bucket whose allreduce contains inf or
NaN on any rank contains it on every rank (a sum with an inf is inf), so the reduced gradients
tell every rank the same thing: the optimizer skips that step everywhere and the scale shrinks
(Fleet's dynamic loss scaling: shrink by ``decr_ratio`` after ``decr_every_n_nan_or_inf``
overflows, grow by ``incr_ratio`` after ``incr_every_n_steps`` finite steps). bfloat16 has
float32's range and needs no scaling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LossScaler:
    """Fleet's dynamic loss scaling state, identical on every rank."""

    scale: float
    dynamic: bool = True
    incr_every_n_steps: int = 1000
    decr_every_n_nan_or_inf: int = 2
    incr_ratio: float = 2.0
    decr_ratio: float = 0.8
    good_steps: int = 0
    bad_steps: int = 0
    skipped_steps: int = 0
    history: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, float | int]:
        """What a checkpoint or an elastic ``State`` keeps: the scale and its counters (not
        the ``history``, which grows with every step)."""
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "bad_steps": self.bad_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.bad_steps = int(state["bad_steps"])
        self.skipped_steps = int(state["skipped_steps"])

    def update(self, finite: bool) -> None:
        """After a step: count it, and adapt the scale when dynamic."""
        if not finite:
            self.skipped_steps += 1
        if not self.dynamic:
            return
        if finite:
            self.good_steps, self.bad_steps = self.good_steps + 1, 0
            if self.good_steps == self.incr_every_n_steps:
                self.scale *= self.incr_ratio
                self.good_steps = 0
        else:
            self.bad_steps, self.good_steps = self.bad_steps + 1, 0
            if self.bad_steps == self.decr_every_n_nan_or_inf:
                self.scale *= self.decr_ratio
                self.bad_steps = 0
        self.history.append(self.scale)


class Amp:
    """The autocast context and, for float16, the loss scaler."""

    def __init__(self, configs: Mapping[str, Any], device_type: str):
        for key in ("custom_white_list", "custom_black_list", "custom_black_varnames"):
            if configs[key]:
                raise NotImplementedError(
                    f"amp_configs[{key!r}]: torch.autocast has fixed op lists; longboat cannot "
                    "move ops between them yet. Remove the list, or run those ops under "
                    "torch.autocast(enabled=False) in your model"
                )
        if configs["use_pure_fp16"]:
            raise NotImplementedError(
                "amp_configs['use_pure_fp16'] (a half-precision model with float32 master "
                "weights) is not implemented yet; use the default op-by-op autocast"
            )
        self.dtype = _DTYPES[configs["dtype"]]
        self.device_type = device_type
        self.scaler = (
            LossScaler(
                scale=float(configs["init_loss_scaling"]),
                dynamic=bool(configs["use_dynamic_loss_scaling"]),
                incr_every_n_steps=int(configs["incr_every_n_steps"]),
                decr_every_n_nan_or_inf=int(configs["decr_every_n_nan_or_inf"]),
                incr_ratio=float(configs["incr_ratio"]),
                decr_ratio=float(configs["decr_ratio"]),
            )
            if self.dtype == torch.float16
            else None
        )

    @property
    def scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            yield

    def scale_gradients_of(self, output: Any) -> None:
        """Multiply the gradient reaching every floating output tensor by the loss scale."""
        if self.scaler is None:
            return
        scale = self.scaler.scale
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
                t.register_hook(lambda g, s=scale: g * s)
