"""`StagedOptimizer`: the one way longboat adds behaviour to a user's optimizer.

``lb.distribute`` returns the user's optimizer (the *inner* one; LARS/LAMB when the strategy
swaps them in) wrapped with the stages the strategy asks for. A stage wraps the rest of the
step: it may run code before or after it, skip it, or change the inner's param groups while it
runs. `StageKind` is the one place their order is written, outermost first:

=================  ======================================================================
``TIMELINE``       records the whole step on the timeline's optimizer lane
``LOCAL_SGD``      after the rest, averages parameters on local SGD's schedule
``GRADIENT_MERGE`` runs the rest, and ``zero_grad``, only at gradient-merge boundaries
``LOSS_SCALING``   skips the rest when the reduced gradients overflowed; adapts the scale
``DGC_MOMENTUM``   turns the inner's momentum off while DGC applies it
``PARAMETER_SERVER`` the parameter-server engine's step, which steps the inner itself
``SHARDED_STEP``   sharding (ZeRO): steps an optimizer over this rank's shard instead of the
                   inner, then all-gathers the parameters
(inner)            the user's optimizer's own ``step``
=================  ======================================================================

The wrapper is a `torch.optim.Optimizer` whose ``param_groups``, ``state`` and ``defaults`` are
the inner's own objects, and whose ``state_dict``/``load_state_dict``/``add_param_group`` are the
inner's, so LR schedulers and checkpoints treat it as the inner optimizer. Other attributes
(torch's hook registries, an optimizer's own fields) are read from the inner.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Protocol

import torch

__all__ = [
    "Stage",
    "StageKind",
    "StagedOptimizer",
    "already_distributed",
    "claim",
    "claimed_by",
    "is_distributed",
]


class StageKind(enum.IntEnum):
    """Where a stage sits in the step, outermost first (see the module docstring for why)."""

    TIMELINE = enum.auto()
    LOCAL_SGD = enum.auto()
    GRADIENT_MERGE = enum.auto()
    LOSS_SCALING = enum.auto()
    DGC_MOMENTUM = enum.auto()
    PARAMETER_SERVER = enum.auto()
    SHARDED_STEP = enum.auto()


class StepRest(Protocol):
    """The rest of the step below a stage (the inner stages, then the inner optimizer)."""

    def __call__(self, closure: Any = None, /, **kwargs: Any) -> Any: ...


ZeroGradRest = Callable[[bool], None]


class Stage:
    """One part of a step. Subclasses set ``kind`` and override ``step`` and/or ``zero_grad``;
    by default both pass straight through to the rest."""

    kind: ClassVar[StageKind]
    #: the stage decides from this step's gradients before running the rest (skip, gate): a
    #: closure given to ``step`` is then evaluated before any stage runs
    decides_on_gradients: ClassVar[bool] = False

    def step(self, rest: StepRest, closure: Any = None, **kwargs: Any) -> Any:
        """Run this stage around ``rest(closure, **kwargs)``; returns the step's result."""
        return rest(closure, **kwargs)

    def zero_grad(self, rest: ZeroGradRest, set_to_none: bool) -> None:
        """Run this stage around ``rest(set_to_none)``."""
        rest(set_to_none)

    def state_dict(self, rest: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The optimizer's ``state_dict``: by default the rest's (the inner's)."""
        return rest()

    def load_state_dict(
        self, rest: Callable[[dict[str, Any]], None], state_dict: dict[str, Any]
    ) -> None:
        """Load ``state_dict``: by default into the rest (the inner)."""
        rest(state_dict)

    def __repr__(self) -> str:
        return type(self).__name__


class EvaluatedClosure:
    """``closure``, called once now (gradients enabled): its first call returns that result,
    later calls evaluate it again."""

    def __init__(self, closure: Callable[[], Any]) -> None:
        self.closure = closure
        with torch.enable_grad():
            self.first = closure()
        self._replayed = False

    def __call__(self) -> Any:
        if not self._replayed:
            self._replayed = True
            return self.first
        return self.closure()


_inners: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


_claims: weakref.WeakKeyDictionary[torch.optim.Optimizer, str] = weakref.WeakKeyDictionary()


def claim(optimizer: torch.optim.Optimizer, by: str) -> None:
    """Record that ``by`` (e.g. ``"hvd.DistributedOptimizer"``) averages the gradients of
    ``optimizer``'s parameters: ``lb.distribute`` and every other wrapper then refuse it (the
    gradients would be averaged twice, at twice the communication)."""
    _claims[optimizer] = by


def claimed_by(optimizer: object) -> str | None:
    """Who already distributes ``optimizer`` (``"lb.distribute"`` for a `StagedOptimizer` or
    its inner), or None."""
    if isinstance(optimizer, StagedOptimizer) or (
        isinstance(optimizer, torch.optim.Optimizer) and optimizer in _inners
    ):
        return "lb.distribute"
    if isinstance(optimizer, torch.optim.Optimizer):
        return _claims.get(optimizer)
    return None


def is_distributed(optimizer: object) -> bool:
    """Whether ``optimizer`` is a `StagedOptimizer`, the inner optimizer of one, or an
    optimizer another wrapper claimed (`claim`)."""
    return claimed_by(optimizer) is not None


def already_distributed(optimizer: object) -> str:
    """The refusal for an optimizer that `claimed_by` names."""
    return f"this optimizer was already passed to {claimed_by(optimizer)}"


class StagedOptimizer(torch.optim.Optimizer):
    """``inner`` with ``stages`` run around its ``step`` and ``zero_grad`` in `StageKind` order,
    whatever order they are given or added in (one stage per kind).

    ``step(closure, **kwargs)``: the stages may read keywords (local SGD's ``loss``); what they
    leave reaches the inner's ``step``. An optimizer is wrapped once: a `StagedOptimizer`, or an
    optimizer that is already the inner of one, is refused.
    """

    def __init__(self, inner: torch.optim.Optimizer, stages: Iterable[Stage] = ()) -> None:
        # no Optimizer.__init__: the param groups, state, defaults and hooks are the inner's
        if is_distributed(inner):
            raise ValueError(f"{already_distributed(inner)}: use the optimizer it returned")
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(inner).__name__}")
        self.inner = inner
        self._stages: tuple[Stage, ...] = ()
        for stage in stages:
            self.set_stage(stage)
        _inners.add(inner)

    # -- the stages -------------------------------------------------------------------------

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages, outermost first (`StageKind` order)."""
        return self._stages

    def stage(self, kind: StageKind) -> Stage | None:
        """The stage of ``kind``, or None."""
        return next((s for s in self._stages if s.kind == kind), None)

    def set_stage(self, stage: Stage) -> None:
        """Add ``stage`` at its kind's place, replacing the stage of that kind if any."""
        kept = [s for s in self._stages if s.kind != stage.kind]
        self._stages = tuple(sorted([*kept, stage], key=lambda s: s.kind))

    def remove_stage(self, kind: StageKind) -> None:
        """Remove the stage of ``kind`` (nothing if there is none)."""
        self._stages = tuple(s for s in self._stages if s.kind != kind)

    # -- step and zero_grad through the stages --------------------------------------------

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        """The stages, outermost first, then the inner's ``step``.

        With a ``closure`` (Lightning, LBFGS) and a stage that decides from this step's
        gradients (loss scaling, gradient merge), the closure's forward and backward run first,
        so the stage sees them; the inner then gets a closure whose first call returns that
        result and whose later calls evaluate again (LBFGS's line search). Without such a stage
        the closure reaches the inner untouched.
        """
        if closure is None or not any(s.decides_on_gradients for s in self._stages):
            return self._step_from(0, closure, kwargs)
        evaluated = EvaluatedClosure(closure)
        result = self._step_from(0, evaluated, kwargs)
        return evaluated.first if result is None else result

    def _step_from(self, i: int, closure: Any, kwargs: dict[str, Any]) -> Any:
        if i == len(self._stages):
            return self.inner.step(closure, **kwargs)

        def rest(closure: Any = None, /, **kwargs: Any) -> Any:
            return self._step_from(i + 1, closure, kwargs)

        return self._stages[i].step(rest, closure, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The stages (the gradient-merge gate skips it between boundaries), then the inner's."""
        self._zero_grad_from(0, set_to_none)

    def _zero_grad_from(self, i: int, set_to_none: bool) -> None:
        if i == len(self._stages):
            self.inner.zero_grad(set_to_none)
            return
        self._stages[i].zero_grad(lambda s: self._zero_grad_from(i + 1, s), set_to_none)

    # -- the inner's state, shared ------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    def state_dict(self) -> dict[str, Any]:
        """The inner's ``state_dict`` through the stages (checkpoints are interchangeable with
        the inner's: sharding gathers its shards into that layout)."""
        return self._state_dict_from(0)

    def _state_dict_from(self, i: int) -> dict[str, Any]:
        if i == len(self._stages):
            return self.inner.state_dict()
        return self._stages[i].state_dict(lambda: self._state_dict_from(i + 1))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The inner's ``load_state_dict`` through the stages."""
        self._load_state_dict_from(0, state_dict)

    def _load_state_dict_from(self, i: int, state_dict: dict[str, Any]) -> None:
        if i == len(self._stages):
            self.inner.load_state_dict(state_dict)
            return
        self._stages[i].load_state_dict(
            lambda sd: self._load_state_dict_from(i + 1, sd), state_dict
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The inner's ``add_param_group``."""
        self.inner.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        # only for names the wrapper lacks: torch's hook registries, the inner's own fields
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        stages = ", ".join(map(repr, self._stages))
        return f"{type(self).__name__}({self.inner!r}, stages=[{stages}])"
