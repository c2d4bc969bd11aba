"""The module ``lb.distribute`` returns at sharding stage 3: the user's module, sharded by FSDP2,
with longboat's gradient merge, global-norm clipping and a ``state_dict`` in the plain layout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from longboat.collective.amp import Amp
from longboat.collective.consistency import broadcast_state
from longboat.sharding.amp import ShardedLossScaling
from longboat.sharding.policies import FullyShardPolicy
from longboat.sharding.state import full_model_state, load_full_model_state


class FullyShardedModel(nn.Module):
    """Call it like your module; ``model.module`` is your module, sharded in place by
    ``fully_shard`` (its parameters are DTensors holding this rank's shard).

    Gradient merge (``gradient_merge_configs.k_steps = k``) counts training forwards: only the
    backward of every k-th reduce-scatters, the others accumulate whole gradients locally
    (FSDP2's ``set_requires_gradient_sync``); ``no_sync()`` does the same for the forwards run
    inside it. ``state_dict()`` / ``load_state_dict()`` use the plain layout of the unsharded
    module (collective: every rank calls them). With float16 AMP the gradients reaching the
    outputs are multiplied by the loss scale, and the shards are divided by it in
    ``clip_grad_norm_`` or ``optimizer.step()``, whichever comes first.
    """

    def __init__(
        self,
        module: nn.Module,
        policy: FullyShardPolicy,
        *,
        k_steps: int = 1,
        merge_avg: bool = False,
        broadcast_buffers: bool = False,
        amp: Amp | None = None,
        scaling: ShardedLossScaling | None = None,
    ) -> None:
        super().__init__()
        self.take(module, policy)
        self.k_steps = k_steps
        self.merge_avg = merge_avg
        self.broadcast_buffers = broadcast_buffers
        self.amp = amp  # float16: the loss scale is applied to the outputs' gradients
        self.scaling = scaling
        self._no_sync = False

    def take(self, module: nn.Module, policy: FullyShardPolicy) -> None:
        """Wrap ``module`` (sharded by ``policy``) from the first micro-step: at construction,
        and when an elastic job shards the model anew over a new world."""
        if not isinstance(module, FSDPModule):
            raise TypeError("FullyShardedModel wraps a module fully_shard was applied to")
        self.module = module
        self.policy = policy
        self.micro_step = 0
        self._synced = True  # whether the last training forward's backward reduce-scatters

    @property
    def fsdp(self) -> FSDPModule:
        """The root FSDP module (your module)."""
        return self.module  # type: ignore[return-value]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            self.micro_step += 1
            sync = not self._no_sync and self.is_merge_boundary()
            if sync != self._synced:
                self.fsdp.set_requires_gradient_sync(sync)
                self._synced = sync
            if self.broadcast_buffers and sync:
                buffers = list(self.module.buffers())
                if buffers:
                    broadcast_state(buffers, coalesce=True)
            output = self.module(*args, **kwargs)
            if self.amp is not None:
                self.amp.scale_gradients_of(output)
            return output
        return self.module(*args, **kwargs)

    def is_merge_boundary(self) -> bool:
        """True when the current micro step completes a gradient-merge cycle."""
        return self.micro_step % self.k_steps == 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them for the forwards (and their backwards)
        inside this block; the next synced backward reduces the sum."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their norm over every rank's shards (the norm of the whole
        gradients, as one process would take it); returns it. Call it between backward and
        ``optimizer.step()``, on every rank."""
        from longboat.sharding.optimizer import clip_sharded_grad_norm_

        if self.scaling is not None:
            self.scaling.unscale_()  # float16: clip the true gradients
        return clip_sharded_grad_norm_(list(self.module.parameters()), max_norm, norm_type)

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The state dict of the unsharded run, with whole tensors on the CPU: keys
        ``module.<your module's>``, as the model ``lb.distribute`` returns without sharding
        gives them. Collective: call it on every rank."""
        if args or destination is not None or keep_vars:
            raise TypeError("state_dict() of a stage 3 model takes only prefix=")
        return {f"{prefix}module.{k}": v for k, v in full_model_state(self.module).items()}

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a whole (unsharded) state dict, keys as ``state_dict()`` gives them or your
        module's own: each rank keeps its shards."""
        if assign:
            raise TypeError("load_state_dict(assign=True) cannot keep the parameters sharded")
        if state_dict and all(k.startswith("module.") for k in state_dict):
            state_dict = {k.removeprefix("module."): v for k, v in state_dict.items()}
        return load_full_model_state(self.module, state_dict, strict=strict)
