"""float16 AMP at sharding stage 3: dynamic loss scaling over FSDP2's sharded gradients.

The plumbing is the collective engine's: `Amp` multiplies the gradient reaching the model's
outputs by the loss scale S, and `LossScaler` (Fleet's rule, identical on every rank) adapts S
after each step. Here the reduce-scattered gradient shards (DTensors, float32) are divided by
S and checked for inf/NaN by torch's ``torch.amp.GradScaler.unscale_``: its check is one
fused kernel per dtype, and DTensor combines the flag over the shard group (a MAX), so every
rank gets the same answer. Reading that flag is the one host synchronisation per step.

torch's ``ShardedGradScaler`` was written for FSDP1's flat (plain-tensor) shards: on FSDP2's
DTensors it works too, but adds an all-reduce over the world on top of DTensor's own.
"""

from __future__ import annotations

from typing import Any

import torch

from longboat.collective.amp import LossScaler
from longboat.optim.staged import Stage, StageKind, StepRest, ZeroGradRest
from longboat.sharding.optimizer import FullyShardedStep


class ShardedLossScaling(Stage):
    """Unscale the gradient shards once per step (at ``model.clip_grad_norm_`` or the step);
    skip the step on every rank when any shard overflowed; adapt the scale."""

    kind = StageKind.LOSS_SCALING
    decides_on_gradients = True

    def __init__(self, scaler: LossScaler, sharded: FullyShardedStep, device_type: str) -> None:
        self.scaler = scaler
        self.sharded = sharded  # its optimizer (over the shards) is read at each step
        self.device_type = device_type
        self.unscaler = torch.amp.GradScaler(device_type, init_scale=scaler.scale)
        self.unscaler.scale(torch.ones((), device=device_type))  # creates its scale tensor
        self._found: torch.Tensor | None = None  # this step's overflow flag, once unscaled

    def unscale_(self) -> None:
        """Divide this step's gradient shards by the loss scale (once; collective)."""
        if self._found is not None:
            return
        optimizer = self.sharded.optimizer
        # the scaler's scale, which an elastic State may have set since the last step
        self.unscaler.update(new_scale=float(self.scaler.scale))
        self.unscaler.unscale_(optimizer)
        # the flags GradScaler hands an optimizer that skips by itself (one per device)
        found = self.unscaler._found_inf_per_device(optimizer).values()
        self._found = torch.stack([f.to(self.device_type).sum() for f in found]).sum()

    def step(self, rest: StepRest, closure: Any = None, **kwargs: Any) -> Any:
        self.unscale_()
        assert self._found is not None
        finite = not bool(self._found)  # the step's one host read
        result = rest(closure, **kwargs) if finite else None
        self.scaler.update(finite)
        self._restart()
        return result

    def zero_grad(self, rest: ZeroGradRest, set_to_none: bool) -> None:
        self._restart()  # gradients unscaled (by clipping) but not stepped are dropped
        rest(set_to_none)

    def _restart(self) -> None:
        """The next step's gradients are unscaled anew (by the scaler's scale then)."""
        self._found = None

    def __repr__(self) -> str:
        return f"ShardedLossScaling(scale={self.scaler.scale})"
