"""The model and optimizer a parameter-server trainer uses (``lb.distribute`` returns them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from longboat.optim.staged import Stage, StagedOptimizer, StageKind, StepRest

if TYPE_CHECKING:
    from longboat.trace.ps import PSObserver


class SteppingEngine(Protocol):
    """What the wrappers read of their engine (a ``PSEngine``)."""

    @property
    def trace(self) -> PSObserver | None: ...

    def synchronize(self) -> None: ...

    def step(self) -> None: ...


EngineT = TypeVar("EngineT", bound=SteppingEngine)


class PSModel(nn.Module, Generic[EngineT]):
    """The model as the trainer uses it; ``.module`` is the original, ``.engine`` the engine."""

    def __init__(self, module: nn.Module, engine: EngineT) -> None:
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


class EngineStep(Stage):
    """The parameter-server step in place of the inner's: the engine pushes gradients, steps
    the inner optimizer itself where its mode says (or leaves it to the servers) and pulls."""

    kind = StageKind.PARAMETER_SERVER

    def __init__(self, engine: SteppingEngine) -> None:
        self.engine = engine

    def step(self, rest: StepRest, closure: Any = None, **kwargs: Any) -> None:
        if closure is not None:
            raise ValueError("the parameter-server optimizer takes no closure")
        if kwargs:
            raise TypeError(f"the parameter-server optimizer takes no {sorted(kwargs)}")
        self.engine.step()


class PSOptimizer(StagedOptimizer, Generic[EngineT]):
    """The optimizer as the trainer uses it: ``inner`` with the `EngineStep` stage, so
    ``step()`` runs the parameter-server step; ``zero_grad``, ``param_groups`` and
    ``state_dict`` are the inner's."""

    def __init__(self, engine: EngineT, inner: torch.optim.Optimizer) -> None:
        super().__init__(inner, [EngineStep(engine)])
        self.engine = engine
