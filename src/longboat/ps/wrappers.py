"""The model and optimizer a parameter-server trainer uses (``lb.distribute`` returns them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from longboat.ps.engine import PSEngine


class PSModel(nn.Module):
    """The model as the trainer uses it; ``.module`` is the original, ``.engine`` the engine."""

    def __init__(self, module: nn.Module, engine: PSEngine) -> None:
        super().__init__()
        self.module = module
        self.engine = engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.engine.synchronize()
        trace = self.engine.trace
        if trace is None:
            return self.module(*args, **kwargs)
        trace.forward_begin()
        output = self.module(*args, **kwargs)
        trace.forward_end(output)
        return output


class PSOptimizer:
    """The optimizer as the trainer uses it: ``step()`` runs the parameter-server step."""

    def __init__(self, engine: PSEngine, inner: torch.optim.Optimizer) -> None:
        self.engine, self.inner = engine, inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("the parameter-server optimizer takes no closure")
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
